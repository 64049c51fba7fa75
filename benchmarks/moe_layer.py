"""One MoE layer, forward + backward, every schedule and balancer side by side (Parm §VI-C style).

    torchrun --nproc_per_node 8 benchmarks/moe_layer.py --tensor 2 --expert 2 --expert-shard 2
    torchrun --nproc_per_node 2 benchmarks/moe_layer.py --expert 2 --rows baseline --balancer none,fastermoe --skew 1.2

Rows: baseline (Parm Fig. 3(a), DeepSpeed-MoE style), s1, s2 (AAS), s2_saa, auto (Alg. 1 with
--profile, S2 with AAS), auto_saa (S2 with SAA) and auto_saa_s1_phased: auto + SAA as it ran
before review issue #15 item 5, S1's combine through SAA's phased point-to-point exchange instead
of its plain all-to-all (kept to measure that fix in the same run); node_dedup: the baseline with
the node-deduplicated dispatch (`moe.token_dispatch=node_dedup`, docs/node_dedup.md: a token
crosses to a node once, whatever its experts there; with --ranks-per-node and group-limited
routing, --router-groups G --router-group-topk M, for every row); and `deepspeed`,
DeepSpeed-MoE's own layer on the same gate and expert weights, whenever `deepspeed` is importable
(`pip install deepspeed`; --expert-shard 1, gelu, no --skew; otherwise the JSON config's
`deepspeed_row` says why it is absent; its time only, as its collectives bypass our counters).
At --tensor > 1 DeepSpeed gets an `mpu` (`DeepSpeedMPU`) naming our tensor-parallel group, so its
MOELayer drops the TP-duplicate tokens before the all-to-all and gathers them after, as it does
under Megatron-DeepSpeed: closer to Parm's S2 than to the Fig. 3(a) baseline row, which is what
its speedup is against. Before timing, a dropless run checks that its output equals the baseline
row's (it stops otherwise). Every layer gets the same
weights (seeded) and every data-parallel rank its own tokens. Each schedule row runs once per
--balancer (rows named `<schedule>+<balancer>` for balancers other than none; `proprophet:overlap`
is Pro-Prophet with its block-wise scheduler) and, with --smart,
also with FasterMoE's smart schedule (`+smart`, rows without SAA). --skew S adds a
fixed Zipf(S) bias, -S ln(e + 1), to every router's logits (`Router.logit_bias`, a measurement
hook: expert 0 most popular), so balancers have imbalance to fix. --layers N runs N MoE layers
in a row (each with its own weights), so cross-layer scheduling (Pro-Prophet's Trans prefetch)
has a layer before to overlap with; per-row loads and replicas are then summed over the layers. Without --profile, the rows
that need a hardware profile (auto, fastermoe) use one calibrated on these ranks
(`training/calibrate.py`, cached). Repetitions are interleaved (rep 1 of every row, then rep 2, ...) so
that load drifts hit every row alike; a repetition's time is the slowest rank's.

Reported per row: median ms over --reps after --warmup; `bytes` (rank 0) and `bytes_all_ranks`
(summed over every rank) per "<op kind>/<group>" for one repetition, and
`inter_node_bytes_all_ranks` the part sent across (simulated, --ranks-per-node) nodes; `exposed_ms` /
`total_ms` per op kind (rank 0's median: time blocked by communication vs its whole span);
speedup_vs_baseline = baseline median / row median; `max_abs_diff_vs_baseline`: the largest
difference of the layer output and input gradient from the baseline row's, over all ranks (every
row computes the same math, so this is float rounding); `balance_ratio`: max / mean over EP ranks
of the rows each computes (FlexMoE Eq. 6, summed over the ep_esp groups; last repetition);
`replicas`, `trans_bytes`, `agg_bytes`: expert replicas and their weight / gradient bytes (rank
0); `vexpert_moves`, `vexpert_move_bytes`: for flexmoe / eplb rows, the primitives executed
(decided every --vexpert-interval repetitions; weights only: no optimizer here) and the bytes rank
0 (and all ranks: `vexpert_move_bytes_all_ranks`) sent for them, over the whole run. A vExpert
row's repetition is the previous one's `after_optimizer_step` (the decision and its moves) and
then forward + backward, all timed, as in a training iteration: a synchronous round
(`flexmoe`, `eplb`) lands inside `after_optimizer_step`, a best-effort one (`flexmoe:best_effort`,
`moe.flexmoe.moves`) in the forward of its layer, after the layers before it ran;
`vexpert_move_ms` sums the moves' exposed and total time (rank 0, timed repetitions). The
replicas' gradient all-reduce is timed too (`before_grad_sync`). `memory_per_rank`: each rank's
parameter bytes of the row's layers (`param_bytes`; vExperts: one copy per expert a rank holds),
the AdamW state they would have (`adam_state_bytes`: two fp32 moments per parameter, and an fp32
master in bf16), both after the run, and the replica weights *Trans* brought in for one
repetition's forward (`replica_param_bytes`: FasterMoE's shadows, Pro-Prophet's replicas; their
gradients take as much again until *Agg*). For auto rows: the schedule Alg. 1 picked (last
repetition). --drift K rolls the --skew bias by one expert every K repetitions (drifting routing:
the vExpert balancers keep moving). The JSON's
`routing_counts` are every data-parallel rank's routed assignments per expert before drops, per
TP token piece ([dp][tp][E], S1's pieces): what the cluster simulator replays
(`benchmarks/sim_validate.py`). --precision bf16 runs every row on bf16 weights and tokens with
the weight gradients accumulated into fp32 main gradients, as `training.precision=bf16` trains
(docs/precision.md). Rank 0 prints one JSON object on its last line. Default shapes are sized for 8 processes on 2 CPU cores.
"""
import argparse
import json
import statistics
import sys
from dataclasses import replace

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.parallel_state import side_channels
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_
from megatron_moe.model.precision import MainGrads, cast_params_, param_dtype
from megatron_moe.moe.balancers import BALANCERS
from megatron_moe.model.transformer import link_moe_layers
from megatron_moe.moe.layer import MoELayer
from megatron_moe.moe.schedules.base import even_split
from megatron_moe.techniques.parm.parm import Auto
from megatron_moe.training.calibrate import resolve_hardware_profile
from megatron_moe.distributed.rank_timing import init_state, slowest_rank_seconds

