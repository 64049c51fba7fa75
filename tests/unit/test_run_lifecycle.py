"""A run's lifecycle on one process (issue #43, items 1-5): Ctrl-C stops like SIGTERM (a second one
aborts at once); `--check-config` checks the checkpoint it would resume; a run never continues
another run's checkpoints, and a resume names what it changes; `training.lr_decay_iters` and the
line a changed LR schedule prints; `training.eval_only` gives training's evaluation number."""
import json
import math
import os
import signal

import pytest
import torch

from megatron_moe.config import ConfigError, load_config, validate_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.training import entry
from megatron_moe.training.checkpoint import checkpoint_dir
from megatron_moe.training.failures import INTERRUPT_EXIT, STOP_SIGNALS, CheckpointError, StopRequest
from megatron_moe.training.lr import learning_rate, lr_schedule, schedule_change
from megatron_moe.training.resume import check_resume
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import SyntheticTokens

CONFIG = "configs/gpt_moe_tiny.yaml"
BASE = ["training.train_iters=2", "training.log_interval=1", "training.eval_interval=1", "training.eval_iters=1",
        "training.micro_batch_size=2", "training.global_batch_size=4", "model.seq_length=16",
        "logging.tensorboard=false", "optimizer.warmup_iters=1", "checkpoint.save_interval=1", "checkpoint.keep_last=0"]


def datasets(cfg):
    """Synthetic train and valid samples (valid: other seeds than train's)."""
    n = cfg.training.train_iters * cfg.training.global_batch_size
    valid = SyntheticTokens(10 ** 6 + cfg.training.eval_iters * cfg.training.global_batch_size, cfg.model.seq_length,
                            cfg.model.vocab_size)
    return SyntheticTokens(n, cfg.model.seq_length, cfg.model.vocab_size), torch.utils.data.Subset(
        valid, range(10 ** 6, len(valid)))


def overrides(run_dir, *extra):
    return BASE + [f"training.run_dir={run_dir}"] + list(extra)


