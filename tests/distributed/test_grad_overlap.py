"""Data-parallel gradient reduction overlapped with backward (`optimizer.overlap_grad_reduce`,
issue #44 item 6; training/grads.py) and ZeRO-1's tensor-form collectives.

1. Hand-made parameters on 2 ranks (dp 2, edp 2), two expert stacks whose weight gradients the
   grouped GEMM adds outside autograd (`grouped_mm_into_grad`, and its out-of-band Function
   itself): with 2 micro-batches no bucket starts in the first backward (gradient accumulation),
   every bucket, dense and expert, starts from the hooks in the second; the expert buckets'
   bytes go to "all_reduce/edp_side" only (none to "edp"); the synced gradients equal the
   non-overlapped path's bit for bit; a third backward, or an out-of-band addition (`grad_buffer`)
   to a started dense or expert parameter, raises.
2. The Trainer, ITERS steps of the tiny GPT-MoE with and without the option: dp 2 and expert edp 2
   (2 ranks), fp32, bf16 main gradients, capacity mode, ZeRO-1 (fp32 and bf16); expert=2 with
   FasterMoE's replicas (Agg adds into expert gradients when backward ends: expert buckets after
   backward) and full recomputation, and with EPLB's vExperts (slot sums after backward) and
   Lancet's batch parts; 4 ranks: dp 4 with expert=2 (edp 2) dropless, capacity, with batch parts
   and recomputation, with ZeRO-1; pipeline=2 (dp 2, the tied embedding's sum over the `embedding`
   group after the overlapped dp sum) with 2 virtual stages: losses, grad norms, every synced
   gradient (ZeRO-1: every shard's) and the final weights bit for bit equal; bytes and calls per
   "<kind>/<group>" equal once "<group>_side" is counted as "<group>", and with the option none of
   the replica sums on "dp" / "edp" themselves; buckets (expert ones where edp > 1) started during
   backward; their exposed time below their total.
3. ZeRO-1 reduce-scatters and all-gathers with the tensor forms (no list form, no all-reduce),
   overlapped or not.
4. The config checks and the side channels.
"""
import pytest
import torch

from megatron_moe.config import ConfigError, load_config, validate_config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout, side_channels
from megatron_moe.model.precision import grad_buffer, grad_of
from megatron_moe.moe import grouped_gemm
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.training.distributed_optimizer import GRAD_KIND
from megatron_moe.training.grads import GradSync, late_expert_grads
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_datasets
from tests.distributed.harness import run_distributed

ITERS = 3
COMMON = [f"training.train_iters={ITERS}", "training.eval_iters=0", "training.micro_batch_size=1",
          "training.global_batch_size=4", "model.seq_length=16", "model.num_layers=4", "model.vocab_size=125",
          "logging.tensorboard=false", "optimizer.warmup_iters=1", "moe.num_experts=4",
          "optimizer.grad_bucket_mb=0.01"]  # ~10 KB buckets: several per kind in the tiny model
METAS = {"embed": ParamMeta("dense", (6, 4)), "w1": ParamMeta("dense", (4, 4)), "w2": ParamMeta("dense", (4, 4)),
         "experts.w": ParamMeta("expert", (2, 4, 4)), "experts.v": ParamMeta("expert", (2, 4, 4)),
         "head": ParamMeta("dense", (4, 3))}
COUNTS = [3, 2]  # rows per expert of the 5 tokens


def _handmade(state):
    """Hooks, micro-batches and the error paths on hand-made parameters (1.)."""
    torch.manual_seed(state.rank)
    params = [(n, make_param(m, state)) for n, m in METAS.items()]
    for _, p in params:
        torch.nn.init.normal_(p)
    ids = torch.randint(0, 6, (2, 5))
    p = dict(params)

    def backward(mb):
        h = torch.tanh(p["embed"][ids[mb]] @ p["w1"]) @ p["w2"]
        for part in (h[:3], h[3:]):  # two batch parts: two grouped GEMMs per stack and micro-batch
            counts = [len(part) - 1, 1]
            # dW into .grad outside autograd (own path on the CPU where it pays), and always so
            out = grouped_gemm.grouped_mm_into_grad(part, p["experts.w"], 0.5, counts)
            out = grouped_gemm._GroupedMMIntoGrad.apply(torch.tanh(out), p["experts.v"], 0.5,
                                                        grouped_gemm._groups(out, 2, counts, None), None)
            h = torch.cat([h, out])
        (h @ p["head"]).square().mean().backward()

    out = {}
    for overlap in (False, True):
        for _, q in params:
            q.grad = None
        C.COMM_STATS.reset()
        sync = GradSync(params, state, bucket_bytes=64, overlap=overlap)
        sync.begin(2)
        backward(0)
        out[f"after first backward {overlap}"] = len(sync.launch.pending)
        backward(1)
        out[f"after last backward {overlap}"] = len(sync.launch.pending)
        out[f"hooked buckets {overlap}"] = len(sync.launch_order)
        out[f"hooked expert buckets {overlap}"] = sum(b.groups[0] == "edp" for b in sync.launch_order)
        out[f"expert bucket bytes {overlap}"] = sum(b.nbytes for b in sync.buckets if b.groups[0] == "edp")
        out[f"late addition raises {overlap}"] = [_raises(lambda: grad_buffer(p[n]), "reduction started")
                                                  for n in ("head", "experts.w", "experts.v")]
        sync.sync()
        out[f"bytes {overlap}"] = dict(C.COMM_STATS.bytes)
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