ROWS = {  # name -> (moe.schedule, moe.saa)
    "baseline": ("baseline", False),
    "s1": ("s1", False),
    "s2": ("s2", False),
    "s2_saa": ("s2", True),
    "auto": ("auto", False),
    "auto_saa": ("auto", True),
    "auto_saa_s1_phased": ("auto", True),
    "node_dedup": ("baseline", False),  # + moe.token_dispatch=node_dedup (ROW_DISPATCH)
}
ROW_DISPATCH = {"node_dedup": "node_dedup"}  # moe.token_dispatch of a row (default per_copy)


class AutoWithPhasedS1(Auto):
    """auto + SAA before issue #15 item 5: S1's combine phased like SAA (pure overhead)."""

    def uses_saa(self, routed) -> bool:
        return self.cfg.moe.saa


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--expert", type=int, default=1)
    p.add_argument("--expert-shard", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="micro-batch size per data-parallel rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024, help="expert FFN hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    p.add_argument("--activation", default="gelu", choices=["gelu", "swiglu"])
    p.add_argument("--profile", default=None, help="hardware profile for auto / fastermoe (default: calibrate here)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    p.add_argument("--balancer", default="none", help="comma-separated balancers, each run with every row")
    p.add_argument("--vexpert-interval", type=int, default=1,
                   help="flexmoe / eplb rows: re-plan the vExpert slots every N repetitions (moe.*.interval)")
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of a fixed router-logit bias (0 = none)")
    p.add_argument("--drift", type=int, default=0,
                   help="with --skew: roll the bias by one expert every N repetitions (0 = fixed)")
    p.add_argument("--min-shadow", type=int, default=0, help="moe.fastermoe.min_shadow")
    p.add_argument("--min-replicas", type=int, default=0, help="moe.proprophet.min_replicas")
    p.add_argument("--layers", type=int, default=1,
                   help="MoE layers in a row (>= 2 for Pro-Prophet's cross-layer Trans prefetch)")
    p.add_argument("--smart", action="store_true",
                   help="also run every row without SAA with FasterMoE's smart schedule (rows '<name>+smart')")
    p.add_argument("--smart-group-size", type=int, default=1, help="moe.smart_group_size")
    p.add_argument("--gate", default="softmax", help="moe.gate (topology: FasterMoE's topology-aware gate)")
    p.add_argument("--router-groups", type=int, default=1, help="moe.router_groups (group-limited routing)")
    p.add_argument("--router-group-topk", type=int, default=None, help="moe.router_group_topk")
    p.add_argument("--ranks-per-node", type=int, default=None, help="simulated node size (inter-node bytes)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: bf16 weights, tokens and gradients, weight gradients into fp32 main grads "
                        "(training.precision=bf16, docs/precision.md); the deepspeed row is left out")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    rows_given = args.rows != p.get_default("rows")
    args.rows = [r for r in args.rows.split(",") if r]
    if args.tensor == 1 and "s2_saa" in args.rows:  # refused by the config loader (docs/parm.md)
        if rows_given:
            p.error("--rows s2_saa needs --tensor > 1: SAA overlaps S2's all-gather, which tensor 1 does not have")
        args.rows.remove("s2_saa")
        print("moe_layer: row s2_saa left out at --tensor 1 (no all-gather for SAA to overlap)", file=sys.stderr)
    args.balancer = [b for b in args.balancer.split(",") if b]
    unknown = set(args.rows) - ROWS.keys()
    if unknown or "baseline" not in args.rows:
        p.error(f"--rows: unknown {sorted(unknown)} (choose from {', '.join(ROWS)}; baseline is required)")
    known = set(BALANCERS.names()) | set(BALANCER_VARIANTS)
    if "none" not in args.balancer or set(args.balancer) - known:
        p.error(f"--balancer: choose from {', '.join(sorted(known))} (none is required)")
    if args.layers < 1:
        p.error("--layers must be >= 1")
    return args


BALANCER_VARIANTS = {"proprophet:overlap": "proprophet",  # + Pro-Prophet's block-wise scheduler (Alg. 2)
                     "flexmoe:best_effort": "flexmoe"}  # moe.flexmoe.moves=best_effort (FlexMoE §4)


def layer_config(args, schedule: str, saa: bool, balancer: str = "none", smart: bool = False,
                 token_dispatch: str = "per_copy") -> Config:
    cfg = Config()
    cfg.moe.token_dispatch = token_dispatch
    cfg.moe.router_groups, cfg.moe.router_group_topk = args.router_groups, args.router_group_topk
    cfg.moe.proprophet.overlap = balancer == "proprophet:overlap"
    cfg.moe.proprophet.min_replicas = args.min_replicas
    cfg.moe.flexmoe.moves = "best_effort" if balancer == "flexmoe:best_effort" else "sync"
    balancer = BALANCER_VARIANTS.get(balancer, balancer)
    m, moe = cfg.model, cfg.moe
    m.hidden_size, m.activation, m.seq_length = args.hidden, args.activation, args.seq
    moe.num_experts, moe.top_k, moe.capacity_factor = args.experts, args.top_k, args.capacity_factor
    moe.expert_ffn_hidden_size, moe.schedule, moe.saa = args.ffn, schedule, saa
    moe.balancer, moe.fastermoe.min_shadow = balancer, args.min_shadow
    moe.smart_schedule, moe.smart_group_size, moe.gate = smart, args.smart_group_size, args.gate
    cfg.parallel.tensor, cfg.parallel.expert, cfg.parallel.expert_shard = args.tensor, args.expert, args.expert_shard
    cfg.perf.hardware_profile = args.profile
    moe.flexmoe.interval = moe.eplb.interval = args.vexpert_interval
    return cfg


class LayerStack(torch.nn.Module):
    """--layers MoE layers in a row (x -> layer 1 -> ... -> layer N), linked for cross-layer
    scheduling (`techniques/proprophet/cross_layer.py`); `last_stats`: loads and replicas summed over the layers."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        link_moe_layers(list(self.layers))

    def forward(self, x):
        aux = 0.0
        for layer in self.layers:
            x, layer_aux = layer(x)
            aux = aux + layer_aux
        return x, aux

    @property
    def last_stats(self):
        stats = [layer.last_stats for layer in self.layers]
        return replace(stats[0], tokens_per_ep_rank=sum(s.tokens_per_ep_rank for s in stats),
                       replicas=sum(s.replicas for s in stats))


def skew_bias(args, rep: int) -> torch.Tensor:
    """[E] the --skew Zipf bias on the router logits at repetition `rep` (rolled with --drift)."""
    bias = -args.skew * torch.log(torch.arange(1, args.experts + 1, dtype=torch.float32))
    return bias.roll(rep // args.drift) if args.drift else bias


def memory_bytes(stack: LayerStack, precision: str, replica_bytes: int) -> list:
    """[parameter bytes, AdamW state bytes they would have, replica weight bytes of one forward] of this rank."""
    params = sum(p.numel() * p.element_size() for p in stack.parameters())
    per_element = 8 + (4 if precision != "fp32" else 0)  # two fp32 moments (+ the fp32 master of a bf16 weight)
    return [params, sum(p.numel() for p in stack.parameters()) * per_element, replica_bytes]


def build_layer(args, row: str, balancer: str, smart: bool, state, device) -> LayerStack:
    schedule, saa = ROWS[row]
    cfg = layer_config(args, schedule, saa, balancer, smart, ROW_DISPATCH.get(row, "per_copy"))
    layers = []
    for index in range(args.layers):
        layer = MoELayer(cfg, state, layer_index=index)
        if row == "auto_saa_s1_phased":
            layer.schedule = AutoWithPhasedS1(cfg, state)
        if args.skew:
            layer.router.logit_bias = skew_bias(args, 0)
        init_model_from_seed_(layer, args.seed + index, state)
        layers.append(cast_params_(layer, args.precision))
    stack = LayerStack(layers).to(device)
    if args.precision != "fp32":  # dW into fp32 main gradients, as in training (model/precision.py)
        stack.main_grads = MainGrads([p for p in stack.parameters() if p.requires_grad])
    return stack


class DeepSpeedMPU:
    """The Megatron-style `mpu` DeepSpeed reads the model-parallel layout from
    (`deepspeed.utils.groups.mpu`): tensor parallel = our `tp` group, no pipeline. With it,
    DeepSpeed's MOELayer splits the TP-replicated tokens of each expert's capacity over the TP
    ranks before its all-to-all and all-gathers them after (`drop_tokens` / `gather_tokens`)."""

    def __init__(self, state):
        self.state = state

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    def get_tensor_model_parallel_rank(self) -> int:
        return self.state.tp.rank

    def get_tensor_model_parallel_group(self):
        return self.state.tp.handle

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.state.dp.rank

    def get_data_parallel_group(self):
        return self.state.dp.handle


def _gather_tokens_for_gloo(deepspeed) -> None:
    """DeepSpeed's `gather_tokens` all-gathers a `[b, ...]` tensor into a flat buffer, which NCCL
    accepts and gloo refuses (it wants `[world * b, ...]`): hand gloo the same buffer so shaped."""
    flat = deepspeed.comm.all_gather_into_tensor

    def shaped(output_tensor, tensor, group=None, async_op=False, **kwargs):
        return flat(output_tensor.view(-1, *tensor.shape[1:]), tensor, group=group, async_op=async_op, **kwargs)

    deepspeed.comm.all_gather_into_tensor = shaped


def deepspeed_row(args, baseline: MoELayer, state):
    """DeepSpeed-MoE's layer (`deepspeed.moe.layer.MoE`, GShard top-2 without sampling) on the
    baseline row's weights -> (module, None), or (None, why there is no row). Same gate and expert
    weights, so its output matches the baseline's up to float rounding when dropless (with a
    capacity, DeepSpeed drops by location: first choices before second, so drops may differ).
    Its expert-parallel groups (consecutive ranks, DeepSpeed's default without expert tensor
    parallelism) are ours at --expert-shard 1, so its experts are ours, whole."""
    why = [reason for reason, bad in [
        ("expert_shard > 1 (DeepSpeed's experts here are whole; its expert tensor parallelism would need "
         "tensor-parallel expert modules)", args.expert_shard > 1),
        ("activation swiglu (its expert is Linear-GELU-Linear here)", args.activation != "gelu"),
        ("--skew (its gate takes no logit bias)", args.skew), ("top-k > 2", args.top_k > 2),
        ("--gate other than softmax", args.gate != "softmax"), ("--layers > 1", args.layers > 1)] if bad]
    if why:  # decided before importing deepspeed (~0.5 s of CPU per rank)
        return None, "; ".join(why)
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
        from deepspeed.utils import groups
    except ImportError:
        return None, "deepspeed is not importable"
    # DeepSpeed's CPU shared-memory collectives (an all-reduce kernel, JIT-compiled with ninja on
    # first use: ~50 s in a fresh environment) play no part in its MoE layer's all-to-alls
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
    if state.tp_size > 1:
        groups.mpu = DeepSpeedMPU(state)
        if torch.distributed.get_backend() == "gloo":
            _gather_tokens_for_gloo(deepspeed)
    h, f = args.hidden, args.ffn
    expert = torch.nn.Sequential(torch.nn.Linear(h, f), torch.nn.GELU(), torch.nn.Linear(f, h))
    dropless = args.capacity_factor is None
    moe = MoE(h, expert, num_experts=args.experts, ep_size=args.expert, k=args.top_k,
              capacity_factor=args.capacity_factor or 1.0, eval_capacity_factor=args.capacity_factor or 1.0,
              min_capacity=0, drop_tokens=not dropless, use_rts=False, top2_2nd_expert_sampling=False)
    moe.set_deepspeed_parallelism()
    ours = baseline.experts
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(baseline.router.weight)
        for e, (fc1, _, fc2) in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            fc1.weight.copy_(ours.w1[e].t()), fc2.weight.copy_(ours.w2[e].t())
            fc1.bias.copy_(ours.b1[e]), fc2.bias.copy_(ours.b2[e])
    return moe, None


def check_deepspeed_equals_baseline(deepspeed, baseline, x, state, tolerance: float = 1e-4) -> None:
    """Dropless: DeepSpeed's layer output must equal the baseline row's before it is timed."""
    with torch.no_grad():
        ours, _ = baseline(x)
        theirs, _, _ = deepspeed(x)
    diff = float(C.all_reduce(state.world.to_device(torch.tensor([float((ours - theirs).abs().max())],
                                                              dtype=torch.float64)), state.world, op="max"))
    if not diff <= tolerance:
        raise SystemExit(f"DeepSpeed-MoE's output differs from ours by {diff:.3g} (> {tolerance}) on a "
                         "dropless step: the rows would not time the same layer")


def bytes_of_kind(counters: dict, kind: str) -> int:
    """Bytes of one op kind over all groups in a COMM_STATS snapshot ("<kind>/<group>" keys)."""
    return sum(n for key, n in counters.items() if key.split("/")[0] == kind)


def row_name(row: str, balancer: str, smart: bool) -> str:
    return row + ("" if balancer == "none" else f"+{balancer}") + ("+smart" if smart else "")


def sum_over_ranks(counters: dict, state) -> dict:
    """{key: int} of this rank -> the same keys summed over every rank (keys of all ranks)."""
    keys = sorted(set().union(*C.all_gather_object(sorted(counters), state.world)))
    totals = torch.tensor([counters.get(k, 0) for k in keys], dtype=torch.int64)
    return dict(zip(keys, C.all_reduce(state.world.to_device(totals), state.world).tolist()))


def main(argv=None) -> int:
    args = parse_args(argv)
    state = init_state(args.tensor, args.expert, args.expert_shard, ranks_per_node=args.ranks_per_node,
                       side_channels=sorted({name for b in args.balancer  # as the trainer (SIDE_CHANNELS)
                                             for name in side_channels(layer_config(args, "baseline", False, b))}))
    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")
    gen = torch.Generator().manual_seed(args.seed + state.dp.rank)  # same tokens on a TP group
    dtype = param_dtype(args.precision)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device, dtype)
    grad = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device, dtype)
    if args.profile is None:  # one profile, calibrated here (or cached), for every row that needs one
        every_need = layer_config(args, "auto", False, "fastermoe" if set(args.balancer) - {"none"} else "none")
        args.profile = resolve_hardware_profile(every_need, state, device, say=lambda msg: print(msg, flush=True),
                                                run_dir_copy=False).perf.hardware_profile
    variants = [(row, b, smart) for smart in ([False, True] if args.smart else [False]) for b in args.balancer
                for row in args.rows  # the smart schedule replaces SAA and sends per copy
                if not (smart and (ROWS[row][1] or row in ROW_DISPATCH))]
    layers = {row_name(*v): build_layer(args, *v, state, device) for v in variants}
    times = {name: [] for name in layers}
    comm_times = {name: [] for name in layers}
    bytes_, inter_node, picked, outputs, loads, replicas = {}, {}, {}, {}, {}, {}

    moves = {name: [0, 0] for name in layers}  # vExpert primitives, bytes sent (this rank) over the run
    move_ms = {name: [0.0, 0.0] for name in layers}  # vExpert moves' exposed, total ms (timed repetitions)

    def step(name, rep):
        layer = layers[name]
        C.COMM_STATS.reset()
        if rep > 0:  # vExperts (flexmoe, eplb): the previous repetition's decision and moves, as after a step
            for each in layer.layers:
                moves[name][0] += each.balancer.after_optimizer_step(rep, None)
        inp = x.clone().requires_grad_(True)
        y, aux = layer(inp)
        ((y * grad).sum() + aux).backward()
        for each in layer.layers:  # vExperts (flexmoe, eplb): the slots of an expert sum their gradients
            each.balancer.before_grad_sync()
        bytes_[name], inter_node[name] = C.COMM_STATS.snapshot(), dict(C.COMM_STATS.inter_node)
        moves[name][1] += bytes_of_kind(bytes_[name], "vexpert_move")
        comm_times[name].append(C.COMM_STATS.seconds_by_kind(resolve=False))  # read after the timed step
        picked[name], replicas[name] = layer.last_stats.schedule, layer.last_stats.replicas
        loads[name] = layer.last_stats.tokens_per_ep_rank
        outputs.setdefault(name, (y.detach(), inp.grad))
        layer.zero_grad(set_to_none=True)
        if hasattr(layer, "main_grads"):
            layer.main_grads.zero_()

    deepspeed, deepspeed_skipped = (deepspeed_row(args, layers["baseline"].layers[0], state) if args.precision == "fp32"
                                    else (None, "--precision bf16: the deepspeed row runs fp32 only"))
    if deepspeed is not None:
        deepspeed, times["deepspeed"] = deepspeed.to(device), []
        aux_coeff = layer_config(args, "baseline", False).moe.aux_loss_coeff

        def step_deepspeed():
            inp = x.clone().requires_grad_(True)
            y, aux, _ = deepspeed(inp)
            ((y * grad).sum() + aux_coeff * aux).backward()
            outputs.setdefault("deepspeed", (y.detach(), inp.grad))
            deepspeed.zero_grad(set_to_none=True)

        if args.capacity_factor is None:
            check_deepspeed_equals_baseline(deepspeed, layers["baseline"], x, state)

    for rep in range(args.warmup + args.reps):
        if args.drift:
            for layer in (each for stack in layers.values() for each in stack.layers):
                layer.router.logit_bias = skew_bias(args, rep).to(device)
        for name in times:
            seconds = slowest_rank_seconds(step_deepspeed if name == "deepspeed" else lambda: step(name, rep), state)
            if rep >= args.warmup:
                times[name].append(seconds * 1e3)
                if name != "deepspeed":
                    spent = C.resolved(comm_times[name][-1])
                    move_ms[name][0] += spent["exposed"].get("vexpert_move", 0.0) * 1e3
                    move_ms[name][1] += spent["total"].get("vexpert_move", 0.0) * 1e3
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    for stack in layers.values():  # best-effort moves of the last repetition land before memory is counted
        for layer in stack.layers:
            layer.balancer.complete_moves()
    results = {}
    for name in times:
        diff = max(float((a - b).abs().max()) for a, b in zip(outputs[name], outputs["baseline"]))
        diff = float(C.all_reduce(state.world.to_device(torch.tensor([diff], dtype=torch.float64)), state.world,
                                  op="max"))
        if name == "deepspeed":  # its collectives bypass ours: no byte or wait counters
            results[name] = {"ms_median": round(medians[name], 3), "max_abs_diff_vs_baseline": diff,
                             "speedup_vs_baseline": round(medians["baseline"] / medians[name], 3)}
            continue
        timed = [C.resolved(t) for t in comm_times[name][args.warmup:] or comm_times[name]]
        # [ep] rows per EP rank, all ep_esp groups
        load = C.all_reduce(state.edp.to_device(loads[name].double()), state.edp)
        results[name] = {
            "ms_median": round(medians[name], 3), "speedup_vs_baseline": round(medians["baseline"] / medians[name], 3),
            "bytes": dict(sorted(bytes_[name].items())), "bytes_all_ranks": sum_over_ranks(bytes_[name], state),
            "inter_node_bytes_all_ranks": sum_over_ranks(inter_node[name], state),
            **{f"{part}_ms": {kind: round(statistics.median(t[part].get(kind, 0.0) for t in timed) * 1e3, 3)
                              for kind in timed[-1][part]} for part in ("exposed", "total")},
            "max_abs_diff_vs_baseline": diff,
            "balance_ratio": round(float(load.max() / load.mean().clamp(min=1e-12)), 4),
            "replicas": replicas[name], "trans_bytes": bytes_of_kind(bytes_[name], "trans"),
            "agg_bytes": bytes_of_kind(bytes_[name], "agg"),
            "vexpert_moves": moves[name][0], "vexpert_move_bytes": moves[name][1],
            "vexpert_move_bytes_all_ranks": int(C.all_reduce(state.world.to_device(
                torch.tensor([float(moves[name][1])], dtype=torch.float64)), state.world)[0]),
            "vexpert_move_ms": {"exposed": round(move_ms[name][0], 3), "total": round(move_ms[name][1], 3)},
            "memory_per_rank": dict(zip(("param_bytes", "adam_state_bytes", "replica_param_bytes"), C.all_gather(
                state.world.to_device(torch.tensor([memory_bytes(layers[name], args.precision,
                                                                 bytes_of_kind(bytes_[name], "agg"))],
                                                   dtype=torch.int64)), state.world).T.tolist())),
        }
        if ROWS[name.split("+")[0]][0] == "auto":
            results[name]["picked"] = picked[name]
    config = dict(vars(args), world_size=state.world_size, data_parallel=state.dp_size, device=str(device),
                  deepspeed_row=deepspeed_skipped or "present")
    with torch.no_grad():  # every row routes alike: the baseline layer's router on this rank's tokens
        ids = layers["baseline"].layers[0].router(x.view(-1, args.hidden)).expert_ids.cpu()
    pieces = torch.stack([torch.bincount(p.flatten(), minlength=args.experts)
                          for p in ids.split(even_split(ids.shape[0], state.tp_size))])  # [tp, E]
    gathered = C.all_gather(pieces[None].to(device), state.world).cpu()  # [world, tp, E]
    routing_counts = [gathered[next(r for r in range(state.world_size) if state.layout.coords(r)["dp"] == d)].tolist()
                      for d in range(state.dp_size)]
    if state.rank == 0:
        for name, r in results.items():
            print(f"{name:28s} {r['ms_median']:9.2f} ms  x{r['speedup_vs_baseline']:.2f}  "
                  f"balance {r.get('balance_ratio', '-')}  replicas {r.get('replicas', '-')}", flush=True)
        if deepspeed_skipped:
            print(f"no deepspeed row: {deepspeed_skipped}", flush=True)
        print(json.dumps({"config": config, "results": results, "routing_counts": routing_counts}), flush=True)
    C.destroy_process_group(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
