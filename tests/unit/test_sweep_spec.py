"""Sweep files (megatron_moe/sweep/spec.py, launch.py): grid x zip x seeds expansion, stable run
names, one-line errors naming the key, launch resolution; and the check of every run before any
launch (plan.py, through the entry point's --check-config)."""
import os
from pathlib import Path

import pytest
import yaml

from megatron_moe.config import ConfigError
from megatron_moe.sweep import cli
from megatron_moe.sweep.launch_spec import make_launch, parse_time
from megatron_moe.sweep.spec import expand, format_value, load_sweep, select

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "gpt_moe_tiny.yaml")


def write(tmp_path, **body):
    body.setdefault("base", TINY)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return str(path)


def test_grid_zip_seeds_expand_in_file_order_with_stable_names(tmp_path):
    spec = load_sweep(write(tmp_path, overrides=["training.train_iters=5"],
                            grid={"moe.balancer": ["none", "eplb"], "moe.schedule": ["baseline", "s2"]},
                            zip=[{"moe.num_experts": [8, 16], "moe.top_k": [1, 2]}], seeds=[3, 4]))
    runs = expand(spec)
    assert len(runs) == 2 * 2 * 2 * 2
    # cartesian product in file order, the zip group as one axis, seeds varying fastest
    assert [r.name for r in runs[:5]] == [
        "balancer=none,schedule=baseline,num_experts=8,top_k=1,seed=3",
        "balancer=none,schedule=baseline,num_experts=8,top_k=1,seed=4",
        "balancer=none,schedule=baseline,num_experts=16,top_k=2,seed=3",
        "balancer=none,schedule=baseline,num_experts=16,top_k=2,seed=4",
        "balancer=none,schedule=s2,num_experts=8,top_k=1,seed=3"]
    assert runs[-1].name == "balancer=eplb,schedule=s2,num_experts=16,top_k=2,seed=4"
    assert [r.index for r in runs] == list(range(1, 17))
    r = runs[2]
    assert r.point == "balancer=none,schedule=baseline,num_experts=16,top_k=2" and r.seed == 3
    assert r.run_dir == os.path.join(spec.sweep_dir, "runs", r.name)
    assert r.overrides == ["training.train_iters=5", "moe.balancer=none", "moe.schedule=baseline", "moe.num_experts=16",
                           "moe.top_k=2", "training.seed=3", f"training.run_dir={r.run_dir}",
                           f"checkpoint.dir={r.run_dir}/checkpoints", "checkpoint.load=auto"]
    # stable: the same file gives the same names and directories; --only picks points or runs
    assert [x.name for x in expand(load_sweep(spec.path))] == [x.name for x in runs]
    assert [x.name for x in select(runs, [r.point])] == [r.name, runs[3].name]
    assert [x.name for x in select(runs, [r.name])] == [r.name]
    with pytest.raises(ConfigError, match="--only nope: no run or point"):
        select(runs, ["nope"])


def test_names_disambiguate_clashing_leaves_and_sanitize_values(tmp_path):
    runs = expand(load_sweep(write(tmp_path, grid={"moe.flexmoe.interval": [5], "moe.eplb.interval": [7],
                                                   "data.path": [["0.5", "a/b"]], "moe.capacity_factor": [None]})))
    assert runs[0].name == "moe.flexmoe.interval=5,moe.eplb.interval=7,path=0.5_a_b,capacity_factor=null"
    assert runs[0].config_overrides == ("moe.flexmoe.interval=5", "moe.eplb.interval=7", "data.path=['0.5', a/b]",
                                        "moe.capacity_factor=null")
    assert [format_value(v) for v in (True, None, 1e-3, [1, 2])] == ["true", "null", "0.001", "[1, 2]"]
    assert expand(load_sweep(write(tmp_path)))[0].name == "run"  # nothing varies: one run


