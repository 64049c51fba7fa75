"""Data-parallel gradient reduction overlapped with backward (`optimizer.overlap_grad_reduce`,
issue #44 item 6; training/grads.py) and ZeRO-1's tensor-form collectives.

1. Hand-made parameters on 2 ranks (dp 2): with 2 micro-batches no bucket starts in the first
   backward (gradient accumulation), every dense bucket starts from the hooks in the second, none
   of the expert buckets does; the synced gradients equal the non-overlapped path's bit for bit; a
   third backward, or an out-of-band addition (`grad_buffer`) to a started parameter, raises.
2. The Trainer, ITERS steps of the tiny GPT-MoE with and without the option, dp 2 and expert edp 2
   (2 ranks), fp32 and bf16 main gradients; expert=2 with FasterMoE's replicas (Agg adds into
   expert gradients when backward ends) and full recomputation, and with EPLB's vExperts (slot
   sums after backward) and Lancet's batch parts; pipeline=2 (4 ranks: dp 2, the tied embedding's
   sum over the `embedding` group after the overlapped dp sum) with 2 virtual stages: losses, grad
   norms, every synced gradient and the final weights bit for bit equal; bytes and calls per
   "<kind>/<group>" equal; buckets started during backward; their exposed time below their total.
3. ZeRO-1 reduce-scatters and all-gathers with the tensor forms (no list form, no all-reduce).
4. The config checks and the side channel.
"""
import pytest
import torch

from megatron_moe.config import ConfigError, load_config, validate_config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout, side_channels
from megatron_moe.model.precision import grad_buffer, grad_of
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.training.grads import GradSync
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_datasets
from tests.distributed.harness import run_distributed

ITERS = 3
COMMON = [f"training.train_iters={ITERS}", "training.eval_iters=0", "training.micro_batch_size=1",
          "training.global_batch_size=4", "model.seq_length=16", "model.num_layers=4", "model.vocab_size=125",
          "logging.tensorboard=false", "optimizer.warmup_iters=1", "moe.num_experts=4",
          "optimizer.grad_bucket_mb=0.01"]  # ~10 KB buckets: several per kind in the tiny model
METAS = {"embed": ParamMeta("dense", (6, 4)), "w1": ParamMeta("dense", (4, 4)), "w2": ParamMeta("dense", (4, 4)),
         "experts.w": ParamMeta("expert", (2, 4, 4)), "head": ParamMeta("dense", (4, 3))}


def _handmade(state):
    """Hooks, micro-batches and the error paths on hand-made parameters (1.)."""
    torch.manual_seed(state.rank)
    params = [(n, make_param(m, state)) for n, m in METAS.items()]
    for _, p in params:
        torch.nn.init.normal_(p)
    ids = torch.randint(0, 6, (2, 5))
    p = dict(params)

    def backward(mb):
        h = p["embed"][ids[mb]] @ p["w1"]
        h = torch.tanh(h) @ p["w2"]
        h = h + torch.einsum("td,ed->te", h, p["experts.w"].detach().sum(0))  # expert weights outside autograd
        (h @ p["head"]).square().mean().backward()
        grad_buffer(p["experts.w"]).add_(float(mb + 1))  # an out-of-band dW, as the grouped GEMM's

    out = {}
    for overlap in (False, True):
        for _, q in params:
            q.grad = None
        sync = GradSync(params, state, bucket_bytes=64, overlap=overlap)
        sync.begin(2)
        backward(0)
        out[f"after first backward {overlap}"] = sync._next
        backward(1)
        out[f"after last backward {overlap}"] = sync._next
        out[f"hooked buckets {overlap}"] = len(sync.launch_order)
        out[f"hooked expert buckets {overlap}"] = sum(b.params[0].meta.kind == "expert" for b in sync.launch_order)
        out[f"late addition raises {overlap}"] = _raises(lambda: grad_buffer(p["head"]), "reduction started")
        sync.sync()
        out[f"grads {overlap}"] = {n: q.grad.clone() for n, q in params}
    sync.begin(2)
    for mb in (0, 1):
        backward(mb)
    out["third backward raises"] = _raises(lambda: backward(0), "got 3 gradients in 2 backward passes")
    return out


def _raises(fn, match: str) -> bool:
    try:
        fn()
    except RuntimeError as exc:
        return match in str(exc)
    return False


def _train(state, overrides):
    """ITERS train steps: per step the loss, grad norm, synced gradients, bytes and calls per
    "<kind>/<group>", buckets started in backward and the started buckets' [exposed, total] s."""
    cfg = load_config("configs/gpt_moe_tiny.yaml", COMMON + list(overrides))
    trainer = Trainer(cfg, state, datasets=synthetic_datasets)
    out = {k: [] for k in ("loss", "grad_norm", "grads", "bytes", "calls", "hooked", "times")}
    sync = trainer.grads.sync

    def traced_sync():
        sync()
        out["grads"].append({n: grad_of(p).clone() for n, p in trainer.model.named_parameters()})

    trainer.grads.sync = traced_sync
    for iteration in range(1, ITERS + 1):
        record = trainer.train_step(iteration)
        out["loss"].append(record["loss"])
        out["grad_norm"].append(record["grad_norm"])
        out["bytes"].append(dict(C.COMM_STATS.bytes))
        out["calls"].append(dict(C.COMM_STATS.calls))
        out["hooked"].append(trainer.grads.started_in_backward)
        out["times"].append([float(d) for d in trainer.grads.sink.get("all_reduce", [0.0, 0.0])])
    out["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return out


def _jobs(state, jobs):
    out = {}
    for name, layout, overrides in jobs:
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **layout), state.rank, side_channels=["dp"])
        if name == "handmade":
            out[name] = _handmade(sub)
            continue
        out[name] = {overlap: _train(sub, overrides + [f"optimizer.overlap_grad_reduce={overlap}".lower()])
                     for overlap in (False, True)}
    return out


