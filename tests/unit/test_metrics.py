"""metrics.jsonl across a resume: records up to the checkpoint are kept, later ones replaced.
TensorBoard scalars from records of every shape the trainer emits (issue #27 item 1: a pipeline
run's `pipeline_compute_ms`, a dict of lists, crashed the run) and of shapes it does not: entries
that are no number are left out and reported once, never crash the run."""
import json

import numpy as np
import torch

from megatron_moe.training.metrics import MetricsLogger, open_jsonl, scalars


def test_resume_keeps_records_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "loss": float(i)}) + "\n" for i in range(1, 6)))
    with open_jsonl(str(path), resume_from=3) as f:
        f.write(json.dumps({"iteration": 4, "loss": 40.0}) + "\n")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["iteration"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    with open_jsonl(str(path), resume_from=0):  # a fresh run starts a new file
        pass
    assert path.read_text() == ""


def test_scalars_flatten_nested_records():
    record = {"iteration": 7, "loss": 1.5, "comm_bytes": {"all_to_all": 8},
              "expert_load_imbalance": [1.25, 1.0], "moe_schedule": [{"s1": 3, "s2": 1}],
              "pipeline_compute_ms": {"rank0": [2.5, 4.0]}}  # with pipeline stages: [forward, backward] per rank
    assert dict(scalars(record)) == {"loss": 1.5, "comm_bytes/all_to_all": 8.0,
                                     "expert_load_imbalance/layer0": 1.25, "expert_load_imbalance/layer1": 1.0,
                                     "moe_schedule/layer0/s1": 3.0, "moe_schedule/layer0/s2": 1.0,
                                     "pipeline_compute_ms/rank0/forward": 2.5, "pipeline_compute_ms/rank0/backward": 4.0}


# the fields each option adds, in the shapes Trainer.train_step / step_details / evaluate emit them
BASE = {"iteration": 3, "loss": 6.87, "aux_loss": 0.058, "lr": 9e-4, "grad_norm": 1.07, "tokens_per_sec": 2493.6,
        "iter_time_ms": 410.7, "comm_bytes": {"all_reduce": 262148}, "comm_bytes_inter_node": {},
        "time_ms": {"forward": 88.1, "backward": 164.0, "optimizer": 1.2, "comm_wait": 141.2},
        "comm_exposed_ms": {"all_reduce": 8.9}, "comm_total_ms": {"all_reduce": 8.9},
        "a2a_exposed_ms": {"forward": 0.0, "backward": 0.0}, "a2a_total_ms": {"forward": 0.0, "backward": 0.0},
        "skipped_iterations": 0, "expert_load_imbalance": [1.0, 1.1], "balance_degree": [55.6, 72.3],
        "dropped_fraction": [0.0, 0.5], "moe_schedule": [{"baseline": 8}, {"s1": 3, "s1+s2": 1}],
        "moe_replicas": [0.0, 1.0], "plan_ms": [0.0, 0.5], "trans_exposed_ms": [0.0, 0.1],
        "trans_total_ms": [0.0, 0.2], "agg_exposed_ms": [0.0, 0.3], "agg_total_ms": [0.0, 0.4],
        "optimizer_state_mb": {"rank0": 2.8, "rank1": 2.8}, "max_rss_mb": {"rank0": 442.8, "rank1": 402.5},
        "cuda_peak_mb": {"rank0": 10.0, "rank1": 11.0}}
OPTIONS = {
    "pipeline": {"pipeline_bubble": 0.73, "pipeline_bubble_ideal": 1 / 17,
                 "pipeline_compute_ms": {"rank0": [88.1, 164.01], "rank1": [97.72, 145.4]}},
    "vexperts": {"vexpert_moves": [2, 0], "vexpert_ops_total": {"expand": 1, "shrink": 1, "migrate": 0}},
    "eval": {"eval_loss": 6.82, "eval_ppl": 918.3},
    "bert": {"binary_loss": 0.69},
    "no MoE layer": {"expert_load_imbalance": [], "moe_replicas": [], "plan_ms": []},
}


def test_scalars_of_every_option_s_record():
    record = {key: value for fields in [BASE, *OPTIONS.values()] for key, value in fields.items()}
    skipped = {}
    got = dict(scalars(record, skipped))
    assert skipped == {}
    assert got["pipeline_compute_ms/rank1/forward"] == 97.72 and got["pipeline_compute_ms/rank0/backward"] == 164.01
    assert got["pipeline_bubble"] == 0.73 and got["vexpert_moves/layer0"] == 2.0
    assert got["vexpert_ops_total/expand"] == 1.0 and got["moe_schedule/layer1/s1+s2"] == 1.0
    assert got["optimizer_state_mb/rank1"] == 2.8 and got["cuda_peak_mb/rank0"] == 10.0
    assert got["eval_ppl"] == 918.3 and got["binary_loss"] == 0.69 and got["time_ms/comm_wait"] == 141.2
    assert "iteration" not in got and not any(tag.startswith("expert_load_imbalance") for tag in got)

    def leaves(value):  # one tag per number of the record, counted independently
        if isinstance(value, dict):
            return sum(leaves(v) for v in value.values())
        if isinstance(value, list):
            return sum(leaves(v) for v in value)
        return 1
    assert len(got) == leaves(record) - 1  # - iteration
    assert all(isinstance(v, float) for v in got.values())


def test_scalars_of_any_shape_flatten_or_skip_with_a_reason():
    record = {"iteration": 1, "none": None, "name": "s1", "flag": True, "np": np.float32(2.5), "npint": np.int64(7),
              "t0": torch.tensor(3.0), "t1": torch.tensor([1, 2]), "t2": torch.tensor([[1.0], [2.0]]),
              "arr": np.array([0.5, 1.5]), "per_stage": [[1, 2], [3]], "rows": [{"a": [1, None]}, {"b": "x"}],
              "tup": (4.0,), "cplx": 1 + 2j, "obj": object(), "empty": {}, "nested": {"x": {"y": {"z": 1}}}}
    skipped = {}
    got = dict(scalars(record, skipped))
    assert got == {"flag": 1.0, "np": 2.5, "npint": 7.0, "t0": 3.0, "t1/layer0": 1.0, "t1/layer1": 2.0,
                   "t2/layer0/0": 1.0, "t2/layer1/0": 2.0, "arr/layer0": 0.5, "arr/layer1": 1.5,
                   "per_stage/layer0/0": 1.0, "per_stage/layer0/1": 2.0, "per_stage/layer1/0": 3.0,
                   "rows/layer0/a/0": 1.0, "tup/layer0": 4.0, "nested/x/y/z": 1.0}
    assert set(skipped) == {"none", "name", "rows/layer0/a/1", "rows/layer1/b", "cplx", "obj"}
    assert skipped["none"] == "no value (None)" and skipped["name"] == "str 's1', not a number"
    assert skipped["cplx"].startswith("complex")


def test_logger_writes_every_shape_and_reports_skips_once(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(str(tmp_path), enabled=True, tensorboard=True, train_iters=2)
    for iteration in (1, 2):
        logger.log({**BASE, **OPTIONS["pipeline"], "iteration": iteration, "note": "warm-up",
                    "per_layer": torch.tensor([0.25, 0.75]), "maybe": None}, eta_s=1.0)
    logger.close()
    out = capsys.readouterr().out
    assert out.count("tensorboard: note not written (str 'warm-up', not a number)") == 1, out
    assert out.count("tensorboard: maybe not written (no value (None))") == 1, out
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("pipeline_compute_ms/rank1/backward")] == [
        (1, np.float32(145.4)), (2, np.float32(145.4))]
    assert [e.value for e in events.Scalars("per_layer/layer1")] == [0.75, 0.75]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["per_layer"] for r in records] == [[0.25, 0.75]] * 2 and records[0]["note"] == "warm-up"