def _unit_group(unit) -> str:
    """The replica group of a hooked GradSync bucket or ZeRO-1 flat buffer."""
    return unit.group.name if hasattr(unit, "group") else unit.groups[0]


def _train(state, overrides):
    """ITERS train steps: per step the loss, grad norm, synced gradients (ZeRO-1: the shards'), bytes
    and calls per "<kind>/<group>", buckets started in backward (all, expert ones) and the started
    buckets' [exposed, total] s."""
    cfg = load_config("configs/gpt_moe_tiny.yaml", COMMON + list(overrides))
    trainer = Trainer(cfg, state, datasets=synthetic_datasets)
    out = {k: [] for k in ("loss", "grad_norm", "grads", "bytes", "calls", "hooked", "hooked_edp", "times")}
    sync = trainer.grads.sync
    flats = getattr(trainer.grads, "flats", [])

    def traced_sync():
        sync()
        grads = {n: grad_of(p).clone() for n, p in trainer.model.named_parameters()}
        out["grads"].append(grads if not flats else {i: f.shard.grad.clone() for i, f in enumerate(flats)})

    trainer.grads.sync = traced_sync
    for iteration in range(1, ITERS + 1):
        record = trainer.train_step(iteration)
        out["loss"].append(record["loss"])
        out["grad_norm"].append(record["grad_norm"])
        out["bytes"].append(dict(C.COMM_STATS.bytes))
        out["calls"].append(dict(C.COMM_STATS.calls))
        started = trainer.grads.launch_order[:trainer.grads.started_in_backward]
        out["hooked"].append(len(started))
        out["hooked_edp"].append(sum(_unit_group(u) == "edp" for u in started))
        out["times"].append([float(d) for d in trainer.grads.sink.get("all_reduce", trainer.grads.sink.get(
            GRAD_KIND, [0.0, 0.0]))])
    out["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return out


def _jobs(state, jobs):
    out = {}
    for name, layout, overrides in jobs:
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **layout), state.rank,
                                  side_channels=["dp", "edp"])
        if name == "handmade":
            out[name] = _handmade(sub)
            continue
        out[name] = {overlap: _train(sub, overrides + [f"optimizer.overlap_grad_reduce={overlap}".lower()])
                     for overlap in (False, True)}
    return out


PROFILE = "perf.hardware_profile=configs/hardware/cpu_gloo_2proc.yaml"
EP2 = ["parallel.expert=2", PROFILE]
ZERO = ["optimizer.distributed=true"]
PARTS = ["moe.lancet.partitions=2", "moe.lancet.partition_range=1"]  # batch parts around the MoE layers
JOBS = {2: [("handmade", {}, []),
            ("dp2-edp2-fp32", {}, []),
            ("dp2-edp2-bf16", {}, ["training.precision=bf16"]),
            ("dp2-edp2-capacity", {}, ["moe.capacity_factor=1.0"]),  # capacity mode: rows over capacity dropped
            ("dp2-edp2-zero1", {}, ZERO),
            ("dp2-edp2-zero1-bf16", {}, ZERO + ["training.precision=bf16"]),
            # replicas' Agg into expert gradients at the end of backward, all-to-alls on ep meanwhile
            ("ep2-fastermoe-recompute", dict(expert=2), EP2 + [
                "moe.balancer=fastermoe", "moe.fastermoe.min_shadow=1", "training.recompute=full"]),
            # vExpert slot sums after backward
            ("ep2-eplb-partitions", dict(expert=2), EP2 + ["moe.balancer=eplb", "moe.eplb.interval=1"] + PARTS)],
        4: [("pp2-vs2-dp2", dict(pipeline=2), ["parallel.pipeline=2", "parallel.virtual_stages=2"]),
            ("dp4-ep2-edp2", dict(expert=2), EP2),
            ("dp4-ep2-edp2-capacity-parts", dict(expert=2), EP2 + ["moe.capacity_factor=1.0"] + PARTS),
            ("dp4-ep2-edp2-recompute", dict(expert=2), EP2 + ["training.recompute=full"]),
            ("dp4-ep2-edp2-zero1-capacity", dict(expert=2), EP2 + ZERO + ["moe.capacity_factor=1.0"]),
            # Agg into the owners' gradients when backward ends: expert buckets after backward (`late_expert_grads`)
            ("dp4-ep2-edp2-fastermoe", dict(expert=2), EP2 + ["moe.balancer=fastermoe", "moe.fastermoe.min_shadow=1"])]}
