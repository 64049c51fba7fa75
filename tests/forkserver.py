"""The test process's one forkserver, shared by tests/distributed (`harness.run_distributed`) and the
e2e launches of the entry points (`tests/e2e/test_train_cli.launch_ranks`).

A fresh interpreter spends ~3.5 s of CPU on this machine importing torch, torch._dynamo (which
torch's optimizers import when they are built) and megatron_moe before doing anything; on 2 cores
that was most of a short test run. The forkserver imports them once (`PRELOAD`), and every
process the tests start forks from it. It only imports: it holds no OpenMP pool, CUDA context or
process group when a child forks from it (the state a DataLoader forks its workers from).

`run_script` makes such a child behave as `python -u SCRIPT ARGS` started in `cwd` with exactly
`env` would: `sys.argv`, `sys.path[0]`, the environment, torch's thread count from
`OMP_NUM_THREADS`, stdout/stderr into files, `__main__` run as a script, atexit handlers and the
exit code (SystemExit's, 1 on an uncaught exception with its traceback on stderr). What a fresh
interpreter runs at start-up from the environment (a `sitecustomize` on PYTHONPATH) does not run
again: a test passes such code as `hooks`.
"""
from __future__ import annotations

import atexit
import io
import os
import runpy
import sys
import traceback
from typing import Dict, List, Sequence

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.utils.tensorboard", "megatron_moe.plugins",
           "megatron_moe.training.trainer", "megatron_moe.training.entry", "megatron_moe.model.gpt",
           "megatron_moe.model.bert", "tests.forkserver", "tests.distributed.harness"]


def context():
    """The forkserver multiprocessing context (`PRELOAD` takes effect when this process first starts
    the server)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_script(script: str, args: List[str], env: Dict[str, str], cwd: str, out: str, err: str,
               hooks: Sequence[str] = ()) -> None:
    """In a forked child: `python -u script *args` (module docstring); stdout into file `out`,
    stderr into `err`. `hooks` ("module:function") are called first, as a `sitecustomize` would be
    in a fresh interpreter. Never returns."""
    import importlib

    import torch

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True)
                              for fd in (1, 2))
    if env.get("OMP_NUM_THREADS"):  # what a fresh interpreter's torch reads when it loads
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        for hook in hooks:
            module, _, function = hook.partition(":")
            getattr(importlib.import_module(module), function)()
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - as the interpreter would: traceback, exit code 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
