"""tests/e2e/slurm_cluster.require_slurm: a test that needs SLURM skips where it is missing, but
fails under CI=true (.ci/run installs SLURM; CI must not go green without the SLURM tests)."""
import pytest

from tests.e2e.slurm_cluster import require_slurm

MISSING = ("no-such-slurm-tool",)


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_missing_slurm_fails_under_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"SLURM not installed \(missing no-such-slurm-tool\): as root run "
                                                    r"'apt-get install -y slurm-wlm munge' \(\.ci/run does\)"):
        require_slurm(MISSING, need_root=False)


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_missing_slurm_skips_outside_ci(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match=r"SLURM not installed \(missing no-such-slurm-tool\)"):
        require_slurm(MISSING, need_root=False)


def test_available_tools_neither_skip_nor_fail(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require_slurm(("sh",), need_root=False) is None
