"""Shared pytest fixtures, the `gpu` marker's skip (`make test-gpu`) and the suite's order."""
import os
from pathlib import Path

import pytest
import torch

# torch.compile in the tests (and the processes they start) compiles in-process: inductor's pool of
# compile workers costs more start-up (each imports torch) than it saves on a 2-core machine
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# `make test` runs test files on 3 xdist workers (--dist loadfile), handed out in collection order:
# the long files first, the many short unit files last to fill the gaps, so no worker ends
# alone on a long file (a stable sort: the order inside a file is kept)
FIRST = ("e2e/test_doc_examples.py", "e2e/test_sweep_slurm.py", "e2e/test_two_node.py", "e2e/test_sweep.py",
         "distributed/test_pipeline.py")
DIRECTORY_ORDER = ("e2e", "distributed", "unit")


def _rank(item) -> tuple:
    path = Path(str(item.fspath))
    relative = f"{path.parent.name}/{path.name}"
    first = FIRST.index(relative) if relative in FIRST else len(FIRST)
    directory = DIRECTORY_ORDER.index(path.parent.name) if path.parent.name in DIRECTORY_ORDER else 0
    return first, directory


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)


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
