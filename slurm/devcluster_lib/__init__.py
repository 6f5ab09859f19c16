"""Implementation of ``slurm/devcluster``: a real Slurm cluster (munge, MariaDB, slurmdbd, slurmctld and two
slurmd nodes ``n1``/``n2``) on this one machine, with all state under one folder.

Standard library only: it runs before ``make install`` on a fresh machine.
"""
