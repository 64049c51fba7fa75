"""metrics.jsonl across a resume: records up to the checkpoint are kept, later ones replaced."""
import json

from megatron_moe.training.metrics import open_jsonl, scalars


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
                                     "pipeline_compute_ms/rank0/0": 2.5, "pipeline_compute_ms/rank0/1": 4.0}
