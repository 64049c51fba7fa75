"""A routing trace recorded by a real training run replays in the cluster simulator to the same
per-rank row counts (issue #13).

Four gloo processes train the tiny GPT-MoE for a few iterations (expert parallel 2, so two ep_esp
groups; capacity 1.0, so tokens drop; two micro-batches per rank and iteration; Pro-Prophet, whose
plans depend on the history of counts it observed) with `logging.routing_trace` on, and record
every iteration's rows per EP rank of each MoE layer (`IterationMoEStats.tokens_per_ep_rank`,
their group's). The simulator replays the written trace on the same config and layout: every
iteration, layer, group and EP rank must compute exactly the rows the run computed, and the
placements' replicas must agree.
"""
import pytest

from megatron_moe.config import load_config
from megatron_moe.perf.hardware import load_profile
from megatron_moe.sim.runner import Simulation
from megatron_moe.training.trainer import Trainer
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed
ITERS, WORLD, PROFILE = 3, 4, "configs/hardware/cpu_gloo_2proc.yaml"


def overrides(run_dir):
    return [f"training.train_iters={ITERS}", "training.log_interval=100", "training.eval_interval=0",
            "model.seq_length=32", "training.micro_batch_size=1", "training.global_batch_size=8",
            "parallel.expert=2", "moe.capacity_factor=1.0", "moe.balancer=proprophet", "moe.proprophet.min_replicas=1",
            f"perf.hardware_profile={PROFILE}",
            "logging.routing_trace=true", "logging.tensorboard=false", f"training.run_dir={run_dir}"]


class RecordingTrainer(Trainer):
    """Keeps every iteration's rows per EP rank [L, ep] and replicas [L] of this rank's group."""

    rows: list

    def train_step(self, iteration):
        record = super().train_step(iteration)
        self.rows.append((self.latest_moe.tokens_per_ep_rank.clone(), self.latest_moe.replicas.clone()))
        return record


def _train(state, run_dir):
    trainer = RecordingTrainer(load_config("configs/gpt_moe_tiny.yaml", overrides(run_dir)), state)
    trainer.rows = []
    trainer.train()
    return state.layout.coords(state.rank)["edp"], trainer.rows


def test_recorded_trace_replays_to_the_same_rows(tmp_path):
    out = run_distributed(WORLD, _train, dict(expert=2), args=(str(tmp_path),))
    real = {edp: rows for edp, rows in out}  # every rank of a group reports the same rows
    cfg = load_config("configs/gpt_moe_tiny.yaml", overrides(tmp_path))
    sim = Simulation(cfg, load_profile(PROFILE), WORLD, str(tmp_path / "sim"))
    results = sim.run(sim.trace(str(tmp_path / "routing"), ITERS).steps())
    assert [r.iteration for r in results] == list(range(1, ITERS + 1))
    dropped = 0
    for i, result in enumerate(results):
        for layer, simulated in enumerate(result.layers):
            for edp, rows in real.items():
                assert simulated.rows_per_group[edp].tolist() == rows[i][0][layer].tolist(), (i, layer, edp)
            replicas = sum(float(rows[i][1][layer]) for rows in real.values()) / len(real) / sim.micro_batches
            assert simulated.replicas == pytest.approx(replicas), (i, layer)
            dropped += simulated.rows_per_group.sum() < cfg.training.global_batch_size * 32 * cfg.moe.top_k
    assert dropped  # capacity 1.0 dropped rows: the replay applied the same drops
    assert sum(r.layers[0].replicas for r in results) > 0  # Pro-Prophet placed replicas
