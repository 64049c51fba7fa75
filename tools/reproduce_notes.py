"""The prose of docs/reproduce.md (tools/reproduce_papers.py): each experiment's table header and
title, and its setup and what differs from the paper and why, from the paper's own text."""

HEADERS = {
    "parm": (["schedule", "N_MP", "N_ESP", "testbed (GPUs)", "paper", "ours", "ours / paper"],
             "Parm Table IV: average speedup over the baseline schedule (DeepSpeed-MoE)"),
    "fastermoe": (["cluster", "optimization", "paper (Fig. 13)", "ours: mean (max) over iterations", "max / paper"],
                  "FasterMoE Fig. 13: speedup of the MoE layers over FastMoE"),
    "flexmoe": (["model", "paper (Fig. 5)", "ours: iterations 51-100 (all 100)", "ours / 1.30",
                 "balance ratio: FasterMoE / FlexMoE", "exposed token all-to-all ms: FasterMoE / FlexMoE",
                 "exposed ms: FasterMoE's Trans + Agg / FlexMoE's replica gradient all-reduce"],
                "FlexMoE Fig. 5: FlexMoE's speedup over FasterMoE"),
    "proprophet": (["cluster", "k", "model", "paper: FasterMoE / Pro-Prophet over DeepSpeed-MoE", "ours",
                    "ours / paper", "Pro-Prophet over FasterMoE: paper / ours"],
                   "Pro-Prophet Tables IV-V: speedup over DeepSpeed-MoE"),
    "lancet": (["cluster", "model", "paper (Fig. 13): non-overlapped communication cut vs RAF",
                "ours: all-to-all cut", "ours: all communication cut", "iteration speedup", "a2a cut / paper"],
               "Lancet Fig. 13: non-overlapped communication, Lancet vs RAF"),
    "combination": (["option", "iteration ms", "MoE layers ms", "balance ratio", "replicas per layer"],
                    "Parm S2 + SAA with each balancer (no paper measured it)"),
}

