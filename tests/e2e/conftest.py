"""Fixtures shared by the end-to-end tests."""
import sys

import pytest

from tests.e2e.slurm_cluster import require_slurm, slurm_cluster


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory):
    """One test SLURM cluster (tests/e2e/slurm_cluster.py) for every test that asks: the environment
    for its client commands, PYTHON = this interpreter."""
    require_slurm()
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield dict(env, PYTHON=sys.executable)
