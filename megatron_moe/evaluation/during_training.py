"""Periodic downstream evaluation during training (issue #46 item 7, docs/evaluation.md):

    evaluation:
      lm_eval_tasks: [stdlib_mc, stdlib_gen]   # lm-eval task names; [] = never
      lm_eval_include_path: configs/eval_tasks # extra task YAMLs
      lm_eval_interval: 50                     # every 50 iterations and after the last (0: after the last only)
      lm_eval_limit: null                      # at most this many documents per task
      lm_eval_batch_size: 8

The trainer (training/trainer.py, `TRAINING_EVALS`) builds a `PeriodicLMEval` once, before the first
iteration: it checks the tasks exist, that the run has a tokenizer (the data pipeline's) and that
generation tasks meet a dropless model. After a due iteration every rank runs lm-eval's `evaluate` on
the training model itself (`MegatronMoELM(model=...)`: the same requests on every rank, so tensor /
expert parallel layouts run them collectively; pipeline stages are refused by the config check), and
the numeric metrics go into that iteration's record as `lm_eval: {task: {metric: value}}`
(metrics.jsonl; TensorBoard `lm_eval/<task>/<metric>`). Training is unchanged: the forwards run
under `no_grad` in eval mode (balancers learn nothing, no dropout), no data is read, and the random
states of Python, NumPy, torch (CPU / CUDA) and the model's dropout streams are restored afterwards
(tests/unit/test_lm_eval_training.py: the same losses bitwise with and without).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from typing import Dict

import numpy as np
import torch

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.validate import section_check
from megatron_moe.training.trainer import TRAINING_EVALS

INSTALL = "pip install -e '.[eval]'"


@section_check("evaluation")
def _check_evaluation(cfg, world_size: int) -> None:
    ev = cfg.evaluation
    if not isinstance(ev.lm_eval_tasks, (list, tuple)) or not all(isinstance(t, str) and t for t in ev.lm_eval_tasks):
        raise ConfigError(f"evaluation.lm_eval_tasks must be a list of lm-eval task names; got {ev.lm_eval_tasks!r}")
    if ev.lm_eval_interval < 0 or ev.lm_eval_batch_size < 1 or (ev.lm_eval_limit is not None and ev.lm_eval_limit < 1):
        raise ConfigError(f"evaluation: lm_eval_interval must be >= 0 (got {ev.lm_eval_interval}), lm_eval_batch_size "
                          f">= 1 (got {ev.lm_eval_batch_size}), lm_eval_limit null or >= 1 (got {ev.lm_eval_limit})")
    if ev.lm_eval_include_path is not None and not os.path.isdir(ev.lm_eval_include_path):
        raise ConfigError(f"evaluation.lm_eval_include_path {ev.lm_eval_include_path}: no such directory")
    if not ev.lm_eval_tasks:
        return
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"evaluation.lm_eval_tasks needs lm-evaluation-harness, which is not installed: {INSTALL}")
    if cfg.parallel.pipeline > 1:
        raise ConfigError(f"evaluation.lm_eval_tasks runs on tensor / expert parallel layouts; parallel.pipeline="
                          f"{cfg.parallel.pipeline} is not supported (evaluate a checkpoint with tools/evaluate.py)")


def _leaf_tasks(task_dict) -> Dict[str, object]:
    """{name: Task} of lm-eval's task dict (groups flattened)."""
    tasks = task_dict.get("tasks") if isinstance(task_dict, dict) and "tasks" in task_dict else None
    if tasks is not None:
        return dict(tasks)
    out = {}
    for key, value in task_dict.items():
        if isinstance(value, dict):
            out.update(_leaf_tasks(value))
        elif value is not None:
            out[getattr(key, "group_name", key) if not isinstance(key, str) else key] = value
    return out


