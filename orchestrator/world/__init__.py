"""What exists outside the process: the queue, partitions, local processes, run and cache folders."""
