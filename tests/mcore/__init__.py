"""Real megatron-core as the oracle: several released versions installed side by side under
``.make/mcore/<version>`` (``make mcore``; ``make test`` and ``make test-fast`` run it), each imported only
in a subprocess that has that one version on ``sys.path`` (``tests/mcore/harness.py``)."""
