"""Check Pro-Prophet's performance model (Eq. 1-5, `techniques/proprophet/proprophet_model.py`) against measurement:
predicted vs measured time of the all-to-all, expert compute, Trans and Agg of lightweight
placements on these ranks.

    torchrun --nproc_per_node 2 tools/proprophet_model_check.py
    torchrun --nproc_per_node 4 tools/proprophet_model_check.py --profile configs/hardware/my.yaml

The profile (--profile, or by default one calibrated first on these ranks with the same code as
start-up calibration, `training/calibrate.py`: p2p and expert_compute, the ops the model reads) gives
1 / B and 1 / t. Then, for every --skews value, a Zipf routing T [D, E] (`sim/traces.py`, D = the
world size as EP ranks) is planned with Alg. 1 (`greedy_search`), and at least --replicas
replicas are forced (heaviest experts first) so that Trans and Agg have something to move. Each
op of that placement is timed on its own with the code training runs (median of --reps, slowest
rank's time):

* a2a:   `all_to_all_v` over `ep` of the placement's rows (h elements each) -> Eq. 1;
* fec:   every rank's experts (owned + replicas) forward on the rows it computes, grouped GEMM
         and activation (`grouped_mm`) -> Eq. 2;
* trans: `start_trans` of the replicas' weights (`moe/replicas.py`), waited -> Eq. 4;
* agg:   the backward of that Trans (gradients summed into the owners') -> Eq. 5.

The model is bandwidth-only as printed (no latency term): `predicted_ms` is the equation,
`predicted_with_alpha_ms` adds the profile's per-call latency once per op (per expert group for
fec). Errors are |predicted - measured| / measured; the paper reports < 5 % mean on GPUs. Rank 0
prints one JSON object on its last line.
"""
import argparse
import json
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives as C
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_
from megatron_moe.techniques.proprophet.proprophet import Loads, devices_for, greedy_search, lightweight_placement
from megatron_moe.moe.experts import Experts
from megatron_moe.moe.grouped_gemm import grouped_mm
from megatron_moe.moe.replicas import start_trans
from megatron_moe.training.calibrate import ExpertShape, fit_description, fit_profile, measure_points
from megatron_moe.perf.hardware import load_profile
from megatron_moe.techniques.proprophet.proprophet_model import PROPROPHET_OPS, ProphetCostModel
from megatron_moe.distributed.rank_timing import init_state, slowest_rank_seconds
from megatron_moe.sim.traces import zipf_rows

