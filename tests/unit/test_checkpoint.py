"""Checkpoints on one process (issue 4): bitwise resume, crash safety under kill -9, corrupt and
incomplete checkpoints refused with a message naming the problem, pickled payloads refused."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from megatron_moe import load_model
from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.checkpoint import LATEST, checkpoint_dirs, newest_complete
from megatron_moe.training.checkpoint_files import write_manifest
from megatron_moe.training.failures import CheckpointError
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_datasets

ROOT = Path(__file__).resolve().parents[2]
BASE = ["training.train_iters=4", "training.log_interval=1", "training.eval_interval=0",
        "training.micro_batch_size=2", "training.global_batch_size=4", "model.seq_length=16",
        "logging.tensorboard=false", "optimizer.warmup_iters=1", "model.vocab_size=128"]


def config(tmp, extra=()):
    return load_config("configs/gpt_moe_tiny.yaml", BASE + [f"training.run_dir={tmp}/run", f"checkpoint.dir={tmp}/ckpt"]
                       + list(extra))


def train(tmp, extra=()):
    trainer = Trainer(config(tmp, extra), ParallelState.single_process(), datasets=synthetic_datasets)
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in trainer.train()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 iterations with dropout, a checkpoint every 2 (keep_last=1 prunes iteration 2 away)."""
    tmp = tmp_path_factory.mktemp("run")
    records = train(tmp, ["model.dropout=0.1", "checkpoint.save_interval=2", "checkpoint.keep_last=0"])
    return tmp, records


def test_resume_is_bitwise_and_pruning_keeps_last(run, tmp_path):
    tmp, reference = run
    resumed = train(tmp_path, ["model.dropout=0.1", f"checkpoint.load={tmp}/ckpt/iter_0000002",
                               "checkpoint.save_interval=1", "checkpoint.keep_last=1"])
    assert resumed == reference[2:]  # same iterations, losses and grad norms, bit for bit
    ckpt = tmp_path / "ckpt"
    assert [os.path.basename(p) for p in checkpoint_dirs(str(ckpt))] == ["iter_0000004"]
    assert (ckpt / LATEST).read_text().strip() == "iter_0000004"
    # auto resume from the newest complete checkpoint: nothing left to do
    assert train(tmp_path, ["model.dropout=0.1", "checkpoint.load=auto"]) == []


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_and_incomplete_checkpoints_are_refused(run, tmp_path):
    tmp, _ = run
    good = tmp / "ckpt" / "iter_0000004"
    bad = _copy(good, tmp_path / "flipped")
    data = sorted(bad.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"file {data.name} is corrupt"):
        load_model(str(bad))
    short = _copy(good, tmp_path / "truncated")
    (short / "meta.json").write_text("{}")
    with pytest.raises(CheckpointError, match="file meta.json has 2 bytes"):
        load_model(str(short))
    partial = _copy(good, tmp_path / "partial")
    (partial / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete: no manifest.json"):
        load_model(str(partial))
    # `auto` skips a broken newest checkpoint and takes the previous complete one
    root = tmp_path / "root"
    _copy(good, root / "iter_0000004")
    _copy(bad, root / "iter_0000006")
    assert newest_complete(str(root)) == str(root / "iter_0000004")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch " + str(_Exploit.marker),))


def test_pickled_payloads_are_refused(run, tmp_path):
    tmp, _ = run
    good = tmp / "ckpt" / "iter_0000004"
    # a .metadata that would run code when unpickled (manifest rewritten: it "looks" complete)
    evil = _copy(good, tmp_path / "evil")
    _Exploit.marker = tmp_path / "pwned"
    (evil / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    write_manifest(str(evil))
    with pytest.raises(CheckpointError, match=r"\.metadata refused \(global (posix|os)\.system is not allowed\)"):
        load_model(str(evil))
    assert not _Exploit.marker.exists()
    # a checkpoint whose entries are pickled objects rather than tensors
    objects = tmp_path / "objects"
    dcp.save({"model/embedding.word.weight": "not a tensor"}, checkpoint_id=str(objects), no_dist=True)
    for name in ("meta.json", "config.yaml"):
        (objects / name).write_bytes((good / name).read_bytes())
    write_manifest(str(objects))
    with pytest.raises(CheckpointError, match="'model/embedding.word.weight' is a pickled payload; refused"):
        load_model(str(objects))


CHILD = textwrap.dedent("""
    import sys, time
    from megatron_moe.training import checkpoint, checkpoint_files
    from tests.unit.test_checkpoint import train

    real = checkpoint_files.write_manifest
    def slow_manifest(path):  # the DCP files of the 2nd save are written; hang before the manifest
        if "iter_0000002" in path:
            print("SAVING", path, flush=True)
            time.sleep(600)
        real(path)
    checkpoint.write_manifest = slow_manifest
    train(sys.argv[1], ["checkpoint.save_interval=1", "checkpoint.keep_last=1"])
""")


def test_kill_9_during_save_leaves_previous_checkpoint(tmp_path, one_thread):
    # one thread here as in the child: the resumed run must see the bits the child saved
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in child.stdout:
            if line.startswith("SAVING"):
                child.send_signal(signal.SIGKILL)
                break
    finally:
        child.kill()
        output = child.communicate(timeout=30)[0]
    assert child.returncode == -signal.SIGKILL, output
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "iter_0000002.tmp" / ".metadata").exists()  # the interrupted save got far
    assert newest_complete(str(ckpt)) == str(ckpt / "iter_0000001")
    assert (ckpt / LATEST).read_text().strip() == "iter_0000001"
    load_model(str(ckpt))
    # resuming picks iteration 1 and continues exactly like an uninterrupted run
    reference = train(tmp_path / "ref")
    assert train(tmp_path, ["checkpoint.load=auto"]) == reference[1:]


@pytest.mark.parametrize("overrides,message", [
    (["checkpoint.keep_last=-1"], "checkpoint.save_interval and checkpoint.keep_last must be >= 0"),
    (["training.eval_only=true"], "training.eval_only=true evaluates a checkpoint: set checkpoint.load"),
])
def test_checkpoint_config_errors(overrides, message):
    from megatron_moe.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config(load_config("configs/gpt_moe_tiny.yaml", overrides), 1)