def trainer(run_dir, *extra):
    return Trainer(load_config(CONFIG, overrides(run_dir, *extra)), ParallelState.single_process(), datasets=datasets)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 iterations, evaluated and saved after each, into the default <run_dir>/checkpoints."""
    run_dir = tmp_path_factory.mktemp("lifecycle") / "run"
    records = trainer(run_dir).train()
    return run_dir, records


# -- item 1: Ctrl-C -------------------------------------------------------------------------------
@pytest.fixture
def saved_handlers():
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS + (signal.SIGINT,)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_sigint_stops_like_sigterm_and_a_second_aborts(saved_handlers, monkeypatch, capfd):
    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    with StopRequest(ParallelState.single_process(), torch.device("cpu")) as stop:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the iteration goes on
        assert stop.signal_name == "SIGINT" and stop.agreed()
        with pytest.raises(SystemExit) as second:
            os.kill(os.getpid(), signal.SIGINT)
        assert second.value.code == INTERRUPT_EXIT == 130
    os.kill(os.getpid(), signal.SIGTERM)  # stopping: repeats of SIGTERM are ignored ...
    with pytest.raises(SystemExit):
        os.kill(os.getpid(), signal.SIGINT)  # ... a Ctrl-C during the teardown still aborts at once
    lines = capfd.readouterr().err.splitlines()
    assert lines == ["SIGINT again: aborted at once, nothing saved (resume from the last checkpoint)"] * 2


def test_ctrl_c_outside_the_loop_is_one_line_exit_130(monkeypatch, capsys, tmp_path):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "train", interrupted)
    assert entry.main(GPTMoEModel, ["--config", CONFIG] + overrides(tmp_path)) == 130
    assert capsys.readouterr().err == "interrupted (SIGINT) outside the training loop: nothing saved\n"


# -- item 2: --check-config checks the checkpoint -------------------------------------------------
@pytest.mark.parametrize("change,needle", [
    ("moe.num_experts=16", "holds another model: moe.num_experts 8 -> 16"),
    ("model.vocab_size=2048", "holds another model: model.vocab_size 1024 -> 2048"),
    ("model.num_query_groups=2", "holds another model: model.num_query_groups 4 -> 2"),
    ("training.global_batch_size=8", "training.global_batch_size=8: resuming needs the same global batch size"),
])
def test_check_config_checks_the_checkpoint_it_resumes(run, capsys, change, needle):
    run_dir, _ = run
    argv = ["--check-config", "--config", CONFIG] + overrides(run_dir, "checkpoint.load=auto")
    assert entry.main(GPTMoEModel, argv + ["parallel.expert=2", "--world-size", "2"]) == 0  # the layout may change
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"resumes from {run_dir}/checkpoints/iter_0000002 (iteration 2)"
    assert out[2].startswith(f"nothing to train: {run_dir}/checkpoints/iter_0000002 is at iteration 2")
    assert entry.main(GPTMoEModel, argv + [change]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("config error: checkpoint.load=auto: ") and needle in err[0], err


# -- item 3: each run its own checkpoints; what a resume changes -------------------------------------
def test_checkpoint_dir_defaults_to_the_run_dir(run):
    run_dir, records = run
    assert checkpoint_dir(load_config(CONFIG, [f"training.run_dir={run_dir}"])) == f"{run_dir}/checkpoints"
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["iter_0000001", "iter_0000002", "latest"]
    assert [r["iteration"] for r in records] == [1, 2]


def test_auto_never_resumes_another_runs_checkpoint(run, tmp_path):
    run_dir, records = run
    shared = [f"checkpoint.dir={run_dir}/checkpoints", "checkpoint.load=auto", "moe.balancer=eplb"]
    with pytest.raises(CheckpointError, match=f"belongs to the run in training.run_dir={run_dir}, not to this "
                                              f"run's {tmp_path}/other: a new experiment starts fresh"):
        trainer(tmp_path / "other", *shared).train()
    assert not (tmp_path / "other").exists()  # nothing written: no config.yaml, metrics.jsonl, complete.json
    # a fresh run_dir with the default checkpoint.dir starts from scratch
    fresh = trainer(tmp_path / "fresh", "checkpoint.load=auto", "moe.balancer=eplb").train()
    assert [r["loss"] for r in fresh] == [r["loss"] for r in records]


def test_what_a_resume_may_change(run):
    run_dir, _ = run
    path = f"{run_dir}/checkpoints/iter_0000001"

    def check(*extra):
        return check_resume(load_config(CONFIG, overrides(run_dir, *extra)), path)

    assert check("checkpoint.load=auto", "parallel.expert=2", "optimizer.distributed=true") == []  # layout: silent
    notes = check("checkpoint.load=auto", "training.train_iters=4", "logging.routing_trace=true")
    assert notes[0] == ("checkpoint: resuming with changed settings: training.train_iters 2 -> 4, "
                        "logging.routing_trace false -> true")
    assert notes[1].startswith("lr schedule changed on resume (the decay ends at iteration 4, not 2")
    with pytest.raises(CheckpointError, match=r"trained with other settings: training.seed 1234 -> 7; "
                                              r"checkpoint.load=auto continues the same run"):
        check("checkpoint.load=auto", "training.seed=7")
    # a path: starting from another run's checkpoint on purpose (another seed, data, ...) warns
    assert check(f"checkpoint.load={path}", "training.seed=7") == [
        "checkpoint: resuming with changed settings: training.seed 1234 -> 7"]
    with pytest.raises(CheckpointError, match=r"holds another model: model.seq_length 16 -> 32"):
        check(f"checkpoint.load={path}", "model.seq_length=32")  # learned position embeddings [s, h]


def test_nothing_to_train_says_so_in_one_line(run, capsys):
    run_dir, _ = run
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert trainer(run_dir, "checkpoint.load=auto").train() == []
    out = capsys.readouterr().out.splitlines()
    assert out == [f"nothing to train: {run_dir}/checkpoints/iter_0000002 is at iteration 2 and "
                   "training.train_iters=2; raise training.train_iters to train on, or evaluate it with "
                   "training.eval_only=true"]
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # the run directory is left as it was
    assert (run_dir / "complete.json").exists()


def test_resume_reads_once_and_check_config_finds_by_names(run, tmp_path, monkeypatch):
    """`--check-config` finds the checkpoint as the trainer does (`load_path`, by names only: no
    hashing), reads its meta.json once; a run decides `nothing_to_train` once."""
    import shutil

    from megatron_moe.training import checkpoint, checkpoint_files, resume
    from megatron_moe.training import trainer as trainer_module

    run_dir, _ = run
    ckpts = tmp_path / "ckpts"
    shutil.copytree(run_dir / "checkpoints", ckpts)
    (ckpts / "iter_0000003").mkdir()  # a save that did not finish: no manifest
    cfg = load_config(CONFIG, overrides(run_dir, f"checkpoint.dir={ckpts}", "checkpoint.load=auto"))
    reads, hashes, decided = [], [], []
    monkeypatch.setattr(resume, "read_meta", lambda path: reads.append(path) or checkpoint.read_meta(path))
    monkeypatch.setattr(checkpoint_files, "_sha256", lambda path: hashes.append(path))
    lines = resume.preview_resume(cfg)
    assert lines[0] == f"resumes from {ckpts}/iter_0000002 (iteration 2)" and reads == [f"{ckpts}/iter_0000002"]
    assert hashes == []
    real = trainer_module.nothing_to_train
    monkeypatch.undo()  # hashing back for the trainer's load
    monkeypatch.setattr(trainer_module, "nothing_to_train", lambda *a: decided.append(a) or real(*a))
    assert trainer(run_dir, "checkpoint.load=auto").train() == [] and len(decided) == 1


# -- item 4: training.lr_decay_iters ----------------------------------------------------------------
def _lr_config(*extra):
    return load_config(None, ["optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "optimizer.warmup_iters=10",
                              "training.train_iters=60"] + list(extra))


def test_lr_decay_iters_values():
    decay40 = _lr_config("training.lr_decay_iters=40")
    assert learning_rate(decay40, 5) == pytest.approx(5e-4)  # warmup as before
    assert learning_rate(decay40, 25) == pytest.approx(5.5e-4)  # half of the 30 decay iterations
    assert learning_rate(decay40, 40) == pytest.approx(1e-4)
    assert learning_rate(decay40, 50) == learning_rate(decay40, 60) == pytest.approx(1e-4)  # min_lr after it
    default = _lr_config()  # null: decay until train_iters
    assert learning_rate(default, 35) == pytest.approx(5.5e-4) and learning_rate(default, 60) == pytest.approx(1e-4)
    schedule = lr_schedule(decay40)  # the trainer's: looked up once at start-up, the same values
    assert [schedule(i) for i in (1, 5, 25, 40, 60)] == [learning_rate(decay40, i) for i in (1, 5, 25, 40, 60)]
    with pytest.raises(ConfigError, match="training.lr_decay_iters=0 must be >= 1"):
        validate_config(_lr_config("training.lr_decay_iters=0"), 1)
    for decay in (10, 5):  # at or before the end of warmup: no decay left (Megatron-LM asserts warmup < decay)
        with pytest.raises(ConfigError, match=f"training.lr_decay_iters={decay} must be > optimizer.warmup_iters=10"):
            validate_config(_lr_config(f"training.lr_decay_iters={decay}"), 1)
    validate_config(_lr_config("training.lr_decay_iters=11"), 1)


def test_a_resume_that_reshapes_the_schedule_says_how_the_lr_moves():
    saved = _lr_config("training.train_iters=40")
    line = schedule_change(saved, _lr_config(), 40)
    assert line == ("lr schedule changed on resume (the decay ends at iteration 60, not 40, as training.lr_decay_iters"
                    "=null follows training.train_iters): lr 1.000e-04 at iteration 40 -> 3.843e-04 at iteration 41 "
                    "(1.000e-04 under the checkpoint's schedule), 1.000e-04 at iteration 60; "
                    "training.lr_decay_iters=40 keeps the checkpoint's schedule")
    assert learning_rate(_lr_config(), 41) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 31 / 50)))
    assert schedule_change(saved, _lr_config("training.lr_decay_iters=40"), 40) is None
    assert "optimizer.lr 0.001 -> 0.002" in schedule_change(saved, _lr_config("training.train_iters=40",
                                                                               "optimizer.lr=2e-3"), 20)


def test_trainer_follows_lr_decay_iters(tmp_path):
    records = trainer(tmp_path / "run", "training.train_iters=3", "training.lr_decay_iters=2",
                      "checkpoint.save_interval=0").train()
    assert [r["lr"] for r in records] == [3e-3, 3e-4, 3e-4]  # warmup 1, decayed by 2, min_lr at 3


# -- item 5: training.eval_only ----------------------------------------------------------------------
def test_eval_only_gives_trainings_evaluation(run, tmp_path, capsys):
    run_dir, records = run
    at1 = f"{run_dir}/checkpoints/iter_0000001"
    out = trainer(tmp_path / "eval", "training.eval_only=true", f"checkpoint.load={at1}").train()
    assert out[0]["eval_loss"] == records[0]["eval_loss"] and out[0]["eval_ppl"] == records[0]["eval_ppl"]
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (f"eval-only: {at1} (iteration 1) | eval loss {records[0]['eval_loss']:.4f} "
                    f"ppl {records[0]['eval_ppl']:.2f} | 1 valid batches")
    saved = json.loads((tmp_path / "eval" / "eval.jsonl").read_text())
    assert saved["eval_loss"] == records[0]["eval_loss"] and saved["iteration"] == 1
    assert sorted(os.listdir(tmp_path / "eval")) == ["eval.jsonl"]  # no metrics, config or checkpoints