NOTES = {
    "parm": """Setup: Table III's layers as a grid of B in {2, 8}, L in {512, 2048}, M = H in {1024,
2048} (our reading of "H/N_ES and M/N_ES"), f in {1.2, 2.4}, top-2, E = N_EP experts (one per EP
rank, N_EP = P / N_ESP), uniform routing; speedup = baseline / option of the MoE layer's forward +
backward on the slowest rank, averaged over the grid as Table IV averages over its 1296 layers.
Profiles: `parm_testbed_a.yaml` / `parm_testbed_b.yaml` (the paper's all-gather fits, §VI-B;
all-to-all and SAA derived as their descriptions say; compute from the GPUs' data sheets).
What differs and why: the paper's speedups come from measured kernels, ours from one alpha-beta
per collective and a FLOP-rate compute model, so the absolute ratios differ by up to the ratio
column; the paper's large measured start-up (0.66 ms per all-gather on testbed A) makes every
extra collective expensive, which is why our `auto` can beat both S1 and S2: its S1 routes the
whole micro-batch on every TP rank and skips S1's two TP collectives of the gate (counts and
aux-loss sums) and the router-gradient all-reduce (docs/parm.md), which the paper's Parm does
not do. Where Alg. 1 picks the slower candidate (testbed B with 8 GPUs, N_MP = 4, N_ESP = 2: it
picks S2, the timeline finds S1 faster), Parm equals that candidate: Alg. 1 reads the flat
profile the paper fitted on the 32-GPU cluster (§VI-B), while the simulator prices the 8-GPU
layout's own links. On testbed A our S2 (and so Parm, where it picks S2) gains less at N_ESP = 4
than at 2, where the paper's grows: with N_ESP = 4 on 8 GPUs there are 2 EP ranks, S2's
EP&ESP-AlltoAll sends every row to 4 shard holders (x N_ESP), and on testbed A all of it crosses
the same PCIe fabric at the all-gather's fitted rate (the paper publishes no all-to-all fit for A;
its profile takes the all-gather's), while the measured kernels behind Table IV also got faster
per row with smaller shards, which a FLOP-rate compute model does not see.""",
    "fastermoe": """Setup: MoE-GPT on johnny (16 GPUs), MoE-BERT-Wide on trevor (64 GPUs) with their
configs in configs/papers/, one expert per GPU, top-2 dropless, skewed drifting routing
(`drift:1.4:0.05`: the paper's expert-selection dataset is not published; §4.1 reports popular
experts taking more than half the tokens); speedup = FastMoE's MoE-layer time (every layer,
forward + backward) over the option's, per iteration; the paper gives "up to" figures, so the
ratio column compares with our maximum. What differs and why: our shadowing decision is
FasterMoE's Alg. 1 on Eq. 7-8 (`moe.fastermoe.eq8: printed`, the paper's Eq. 8),
fed the derived profiles; with the strong skew of our trace it shadows the most popular experts
every iteration and the all-to-all of the hot expert's tokens dominates FastMoE's time, so our
gains are larger than the paper's, most on trevor whose 4 GPUs share one 100 Gb/s NIC. The smart
schedule's gain is bounded by (comm + comp) / max(comm, comp) (§5.5); with communication far
above computation on these derived links it stays near 1.2-1.3x, below the paper's 1.40x. Where
shadowing has already removed most of the hot experts' all-to-all (johnny), what is left to
overlap is small and the smart schedule's pairwise steps (16 per direction, each paying a
start-up) cost about what they hide, so "both" lands within a few percent of shadowing alone,
below it on johnny; the paper measured both above each.""",
    "flexmoe": """Setup: X-MoE-S (32 experts, 32 GPUs) and X-MoE-L (64 experts, 64 GPUs) from configs/papers/ (4
layers simulated per model), one expert per GPU plus one free vExpert slot, decisions every 5
iterations (`moe.flexmoe.interval`), 100 iterations of drifting Zipf(1.0) routing (§2.4's "routing
fluctuation"; its Fig. 3(a) has the top 10 of 64 experts taking almost 75% of the tokens, Zipf(1.0)
gives them 62%); speedup = FasterMoE's iteration time over FlexMoE's over iterations 51-100, all 100
in parentheses: FlexMoE starts from the owners' layout and its placement settles over its decisions,
while Fig. 5 covers whole training runs. Exposed times are per iteration on the critical rank,
summed over the layers. What differs and why. Our planner follows Alg. 2 as printed
(`flexmoe_plan.make_scheduling_plan` cites its lines): it only ever expands e0, the expert with the
most tokens per vExpert (line 6), and returns nothing unless Eq. 5, the slowest GPU's time, drops
(lines 8-10). Once the slowest GPU holds no vExpert of e0, Alg. 1 stops (lines 5-6): on these loads
fewer than one primitive per decision on average (`vexpert_moves` in the JSON counts the run's
primitives over its 20 decisions x 4 layers), and the balance ratio stays above FasterMoE's (the
table; `tests/unit/test_flexmoe_plan.py` has a worked example of this stop). A planner that also
expanded the slowest GPU's own experts would balance further, but that is not the paper's Alg. 2.
The paper's own text points at what its measurement had and ours has not: (1) it blames FasterMoE's
"coarse-grained expert management (i.e., on 1 GPU or on all GPUs)" and "the global synchronization
of expert replicas" as GPUs increase (§5.2). Here FasterMoE's broadcast of a shadowed expert (Trans,
issued before the dispatch all-to-all) and its reduce (Agg, issued after the experts' backward)
overlap with the layer's other work, and each shadowed expert's tokens stay on the GPU that routed
them, out of the all-to-all; with the testbed's 25-37.5 GB/s per GPU (§5.5) a GPT-MoE-S expert's
4.7M parameters broadcast in under 1 ms. FlexMoE's replicas all-reduce their gradients after
backward, not overlapped, as our trainer runs them (docs/balancers.md), and Eq. 9 charges every GPU
holding a replica for it: the last column. (2) Fig. 5 compares two code bases (FlexMoE inside Hetu
with its own kernels and expert-wise layout transformation, §4; FasterMoE on FastMoE); here both run
through the same modelled kernels and collectives, so only the policies differ. (3) Alg. 1 runs at
every step ("while is training", line 1; §5.3 Fig. 6(b): dynamic triggering beats fixed intervals)
and its adjustments run "concurrently with model training" on a separate stream (§3.4, §4
Best-Effort Adjustment); ours decides every 5 iterations on their mean loads and its moves block the
step.""",
    "proprophet": """Setup: Table IV (4 HPNV nodes, 16 GPUs, 16384 tokens per iteration: sequence
1024, one per GPU) and Table V (2 LPWNV nodes, 8 GPUs, 4096 tokens: sequence 512, one per GPU; the
paper does not say how its 4096 tokens were split), experts = GPUs, k in {1, 2}, drifting
Zipf(1.2) routing with locality; DeepSpeed-MoE = the baseline schedule without balancing;
Pro-Prophet = planner + block-wise scheduler (`moe.proprophet.overlap`). RB (§VI-C): the balance
degree (std of rows per device) without balancing over the one with it; we report Pro-Prophet's
RB over FasterMoE's per layer. What differs and why: FasterMoE's Alg. 1 often shadows nothing in
our runs (its Eq. 8 with the token term needs the busiest rank's load cut to pay for a broadcast
over 100 Gb/s InfiniBand shared by 4 GPUs), so its speedup over DeepSpeed-MoE is 1.00x in many
rows where the paper measured 1.0-2.3x: the paper's FasterMoE decisions came from FastMoE's
released policy and its own profiled bandwidths, ours from the derived ones. Pro-Prophet's
lightweight placements move an expert only to the devices that route to it, so they pay off on
the same links; its lead over FasterMoE is therefore larger in ours than in the paper. The same
reason puts our RB ratio far above the paper's 11.01x: where FasterMoE places nothing its RB is
1, while Pro-Prophet's planner balances the layer to within a few rows (its Eq. 7 stop, alpha =
0.5 of the mean load per expert), a balance degree near the one-row floor.""",
    "lancet": """Setup: GPT2-S/L-MoE (configs/papers/) on 4 nodes = 32 GPUs with two experts per GPU
(64 experts), Switch gate (k = 1, capacity 1.0), batch per GPU as §7 (A100: 24 / 48, V100: 16 / 8),
mildly skewed routing (zipf:0.5); RAF = no Lancet pass; Lancet = dW scheduling + the partitioned
forward (ρ = 8 parts at most, partition range by the dynamic program). "Non-overlapped
all-to-all": the critical rank's exposed time of the token all-to-alls (dispatch, combine, and
what the pipelines leave exposed), dW running inside a backward all-to-all counting as overlap as
in Fig. 13; "all communication" adds the dense gradient all-reduce. What differs and why: the
trainer here (and so the simulator) all-reduces the dense gradients after backward, not
overlapped, and neither Lancet pass touches it; with one 100 Gb/s NIC per 8 V100s it is most of
the exposed communication, so the "all communication" cut is far below Fig. 13's while the
all-to-all cut is of the paper's order. Lancet's gains are bounded by the computation available
to hide the all-to-alls behind; with our FLOP-rate compute (90% of peak) that computation is
short on the A100s, which is why the A100 cut is smaller than the V100's, as in the paper.""",
    "combination": """No paper measured Parm's S2 + SAA together with a balancer: Parm's testbed B
(32 GPUs, N_MP = N_ESP = 4, 8 experts, BERT-Base MoE, 4 layers simulated), skewed drifting routing
(`drift:1.2:0.02`). The schedules and balancers compose (docs/design.md §4: every balancer returns
a Placement, every schedule executes one): S2 + SAA removes the baseline's N_MP-fold redundancy,
and the balancers then cut the imbalance S2 leaves (its balance ratio is the baseline's: S2 deals
the same rows). Per-iteration replicas (FasterMoE, Pro-Prophet) adapt every iteration; the
vExpert policies (FlexMoE, EPLB) decide every 2 iterations here and keep their slots between.""",
}
