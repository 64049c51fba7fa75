"""The Makefile's set-up creates the checkout's `.venv` only when it is going to use it (issue #42
item 14): `make test PY=python` (or inside an active virtual environment) installs into that
interpreter and leaves no `.venv` behind, which the launch scripts would otherwise pick
(scripts/python_env.sh). A copy of the Makefile runs with stub interpreters on PATH that log their
arguments (and make a stub `.venv` for `-m venv`), and as a dry run (`make -n`): nothing is installed."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUB = """#!/bin/sh
echo "$0 $*" >> {log}
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
"""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _make_setup(tmp_path, *args, virtual_env=None, dry_run=False):
    """(stdout lines, the stubs' calls) of `make [-n] setup ARGS` in a fresh checkout (Makefile +
    pyproject.toml) under tmp_path/checkout."""
    checkout, stubs, log = tmp_path / "checkout", tmp_path / "bin", tmp_path / "calls.log"
    for directory in (checkout, stubs):
        directory.mkdir(exist_ok=True)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, checkout / name)
    for name in ("python", "python3"):
        (stubs / name).write_text(STUB.format(log=log))
        (stubs / name).chmod(0o755)
    # not the outer make's variables (`make test PY=python` passes PY down through MAKEFLAGS)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["PATH"] = f"{stubs}{os.pathsep}{env.get('PATH', '')}"
    if virtual_env:
        env["VIRTUAL_ENV"] = virtual_env
    proc = subprocess.run(["make", *(["-n"] if dry_run else []), "setup", *args], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().replace(f"{stubs}{os.sep}", "").splitlines() if log.exists() else []
    return proc.stdout.splitlines(), calls  # the stubs on PATH by name, the .venv's by its path


@pytest.mark.parametrize("args,virtual_env", [(["PY=python"], None), ([], "/some/venv")], ids=["PY", "VIRTUAL_ENV"])
def test_setup_with_another_python_creates_no_venv(tmp_path, args, virtual_env):
    lines, calls = _make_setup(tmp_path, *args, virtual_env=virtual_env, dry_run=True)
    assert not [line for line in lines if "venv" in line] and calls == [], lines
    assert "python -m pip install -q -e '.[dev]'" in lines, lines
    lines, calls = _make_setup(tmp_path, *args, virtual_env=virtual_env)
    assert not (tmp_path / "checkout" / ".venv").exists(), calls
    assert calls == ["python -m pip install -q --upgrade pip", "python -m pip install -q torch==2.13.0",
                     "python -m pip install -q -e .[dev]"]
    assert (tmp_path / "checkout" / ".setup-stamp").exists()


def test_setup_by_default_creates_and_uses_the_venv(tmp_path):
    lines, calls = _make_setup(tmp_path, dry_run=True)
    assert lines[0] == "python3 -m venv .venv" and calls == [], lines
    assert ".venv/bin/python -m pip install -q -e '.[dev]'" in lines
    lines, calls = _make_setup(tmp_path)
    assert calls[0] == "python3 -m venv .venv", calls  # python3 from PATH, then every install into the .venv
    assert len(calls) == 4 and all(call.startswith(".venv/bin/python -m pip install") for call in calls[1:]), calls
    assert (tmp_path / "checkout" / ".venv" / "bin" / "python").exists()
    (tmp_path / "checkout" / ".setup-stamp").unlink()  # an existing .venv is used as it is
    lines, _ = _make_setup(tmp_path, dry_run=True)
    assert not [line for line in lines if "venv " in line] and ".venv/bin/python -m pip install -q -e '.[dev]'" in lines
