"""Issue #46 item 7: lm-eval tasks during training (evaluation.lm_eval_*, evaluation/during_training.py).
Their results reach metrics.jsonl, TensorBoard and the console next to the loss at the configured
iterations, the training losses are bitwise those of the same run without them (dropout on: the
evaluation must not draw from the training RNG or read training data), and misconfigurations are
one-line ConfigErrors."""
import functools
import json
import os

import pytest

from megatron_moe.config import ConfigError, load_config, validate_config
from megatron_moe.data import embedded_corpus
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.trainer import Trainer

pytest.importorskip("lm_eval")
os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
TASKS = "[stdlib_mc,stdlib_gen]"
BASE = ["model.num_layers=1", "model.dropout=0.1", "data.embedded_vocab_size=512", "model.vocab_size=512",
        "training.train_iters=4", "training.micro_batch_size=2", "training.global_batch_size=4",
        "training.eval_interval=0", "training.log_interval=1", "checkpoint.save_interval=0"]


def _config(tmp, name, overrides=()):
    return load_config("configs/gpt_moe_tiny.yaml", BASE + [f"training.run_dir={tmp}/{name}",
                                                             f"data.cache_dir={tmp}/cache"] + list(overrides))


def _train(cfg):
    validate_config(cfg, 1)
    return Trainer(cfg, ParallelState.single_process()).train()


@pytest.fixture
def small_corpus(monkeypatch):
    monkeypatch.setattr(embedded_corpus, "ensure_embedded_corpus",
                        functools.partial(embedded_corpus.ensure_embedded_corpus, max_bytes=150_000))


def test_results_logged_and_losses_unchanged(tmp_path, small_corpus, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plain = _train(_config(tmp_path, "plain"))
    with_eval = _train(_config(tmp_path, "eval", [f"evaluation.lm_eval_tasks={TASKS}", "evaluation.lm_eval_interval=3",
                                                  "evaluation.lm_eval_include_path=configs/eval_tasks",
                                                  "evaluation.lm_eval_limit=4", "evaluation.lm_eval_batch_size=3"]))
    assert [r["loss"] for r in with_eval] == [r["loss"] for r in plain]  # bitwise
    assert [r["grad_norm"] for r in with_eval] == [r["grad_norm"] for r in plain]
    assert [r["iteration"] for r in with_eval if "lm_eval" in r] == [3, 4]  # every 3 and after the last
    with open(tmp_path / "eval" / "metrics.jsonl") as f:
        logged = {r["iteration"]: r for r in map(json.loads, f)}
    for it in (3, 4):
        results = logged[it]["lm_eval"]
        assert set(results) == {"stdlib_mc", "stdlib_gen"}
        assert set(results["stdlib_mc"]) == {"acc", "acc_norm"} and set(results["stdlib_gen"]) == {"exact_match"}
        assert all(v in (0.0, 0.25, 0.5, 0.75, 1.0) for row in results.values() for v in row.values())  # 4 docs
    tags = EventAccumulator(str(tmp_path / "eval" / "tensorboard"), size_guidance={"scalars": 0}).Reload().Tags()
    assert {"lm_eval/stdlib_mc/acc", "lm_eval/stdlib_gen/exact_match", "loss"} <= set(tags["scalars"])
    out = capsys.readouterr().out
    assert "iter      3/4 | loss" in out and "| stdlib_mc acc " in out


@pytest.mark.parametrize("overrides, message", [
    (["evaluation.lm_eval_interval=-1"], "lm_eval_interval must be >= 0"),
    (["evaluation.lm_eval_batch_size=0"], "lm_eval_batch_size >= 1"),
    (["evaluation.lm_eval_limit=0"], "lm_eval_limit null or >= 1"),
    (["evaluation.lm_eval_include_path=no/such/dir"], "no/such/dir: no such directory"),
    ([f"evaluation.lm_eval_tasks={TASKS}", "parallel.pipeline=2", "model.num_layers=2", "training.global_batch_size=8"],
     "parallel.pipeline=2 is not supported"),
])
def test_config_checks(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_config(tmp_path, "x", overrides), 2 if "parallel.pipeline=2" in overrides else 1)


def test_lm_eval_not_installed_is_one_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs lm-evaluation-harness, which is not installed: pip install -e '\.\[eval\]'"):
        validate_config(_config(tmp_path, "x", [f"evaluation.lm_eval_tasks={TASKS}"]), 1)


def test_start_up_refusals(tmp_path, small_corpus):
    """Checked before the first iteration: unknown tasks, generation on a capacity-factor model, no tokenizer."""
    include = ["evaluation.lm_eval_include_path=configs/eval_tasks", "training.train_iters=1"]
    with pytest.raises(ConfigError, match="unknown task no_such_task"):
        _train(_config(tmp_path, "a", include + ["evaluation.lm_eval_tasks=[stdlib_mc,no_such_task]"]))
    with pytest.raises(ConfigError, match="stdlib_gen generates text, which runs dropless"):
        _train(_config(tmp_path, "b", include + [f"evaluation.lm_eval_tasks={TASKS}", "moe.capacity_factor=1.0"]))