EDP_LATE = {"ep2-fastermoe-recompute", "ep2-eplb-partitions", "dp4-ep2-edp2-fastermoe"}  # no edp bucket from hooks
EDP_HOOKED = {job[0] for jobs in JOBS.values() for job in jobs if job[0] not in EDP_LATE | {"handmade"}}
_CACHE = {}


def _results(world):
    if world not in _CACHE:
        _CACHE[world] = run_distributed(world, _jobs, args=(JOBS[world],), timeout=600)
    return _CACHE[world]


@pytest.mark.distributed
def test_hooks_start_dense_and_expert_buckets_in_the_last_backward_only_and_match_bitwise():
    for out in (rank["handmade"] for rank in _results(2)):
        assert out["after first backward True"] == 0  # gradient accumulation: nothing before the last micro-batch
        assert out["after last backward True"] == out["hooked buckets True"] > 0
        assert out["hooked expert buckets True"] == 2 and out["hooked buckets False"] == 0
        # the expert buckets on edp's side channel only, the same bytes as on edp without the option
        expert_bytes = out["expert bucket bytes True"]
        assert expert_bytes > 0 and out["bytes False"]["all_reduce/edp"] == expert_bytes
        assert out["bytes True"]["all_reduce/edp_side"] == expert_bytes and "all_reduce/edp" not in out["bytes True"]
        assert "edp_side" not in str(out["bytes False"])
        assert out["late addition raises True"] == [True] * 3 and out["late addition raises False"] == [False] * 3
        assert out["third backward raises"]
        for name, grad in out["grads False"].items():
            assert torch.equal(out["grads True"][name], grad), name


def _merged(counters: dict) -> dict:
    """Counters with "<kind>/<group>_side" added into "<kind>/<group>"."""
    out = {}
    for key, value in counters.items():
        out[key.replace("_side", "")] = out.get(key.replace("_side", ""), 0) + value
    return out


def _check_trainer_runs(ranks, name):
    for rank, results in enumerate(ranks):
        plain, overlap = results[name][False], results[name][True]
        where = f"{name} rank {rank}"
        assert overlap["loss"] == plain["loss"] and overlap["grad_norm"] == plain["grad_norm"], where
        for step, (a, b) in enumerate(zip(plain["grads"], overlap["grads"])):
            assert a.keys() == b.keys(), where
            for key in a:
                assert torch.equal(a[key], b[key]), f"{where} step {step + 1} {key}"
        for key, weight in plain["params"].items():
            assert torch.equal(weight, overlap["params"][key]), f"{where} {key}"
        for step in range(ITERS):  # the same traffic, the replica sums moved to the side channels
            assert _merged(overlap["bytes"][step]) == plain["bytes"][step], where
            assert _merged(overlap["calls"][step]) == plain["calls"][step], where
            assert not any("_side" in k for k in plain["bytes"][step] if not k.startswith("warm_up")), where
        kind = GRAD_KIND if "zero1" in name else "all_reduce"
        assert plain["bytes"][0][f"{kind}/dp"] > 0 and overlap["bytes"][0][f"{kind}/dp_side"] > 0, where
        if name in EDP_HOOKED:  # every expert bucket on edp's side channel, none on edp
            assert plain["bytes"][0][f"{kind}/edp"] > 0, where
            assert overlap["bytes"][0][f"{kind}/edp_side"] == plain["bytes"][0][f"{kind}/edp"], where
            assert f"{kind}/edp" not in overlap["bytes"][0] and min(overlap["hooked_edp"]) > 0, where
        else:  # edp 1, or the expert buckets after backward, on edp itself
            assert "edp_side" not in str(overlap["bytes"][0]) and overlap["hooked_edp"] == [0] * ITERS, where
            assert overlap["bytes"][0].get(f"{kind}/edp") == plain["bytes"][0].get(f"{kind}/edp"), where
        assert overlap["bytes"][0].get(f"{kind}/dp", 0) <= 64, where  # none of the buckets (the loss mean's doubles)
        assert plain["hooked"] == [0] * ITERS and min(overlap["hooked"]) > 0, where
        for exposed, total in overlap["times"]:
            assert 0 < exposed < total, (where, exposed, total)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [job[0] for job in JOBS[2][1:]])
