"""Shared pytest fixtures and the `gpu` marker's skip (`make test-gpu`)."""
import pytest
import torch


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A `gpu` test without CUDA is skipped before its fixtures run (no process is spawned)."""
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible (the gpu tests are for a GPU node: make test-gpu)")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