@contextlib.contextmanager
def training_state_kept(model: torch.nn.Module):
    """Eval mode and the random states of the run kept: restored (and train mode) on exit."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    dropout = getattr(model, "dropout_rng", None)
    dropout_state = dropout.state_dict() if dropout is not None else None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])
        if dropout_state is not None:
            dropout.load_state_dict(dropout_state)


def flat_metrics(results: dict) -> Dict[str, Dict[str, float]]:
    """lm-eval's results -> {task: {metric: value}} of the numeric metrics (`acc,none` -> `acc`; another
    filter than `none` -> `acc_<filter>`; standard errors left out)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if "stderr" in metric or not filt or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            row[metric if filt == "none" else f"{metric}_{filt}"] = float(value)
        out[task] = row
    return out


class PeriodicLMEval:
    """`due(iteration)`, then `run()` -> the record's `lm_eval` entry (module docstring)."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.cfg, self.ev, self.model = cfg, cfg.evaluation, trainer.model
        self.train_iters = cfg.training.train_iters
        if importlib.util.find_spec("lm_eval") is None:
            raise ConfigError(f"evaluation.lm_eval_tasks needs lm-evaluation-harness, which is not installed: {INSTALL}")
        if not hasattr(self.model, "gather_logits") or getattr(self.model, "has_binary_loss", False):
            raise ConfigError("evaluation.lm_eval_tasks evaluates a GPT (causal) model; this run trains another")
        from megatron_moe.data.tokenizers import training_tokenizer

        spec = training_tokenizer(cfg)
        if spec is None:
            raise ConfigError("evaluation.lm_eval_tasks needs the run's tokenizer: train on a data pipeline "
                              "(data.path or the embedded corpus), not synthetic data")
        from megatron_moe.evaluation.lm_eval_model import MegatronMoELM, prefix_token
        from megatron_moe.inference import CausalLM

        tok = spec.build()
        self.lm = MegatronMoELM(model=CausalLM(self.model), tokenizer=tok, prefix_token_id=prefix_token(spec, tok),
                                batch_size=self.ev.lm_eval_batch_size, seed=cfg.training.seed)
        generating = [name for name, task in self.tasks().items()
                      if getattr(task, "OUTPUT_TYPE", None) == "generate_until"]
        if generating and cfg.moe.capacity_factor is not None:
            raise ConfigError(f"evaluation.lm_eval_tasks: {generating[0]} generates text, which runs dropless: set "
                              f"moe.capacity_factor=null or leave the task out")

    def tasks(self) -> Dict[str, object]:
        """Fresh task objects (lm-eval keeps requests on them); unknown names: one-line ConfigError."""
        from lm_eval.tasks import TaskManager, get_task_dict

        names, include = list(self.ev.lm_eval_tasks), self.ev.lm_eval_include_path
        manager = TaskManager(include_path=include, include_defaults=False) if include else None
        if manager is None or not all(manager.match_tasks([n]) for n in names):
            manager = TaskManager(include_path=include)  # lm-eval's own tasks too (indexing them takes seconds)
        unknown = [n for n in names if not manager.match_tasks([n])]
        if unknown:
            raise ConfigError(f"evaluation.lm_eval_tasks: unknown task {unknown[0]} (lm-eval's tasks and those under "
                              f"evaluation.lm_eval_include_path={include})")
        return _leaf_tasks(manager.load(names) if hasattr(manager, "load") else get_task_dict(names, manager))

    def due(self, iteration: int) -> bool:
        every = self.ev.lm_eval_interval
        return iteration == self.train_iters or (every > 0 and iteration % every == 0)

    def run(self) -> Dict[str, Dict[str, float]]:
        """Collective over every rank: the tasks on the model as it is now -> {task: {metric: value}}."""
        from lm_eval.evaluator import evaluate

        tasks = self.tasks()
        with training_state_kept(self.model):
            results = evaluate(lm=self.lm, task_dict=tasks, limit=self.ev.lm_eval_limit, bootstrap_iters=0,
                               log_samples=False)
        return flat_metrics(results)


@TRAINING_EVALS.register("evaluation.lm_eval_tasks")
def periodic_lm_eval(trainer) -> PeriodicLMEval:
    return PeriodicLMEval(trainer)