PROFILE = "perf.hardware_profile=configs/hardware/cpu_gloo_2proc.yaml"
EP2 = ["parallel.expert=2", PROFILE]
JOBS = {2: [("handmade", {}, []),
            ("dp2-edp2-fp32", {}, []),
            ("dp2-edp2-bf16", {}, ["training.precision=bf16"]),
            ("dp2-edp2-capacity", {}, ["moe.capacity_factor=1.0"]),  # capacity mode: rows over capacity dropped
            # replicas' Agg into expert gradients at the end of backward, all-to-alls on ep meanwhile
            ("ep2-fastermoe-recompute", dict(expert=2), EP2 + [
                "moe.balancer=fastermoe", "moe.fastermoe.min_shadow=1", "training.recompute=full"]),
            # vExpert slot sums after backward; batch parts around the MoE layers
            ("ep2-eplb-partitions", dict(expert=2), EP2 + [
                "moe.balancer=eplb", "moe.eplb.interval=1", "moe.lancet.partitions=2",
                "moe.lancet.partition_range=1"])],
        4: [("pp2-vs2-dp2", dict(pipeline=2), ["parallel.pipeline=2", "parallel.virtual_stages=2"])]}
_CACHE = {}


def _results(world):
    if world not in _CACHE:
        _CACHE[world] = run_distributed(world, _jobs, args=(JOBS[world],), timeout=600)
    return _CACHE[world]


@pytest.mark.distributed
def test_hooks_start_dense_buckets_in_the_last_backward_only_and_match_bitwise():
    for out in (rank["handmade"] for rank in _results(2)):
        assert out["after first backward True"] == 0  # gradient accumulation: nothing before the last micro-batch
        assert out["after last backward True"] == out["hooked buckets True"] > 0
        assert out["hooked expert buckets True"] == 0 and out["hooked buckets False"] == 0
        assert out["late addition raises True"] and not out["late addition raises False"]
        assert out["third backward raises"]
        for name, grad in out["grads False"].items():
            assert torch.equal(out["grads True"][name], grad), name


def _check_trainer_runs(ranks, name):
    for rank, results in enumerate(ranks):
        plain, overlap = results[name][False], results[name][True]
        where = f"{name} rank {rank}"
        assert overlap["loss"] == plain["loss"] and overlap["grad_norm"] == plain["grad_norm"], where
        for step, (a, b) in enumerate(zip(plain["grads"], overlap["grads"])):
            for key in a:
                assert torch.equal(a[key], b[key]), f"{where} step {step + 1} {key}"
        for key, weight in plain["params"].items():
            assert torch.equal(weight, overlap["params"][key]), f"{where} {key}"
        assert overlap["bytes"] == plain["bytes"] and overlap["calls"] == plain["calls"], where
        assert any(k.endswith("/dp") for k in plain["bytes"][0]), where
        assert plain["hooked"] == [0] * ITERS and min(overlap["hooked"]) > 0, where
        for exposed, total in overlap["times"]:
            assert 0 < exposed < total, (where, exposed, total)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dp2-edp2-fp32", "dp2-edp2-bf16", "dp2-edp2-capacity", "ep2-fastermoe-recompute",
                                  "ep2-eplb-partitions"])
def test_overlapped_training_equals_plain_bitwise_two_ranks(name):
    _check_trainer_runs(_results(2), name)


@pytest.mark.distributed
def test_overlapped_training_with_pipeline_stages_and_tied_embedding():
    _check_trainer_runs(_results(4), "pp2-vs2-dp2")


# -- ZeRO-1's collectives ---------------------------------------------------------------------------
def _zero_paths(state):
    cfg = load_config("configs/gpt_moe_tiny.yaml", COMMON + ["optimizer.distributed=true"])
    trainer = Trainer(cfg, state, datasets=synthetic_datasets)
    calls = {"tensor_rs": 0, "tensor_ag": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    def refused(*args, **kwargs):
        raise AssertionError("list-form collective or all-reduce on the ZeRO-1 path")

    trainer.optimizer.zero_grad()
    trainer.forward_backward(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "_REDUCE_SCATTER_TENSOR", counted(C._REDUCE_SCATTER_TENSOR, "tensor_rs"))
        mp.setattr(C, "_ALL_GATHER_INTO", counted(C._ALL_GATHER_INTO, "tensor_ag"))
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            mp.setattr(C.dist, name, refused)
        trainer.optimizer.sync()
        trainer.optimizer.publish()
    return calls, len(trainer.optimizer.flats)


@pytest.mark.distributed
def test_zero1_uses_the_tensor_forms():
    for calls, flats in run_distributed(2, _zero_paths):
        assert flats > 0 and calls == {"tensor_rs": flats, "tensor_ag": flats}


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,message", [
    (["optimizer.distributed=true"], "does not work with optimizer.distributed=true"),
    (["moe.lancet.defer_wgrad=true"], "does not work with moe.lancet.defer_wgrad=true"),
])
def test_overlap_refuses_what_it_cannot_hook(extra, message):
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["optimizer.overlap_grad_reduce=true"] + extra)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, 1)


def test_bucket_size_and_side_channel():
    with pytest.raises(ConfigError, match="optimizer.grad_bucket_mb=0.0 must be > 0"):
        validate_config(load_config("configs/gpt_moe_tiny.yaml", ["optimizer.grad_bucket_mb=0"]), 1)
    assert "dp" in side_channels(load_config("configs/gpt_moe_tiny.yaml", ["optimizer.overlap_grad_reduce=true"]))
    assert "dp" not in side_channels(load_config("configs/gpt_moe_tiny.yaml", []))
