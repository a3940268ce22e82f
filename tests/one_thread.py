"""An autouse fixture for test modules that import it: torch runs on one intra-op thread during each test.

This CPU torch is very slow at small advanced-indexing ops (the TRACE cache's gathers) with more than one
intra-op thread; the previous thread count comes back after the test."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
