"""Config loading, overrides, type errors and combination rules (no process groups)."""
import dataclasses
import os
import re

import pytest

from megatron_moe.config import Config, ConfigError, load_config, save_config, to_yaml, validate_config


def test_defaults_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  hidden_size: 32\nmoe:\n  num_experts: 8\n")
    cfg = load_config(str(f), ["parallel.tensor=2", "moe.top_k=1", "moe.capacity_factor=1.5"])
    assert cfg.model.hidden_size == 32 and cfg.moe.num_experts == 8
    assert cfg.parallel.tensor == 2 and cfg.moe.top_k == 1 and cfg.moe.capacity_factor == 1.5
    assert load_config(None, ["moe.capacity_factor=null"]).moe.capacity_factor is None
    assert "hidden_size: 32" in to_yaml(cfg)


@pytest.mark.parametrize("overrides,needle", [
    (["model.hiden_size=3"], "hiden_size"),
    (["nosection.x=1"], "nosection"),
    (["model.hidden_size=abc"], "model.hidden_size"),
    (["parallel.tensor"], "section.key=value"),
])
def test_unknown_keys_and_wrong_types(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,world,needles", [
    (["parallel.expert=3", "moe.num_experts=8"], 3, ["parallel.expert=3", "moe.num_experts=8"]),
    (["parallel.tensor=3"], 4, ["parallel.tensor"]),
    (["parallel.expert=2", "parallel.expert_shard=4", "moe.num_experts=4"], 4, ["parallel.expert_shard"]),
    (["parallel.tensor=2", "model.num_attention_heads=3", "model.hidden_size=48"], 2, ["model.num_attention_heads"]),
    (["parallel.expert_shard=2", "model.ffn_hidden_size=6", "moe.expert_ffn_hidden_size=5"], 2,
     ["parallel.expert_shard", "moe.expert_ffn_hidden_size"]),
    (["training.global_batch_size=6", "training.micro_batch_size=2"], 2, ["training.global_batch_size"]),
    # pipeline stages (model/pipeline_stages.py, training/pipeline_schedules.py)
    (["parallel.pipeline=2", "model.num_layers=3"], 2, ["model.num_layers=3", "parallel.pipeline"]),
    (["parallel.pipeline=2"], 3, ["parallel.pipeline"]),
    # an explicit non-interleaved schedule with virtual stages: a contradiction (alone, virtual_stages infers interleaved)
    (["parallel.pipeline=2", "parallel.pipeline_schedule=1f1b", "parallel.virtual_stages=2", "model.num_layers=4"], 2,
     ["parallel.pipeline_schedule=1f1b contradicts parallel.virtual_stages=2"]),
    (["parallel.pipeline=2", "parallel.pipeline_schedule=interleaved"], 2, ["parallel.pipeline_schedule=interleaved",
                                                                          "parallel.virtual_stages"]),
    (["parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2", "model.num_layers=4"], 1,
     ["parallel.pipeline_schedule=interleaved", "parallel.pipeline"]),
    (["parallel.pipeline=2", "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2",
      "model.num_layers=4", "training.global_batch_size=6", "training.micro_batch_size=2"], 2,
     ["parallel.pipeline_schedule=interleaved", "parallel.pipeline=2", "training.global_batch_size"]),
    (["parallel.pipeline=2", "parallel.pipeline_layers=[1,2]"], 2, ["parallel.pipeline_layers", "model.num_layers=2"]),
    (["parallel.pipeline=2", "parallel.pipeline_layers=[2,0]"], 2, ["parallel.pipeline_layers", ">= 1"]),
    (["parallel.pipeline_schedule=gpipe"], 1, ["parallel.pipeline_schedule", "1f1b"]),
    (["optimizer.distributed=true", "moe.balancer=flexmoe"], 1, ["optimizer.distributed", "moe.balancer=flexmoe"]),
    (["moe.schedule=nope"], 1, ["moe.schedule", "baseline"]),
    # node-deduplicated dispatch (techniques/node_dedup/node_dedup.py): the baseline's, not the smart schedule's
    (["moe.token_dispatch=dedup"], 1, ["moe.token_dispatch='dedup'", "node_dedup", "per_copy"]),
    (["moe.token_dispatch=node_dedup", "moe.schedule=s2"], 1, ["moe.token_dispatch=node_dedup", "moe.schedule=baseline"]),
    (["moe.token_dispatch=node_dedup", "moe.smart_schedule=true"], 1, ["moe.token_dispatch=node_dedup",
                                                                       "moe.smart_schedule=true"]),
    (["moe.top_k=5", "moe.num_experts=4"], 1, ["moe.top_k"]),
    (["model.normalization=batchnorm"], 1, ["model.normalization"]),
    # architecture section checks (model/attention.py, moe/router.py, moe/shared_expert.py)
    (["parallel.tensor=4", "model.num_attention_heads=8", "model.num_query_groups=2"], 4,
     ["parallel.tensor=4", "model.num_query_groups=2"]),
    (["model.num_query_groups=3"], 1, ["model.num_query_groups=3", "model.num_attention_heads=4"]),
    (["model.head_dim=7", "model.position_embedding=rope"], 1, ["rope", "7"]),
    (["model.qk_norm=layer"], 1, ["model.qk_norm='layer'"]),
    (["moe.score_function=tanh"], 1, ["moe.score_function='tanh'"]),
    (["moe.router_groups=2"], 1, ["moe.router_group_topk=None", "moe.router_groups=2"]),
    (["moe.shared_expert_gate=true"], 1, ["moe.shared_expert_gate", "moe.shared_expert_ffn_hidden_size"]),
])
def test_impossible_combinations(overrides, world, needles):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world)
    for n in needles:
        assert n in str(e.value)
    assert "\n" not in str(e.value)


