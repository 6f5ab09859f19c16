"""One intra-op thread for these tiny models: on a shared 2-core box extra threads only contend."""

from __future__ import annotations

from tests.threads import one_thread  # noqa: F401 (autouse)