OPS = ("a2a", "fec", "trans", "agg")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024, help="FFN units of one expert")
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--rows", type=int, default=2048, help="rows each rank routes (tokens x top-k)")
    p.add_argument("--skews", default="0,0.8,1.6", help="comma-separated Zipf exponents, one case each")
    p.add_argument("--replicas", type=int, default=1, help="replicas forced per case, at least")
    p.add_argument("--profile", default=None, help="hardware profile (default: calibrate p2p and expert_compute here)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def plan(T: np.ndarray, model: ProphetCostModel, at_least: int):
    """Alg. 1's selections, topped up with the heaviest experts' replicas (every device with rows)."""
    chosen = greedy_search(T, model, alpha=0.0)
    per_rank = T.shape[1] // T.shape[0]
    for e in np.argsort(-T.sum(0), kind="stable").tolist():
        if len(chosen) >= at_least:
            break
        devices = devices_for(T, e, e // per_rank, 0)
        if e not in dict(chosen) and len(devices) > 1:
            chosen.append((e, devices))
    return chosen


def median_ms(run, state, reps: int) -> float:
    run()  # warm-up
    return statistics.median(slowest_rank_seconds(run, state) for _ in range(reps)) * 1e3


def measure(args, state, experts: Experts, placement, device) -> dict:
    me, table = state.ep.rank, placement.routing_table  # [S = D sources, E, D]
    send, recv = table[me].sum(0).tolist(), table[:, :, me].sum(1).tolist()  # rows to / from each device
    rows = torch.randn(sum(send), args.hidden, device=device)
    out = {"a2a": median_ms(lambda: C.all_to_all_v(rows, send, recv, state.ep), state, args.reps)}

    def trans():
        return start_trans(experts, placement.replicas, state)  # None on every rank, or on none

    with torch.no_grad():
        weights = trans()
        replica_stacks = list(weights.stacks()) if weights is not None else []
    computed = table[:, :, me].sum(0)  # rows of each expert computed here
    counts = [int(computed[e]) for e in experts.owned_expert_ids + (weights.expert_ids if weights else [])]
    x = torch.randn(sum(counts), args.hidden, device=device)
    w1 = torch.cat([experts.w1.detach()] + replica_stacks[:1])
    w2 = torch.cat([experts.w2.detach()] + replica_stacks[1:2])

    def fec():
        with torch.no_grad():
            grouped_mm(F.gelu(grouped_mm(x, w1, counts)), w2, counts)

    out["fec"] = median_ms(fec, state, args.reps)
    out["trans"] = out["agg"] = 0.0
    if weights is not None:
        def trans_waited():
            with torch.no_grad():
                trans().stacks()

        out["trans"] = median_ms(trans_waited, state, args.reps)
        agg = []
        for _ in range(args.reps + 1):  # the first is a warm-up
            loss = sum(s.sum() for s in trans().stacks())
            agg.append(slowest_rank_seconds(loss.backward, state))
        out["agg"] = statistics.median(agg[1:]) * 1e3
    return out


def predict(T: np.ndarray, chosen, model: ProphetCostModel, profile, experts_per_rank: int) -> dict:
    loads = Loads(T)
    for e, devices in chosen:
        loads.replicate(e, devices)
    D = T.shape[0]
    transfers = sum(len(d) - 1 for _, d in chosen)
    eq = {"a2a": model.a2a(loads.R), "fec": model.fec(loads.H), "trans": model.trans(transfers, D),
          "agg": model.trans(transfers, D)}
    groups = experts_per_rank + max((int((loads.computed[d] > 0).sum()) - experts_per_rank) for d in range(D))
    alpha = {"a2a": profile.p2p.alpha, "fec": profile.expert_compute.alpha * max(1, groups),
             "trans": profile.p2p.alpha if transfers else 0.0, "agg": profile.p2p.alpha if transfers else 0.0}
    return {op: eq[op] * 1e3 for op in OPS}, {op: (eq[op] + alpha[op]) * 1e3 for op in OPS}


def significant(times: dict) -> dict:
    return {op: float(f"{v:.5g}") for op, v in times.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    D = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    state = init_state(1, D, 1)
    if state.ep_size < 2:
        raise SystemExit("tools/proprophet_model_check.py needs at least 2 processes (torchrun --nproc_per_node N)")
    device = torch.device("cpu")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if state.rank == 0 else (lambda msg: None)
    shape = ExpertShape(args.hidden, args.ffn)
    if args.profile:
        profile = load_profile(args.profile).require(PROPROPHET_OPS, "tools/proprophet_model_check.py")
    else:
        say("calibrating p2p and expert_compute on these ranks ...")
        points = measure_points(state, (1 << 14, 1 << 17, 1 << 19, 1 << 20), 5, device, shape,
                                rows=(64, 512, 2048, 4096), ops=PROPROPHET_OPS, progress=say)
        profile = fit_profile("calibrated", points, fit_description(state, "tools/proprophet_model_check.py", 5, shape))
    model = ProphetCostModel.from_profile(profile, args.hidden, shape.params(False, 1), shape.flops_per_row, 0.0,
                                          overlap=False)

    cfg = Config()
    cfg.model.hidden_size, cfg.model.bias = args.hidden, False
    cfg.moe.num_experts, cfg.moe.expert_ffn_hidden_size = args.experts_per_rank * D, args.ffn
    cfg.parallel.expert = D
    experts = Experts(cfg, state).to(device)
    init_model_from_seed_(experts, args.seed, state)

    rng = np.random.default_rng(args.seed)
    cases, errors, errors_alpha = [], {op: [] for op in OPS}, {op: [] for op in OPS}
    for skew in (float(s) for s in args.skews.split(",")):
        T = zipf_rows(rng, cfg.moe.num_experts, D, args.rows, skew)  # same on every rank (same seed)
        chosen = plan(T, model, args.replicas)
        placement = lightweight_placement(torch.from_numpy(T), list(range(D)), D, chosen)
        measured = measure(args, state, experts, placement, device)
        eq, with_alpha = predict(T, chosen, model, profile, args.experts_per_rank)
        for op in OPS:
            if measured[op] > 0:
                errors[op].append(abs(eq[op] - measured[op]) / measured[op])
                errors_alpha[op].append(abs(with_alpha[op] - measured[op]) / measured[op])
        cases.append({"skew": skew, "replicas": sum(len(d) - 1 for _, d in chosen),
                      "measured_ms": significant(measured), "predicted_ms": significant(eq),
                      "predicted_with_alpha_ms": significant(with_alpha)})
        say(f"skew {skew}: " + ", ".join(f"{op} {measured[op]:.2f} / {eq[op]:.2f} ms" for op in OPS)
            + " (measured / predicted)")

    def mean(values):
        return round(statistics.mean(values), 4) if values else None

    summary = {"mean_rel_error": {op: mean(errors[op]) for op in OPS},
               "mean_rel_error_with_alpha": {op: mean(errors_alpha[op]) for op in OPS},
               "mean_rel_error_all": mean([v for op in OPS for v in errors[op]]),
               "mean_rel_error_all_with_alpha": mean([v for op in OPS for v in errors_alpha[op]])}
    if state.rank == 0:
        print(json.dumps({"config": vars(args), "world_size": D, "profile": profile.name,
                          "profile_fit": {op: {"alpha": getattr(profile, op).alpha, "beta": getattr(profile, op).beta}
                                          for op in PROPROPHET_OPS},
                          "cases": cases, **summary}))
    C.destroy_process_group(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
