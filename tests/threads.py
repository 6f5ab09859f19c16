"""One intra-op thread per test process for the tiny models: on a shared 2-core machine extra threads
only contend, and one thread keeps float reductions identical between in-process and subprocess runs
(the bitwise loss comparisons). A package's conftest opts in with ``from tests.threads import one_thread``.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
