"""Health tests share a 2-core machine with other sessions: one intra-op thread per process."""

from tests.threads import one_thread  # noqa: F401 (autouse)
