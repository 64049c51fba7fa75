"""Experiment sweeps from one YAML file (docs/sweeps.md): a grid of configs, checked by the entry
points' `--check-config`, run locally (torchrun queue) or as SLURM job arrays (submitit), resumed
after interruptions, collected into tables, plots and TensorBoard HParams.

    spec.py    the sweep file: parsing, checks, grid x zip x seeds expansion, stable run names
    launch.py  the `launch` block: backend, world size, SLURM resources
    plan.py    --check-config for every run, sweep.json, `--simulate` ranking (megatron_moe/sim)
    local.py   the local queue (scripts/run_local.sh, `launch.max_parallel` at a time)
    slurm.py   submitit job arrays running scripts/slurm/srun_pretrain.sh; save, requeue, resume
    state.py   per-run state on disk, locks, `status`
    report.py  results.csv / results_points.csv / results.md from each run's metrics.jsonl
    plots.py   loss curves, throughput, exposed all-to-all, TensorBoard HParams
    cli.py     plan | run | status | report
"""
from megatron_moe.sweep.spec import Run, SweepSpec, expand, load_sweep

__all__ = ["Run", "SweepSpec", "expand", "load_sweep"]