def test_overlapped_training_equals_plain_bitwise_two_ranks(name):
    _check_trainer_runs(_results(2), name)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [job[0] for job in JOBS[4]])
def test_overlapped_training_equals_plain_bitwise_four_ranks(name):
    _check_trainer_runs(_results(4), name)


# -- ZeRO-1's collectives ---------------------------------------------------------------------------
def _zero_paths(state, overlap):
    state = ParallelState.build(RankLayout(world_size=state.world_size), state.rank, side_channels=["dp", "edp"])
    cfg = load_config("configs/gpt_moe_tiny.yaml", COMMON + ["optimizer.distributed=true",
                                                             f"optimizer.overlap_grad_reduce={str(overlap).lower()}"])
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
    trainer.optimizer.begin(trainer.num_micro_batches)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "_REDUCE_SCATTER_TENSOR", counted(C._REDUCE_SCATTER_TENSOR, "tensor_rs"))
        mp.setattr(C, "_ALL_GATHER_INTO", counted(C._ALL_GATHER_INTO, "tensor_ag"))
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            mp.setattr(C.dist, name, refused)
        trainer.forward_backward(0)
        in_backward = calls["tensor_rs"]
        trainer.optimizer.sync()
        trainer.optimizer.publish()
    return calls, len(trainer.optimizer.flats), in_backward


@pytest.mark.distributed
@pytest.mark.parametrize("overlap", [False, True])
def test_zero1_uses_the_tensor_forms(overlap):
    for calls, flats, in_backward in run_distributed(2, _zero_paths, args=(overlap,)):
        assert flats > 1 and calls == {"tensor_rs": flats, "tensor_ag": flats}  # buckets of 0.01 MiB: several
        assert in_backward == (flats if overlap else 0)


# -- config -----------------------------------------------------------------------------------------
def test_overlap_refuses_what_it_cannot_hook():
    cfg = load_config("configs/gpt_moe_tiny.yaml",
                      ["optimizer.overlap_grad_reduce=true", "moe.lancet.defer_wgrad=true"])
    with pytest.raises(ConfigError, match="does not work with moe.lancet.defer_wgrad=true"):
        validate_config(cfg, 1)
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["optimizer.overlap_grad_reduce=true", "optimizer.distributed=true"])
    validate_config(cfg, 2)  # ZeRO-1 overlaps its reduce-scatters


@pytest.mark.parametrize("extra,reason", [([], ""), (["moe.balancer=fastermoe"], "Agg"),
                                          (["moe.balancer=eplb"], "vExpert"), (["moe.smart_schedule=true"], "smart")])
def test_bucket_size_and_side_channels(extra, reason):
    with pytest.raises(ConfigError, match="optimizer.grad_bucket_mb=0.0 must be > 0"):
        validate_config(load_config("configs/gpt_moe_tiny.yaml", ["optimizer.grad_bucket_mb=0"]), 1)
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["optimizer.overlap_grad_reduce=true"] + extra)
    assert (late_expert_grads(cfg) == "") == (reason == "") and reason in late_expert_grads(cfg)
    assert "dp" in side_channels(cfg) and ("edp" in side_channels(cfg)) == (reason == "")
    assert side_channels(load_config("configs/gpt_moe_tiny.yaml", [])) == []


def test_late_expert_grads_is_what_the_registered_parts_declare(monkeypatch):
    """A balancer (or the smart exchange) declares `late_expert_grads`; no list of names to keep."""
    from megatron_moe.moe.balancers import BALANCERS
    from megatron_moe.moe.balancers.base import OwnerOnly

    class Late(OwnerOnly):
        late_expert_grads = "its plan adds to expert gradients after backward"

    BALANCERS.names()  # the entries registered
    monkeypatch.setitem(BALANCERS._entries, "late_test", Late)
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["optimizer.overlap_grad_reduce=true", "moe.balancer=late_test"])
    assert late_expert_grads(cfg) == Late.late_expert_grads and side_channels(cfg) == ["dp"]
    cfg.moe.smart_schedule = True  # both reasons, each once
    assert late_expert_grads(cfg).count(";") == 1 and "smart" in late_expert_grads(cfg)
