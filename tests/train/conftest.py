"""Training tests share a 2-core machine with other sessions: one intra-op thread per process, which
also keeps float reductions identical between in-process and subprocess runs (bitwise comparisons)."""

from tests.threads import one_thread  # noqa: F401 (autouse)