def test_valid_layouts_pass():
    for world, ov in [(1, []), (8, ["parallel.tensor=2", "parallel.expert=2", "parallel.expert_shard=2"]),
                      (8, ["parallel.expert=4", "parallel.expert_shard=2"]),
                      (8, ["parallel.pipeline=2", "parallel.tensor=2", "parallel.expert=2", "optimizer.distributed=true"]),
                      (4, ["parallel.pipeline=2", "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2",
                           "model.num_layers=4"]),
                      (2, ["parallel.pipeline=2", "model.num_layers=3", "parallel.pipeline_layers=[1,2]"])]:
        validate_config(load_config("configs/gpt_moe_tiny.yaml", ov), world)


def test_virtual_stages_infer_the_interleaved_schedule(tmp_path):
    """`parallel.pipeline_schedule` null (the default) resolves from `parallel.virtual_stages`, as Megatron
    infers interleaving from the virtual pipeline size: > 1 = interleaved, else 1f1b; an explicit schedule
    is kept (1f1b with virtual stages is refused: test_impossible_combinations). The config a run writes to
    its run directory (the trainer's `save_config`) names the schedule that runs."""
    vs2 = ["parallel.pipeline=2", "parallel.virtual_stages=2", "model.num_layers=4"]
    cfg = load_config("configs/gpt_moe_tiny.yaml", vs2)
    assert cfg.parallel.pipeline_schedule == "interleaved"
    validate_config(cfg, 2)
    assert load_config("configs/gpt_moe_tiny.yaml", vs2 + ["parallel.pipeline_schedule=interleaved"]) == cfg
    assert load_config(None, ["parallel.pipeline=2"]).parallel.pipeline_schedule == "1f1b"
    assert load_config(None, ["parallel.virtual_stages=1", "parallel.pipeline_schedule=null"]).parallel.pipeline_schedule == "1f1b"
    built = Config()  # built in code, not loaded: validate_config resolves it
    built.parallel.pipeline, built.parallel.virtual_stages, built.model.num_layers = 2, 2, 4
    validate_config(built, 2)
    assert built.parallel.pipeline_schedule == "interleaved"
    save_config(cfg, str(tmp_path / "run" / "config.yaml"))
    assert "pipeline_schedule: interleaved" in (tmp_path / "run" / "config.yaml").read_text()
    assert load_config(str(tmp_path / "run" / "config.yaml")) == cfg


def test_checkpoint_load_path_is_checked_before_any_process_group(tmp_path):
    """`checkpoint.load=PATH`: a missing path or a directory that is neither a checkpoint nor a root
    of iter_<k> checkpoints fails validation naming the key and the path; names only are looked at."""
    def check(path):
        validate_config(load_config(None, [f"checkpoint.load={path}"]), 1)

    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for path, reason in [(tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a directory"),
                         (tmp_path / "empty", "is not a checkpoint (no meta.json or manifest.json) and holds no "
                                              "iter_<k> checkpoints")]:
        with pytest.raises(ConfigError) as e:
            check(path)
        assert str(e.value) == f"checkpoint.load={path}: {path} {reason}"
    (tmp_path / "root" / "iter_0000002").mkdir(parents=True)  # a root: verified later, when loading
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "meta.json").write_text("{}")  # one checkpoint directory (maybe incomplete)
    check(tmp_path / "root")
    check(tmp_path / "one")


def _leaf_keys(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_keys(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_config_key_is_documented():
    """docs/configs.md has a row for every key of the schema (a knob without docs is a defect)."""
    docs = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "configs.md")).read()
    documented = set(re.findall(r"^\| `([a-z_.0-9]+)`", docs, flags=re.M))
    for row in re.findall(r"^\| `([a-z_.0-9]+)` / (.*?) \|", docs, flags=re.M):  # `a.b_1` / `b_2` / ...
        section = row[0].rsplit(".", 1)[0]
        documented |= {f"{section}.{name}" for name in re.findall(r"`([a-z_0-9]+)`", row[1])}
    from megatron_moe.config.schema import Config

    missing = [key for key in _leaf_keys(Config()) if key not in documented]
    assert not missing, f"keys missing from docs/configs.md: {missing}"
