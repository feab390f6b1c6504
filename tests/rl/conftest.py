"""One intra-op thread for these tests (restored afterwards): the tiny models gain nothing from
more, and on a shared 2-core machine OpenMP's spinning threads make them many times slower."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