@pytest.mark.parametrize("body,message", [
    ({"grid": {"moe.balancer": "eplb"}}, "grid.moe.balancer must be a non-empty list"),
    ({"grid": {"balancer": ["eplb"]}}, "grid: 'balancer' is not a dotted config key"),
    ({"zip": [{"moe.num_experts": [8, 16], "moe.top_k": [2]}]}, r"zip\[0\]: .* moe.num_experts: 2, moe.top_k: 1"),
    ({"grid": {"moe.top_k": [1]}, "zip": [{"moe.top_k": [2]}]}, "moe.top_k is varied twice"),
    ({"grid": {"training.run_dir": ["x"]}}, "training.run_dir is set by the sweep"),
    ({"overrides": ["checkpoint.load=null"]}, "checkpoint.load is set by the sweep"),
    ({"seeds": [1, 1]}, r"seeds: \[1, 1\] repeats a seed"),
    ({"seeds": [1], "grid": {"training.seed": [2]}}, "training.seed is varied by both"),
    ({"grd": {}}, "unknown key 'grd'"),
    ({"launch": {"backend": "pbs"}}, "launch.backend='pbs' is not one of local | slurm"),
    ({"launch": {"backend": "slurm", "nproc": 4}}, "launch.time is required with backend slurm"),
    ({"launch": {"nodes": 2}}, "launch.nodes=2: backend local runs on this machine"),
    ({"grid": {"launch.max_parallel": [1, 2]}}, "launch.max_parallel cannot vary per run"),
    ({"report": {"group_by": "moe.top_k"}}, "report.group_by=moe.top_k is not a varied key"),
    ({"overrides": ["launch.nproc=2"]}, "overrides: launch.nproc=2 is not a config override"),
    ({"grid": {"launch.nproc": [2, 3]}, "launch": {"backend": "slurm", "nodes": 2, "time": 5}},
     "run 'nproc=3': launch.nproc=3 is not a multiple of launch.nodes=2"),
    ({"entry": "pretrain_nothing.py"}, "entry: pretrain_nothing.py is not an entry point"),
    ({"base": "configs/none.yaml"}, "base: configs/none.yaml: no such file"),
])
def test_bad_sweep_files_are_one_line_errors_naming_the_key(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message) as err:
        expand(load_sweep(write(tmp_path, **body)))
    assert "\n" not in str(err.value)


def test_launch_world_size_and_resources():
    assert make_launch({}).world_size == 1
    assert make_launch({"nproc": 4}).world_size == 4
    slurm = make_launch({"backend": "slurm", "nodes": 2, "nproc": 16, "time": "1:00:00", "gpus_per_node": 8})
    assert (slurm.nodes, slurm.tasks_per_node, slurm.world_size, slurm.time_min) == (2, 8, 16, 60)
    assert make_launch({"backend": "slurm", "nodes": 2, "tasks_per_node": 4, "time": 5}).world_size == 8
    with pytest.raises(ConfigError, match=r"launch.nproc=6 != nodes x tasks_per_node = 2 x 4"):
        make_launch({"backend": "slurm", "nodes": 2, "tasks_per_node": 4, "nproc": 6, "time": 5})
    assert [parse_time(t, "l") for t in (90, "90", "1:30", "2:00:00", "1-0", "1-2:30", "0:0:59")] == \
        [90, 90, 2, 120, 1440, 1590, 1]
    with pytest.raises(ConfigError, match="is not a SLURM time"):
        parse_time("soon", "launch")


def test_runs_with_other_launch_keys_get_their_own_world_size(tmp_path):
    runs = expand(load_sweep(write(tmp_path, grid={"launch.nproc": [1, 2], "parallel.expert": [1]},
                                   launch={"backend": "slurm", "time": 10})))
    assert [(r.name, r.launch.world_size, r.launch.tasks_per_node) for r in runs] == [
        ("nproc=1,expert=1", 1, 1), ("nproc=2,expert=1", 2, 2)]
    assert runs[0].launch.shape != runs[1].launch.shape  # two job arrays
    assert runs[0].config_overrides == ("parallel.expert=1",)  # launch keys are not config overrides


def test_one_invalid_point_names_run_and_key_in_one_line_and_launches_nothing(tmp_path, capsys):
    """parallel.expert=3 on 2 processes: `run` prints one `sweep error:` line naming the run and the
    key, exits 2, and writes nothing (no sweep directory, no run directory)."""
    sweep_dir = tmp_path / "out"
    path = write(tmp_path, overrides=["training.train_iters=2"], grid={"parallel.expert": [1, 2, 3]},
                 launch={"nproc": 2}, sweep_dir=str(sweep_dir))
    assert cli.main(["run", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sweep error: run 'expert=3': parallel.expert=3 does not divide moe.num_experts=8"]
    assert not sweep_dir.exists()
    assert cli.main(["run", path, "--only", "expert=2"]) == 2  # every run is checked, selected or not
    assert capsys.readouterr().err.strip().splitlines() == err
    assert not sweep_dir.exists()


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "sweeps").glob("*.yaml")))
def test_shipped_sweeps_plan(name, capsys, monkeypatch):
    """Every example under configs/sweeps/ expands and passes --check-config (paths relative to the
    repository root, as documented)."""
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", f"configs/sweeps/{name}"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    runs = expand(load_sweep(f"configs/sweeps/{name}"))
    assert f"all {len(runs)} runs pass" in out and len(runs) >= 10
    assert all(r.name in out for r in runs)
