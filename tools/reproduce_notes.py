"""The prose of docs/reproduce.md (tools/reproduce_papers.py): each experiment's table header and
title, and its setup and what differs from the paper and why, from the paper's own text."""

HEADERS = {
    "parm": (["schedule", "N_MP", "N_ESP", "testbed (GPUs)", "paper", "ours", "ours / paper"],
             "Parm Table IV: average speedup over the baseline schedule (DeepSpeed-MoE)"),
    "fastermoe": (["cluster", "optimization", "paper (Fig. 13)", "ours: mean (max) over iterations", "max / paper"],
                  "FasterMoE Fig. 13: speedup of the MoE layers over FastMoE"),
    "flexmoe": (["model", "paper (Fig. 5)", "ours: iterations 51-100 (all 100)", "ours / 1.30",
                 "ours with `policy: printed` (Alg. 2 as printed): 51-100 (all 100)",
                 "balance ratio: FasterMoE / FlexMoE / printed", "exposed token all-to-all ms: FasterMoE / FlexMoE",
                 "exposed ms: FasterMoE's Trans + Agg / FlexMoE's replica gradient sum",
                 "FlexMoE's moves ms: exposed / total"],
                "FlexMoE Fig. 5: FlexMoE's speedup over FasterMoE"),
    "proprophet": (["cluster", "k", "model", "paper: FasterMoE / Pro-Prophet over DeepSpeed-MoE", "ours",
                    "ours / paper", "Pro-Prophet over FasterMoE: paper / ours",
                    "ours: balance ratio DeepSpeed-MoE / FasterMoE / Pro-Prophet", "ours: MoE layers' share"],
                   "Pro-Prophet Tables IV-V: speedup over DeepSpeed-MoE"),
    "lancet": (["cluster", "model", "paper (Fig. 13): non-overlapped communication cut vs RAF",
                "ours: all-to-all cut", "ours: all communication cut", "iteration speedup", "a2a cut / paper"],
               "Lancet Fig. 13: non-overlapped communication, Lancet vs RAF"),
    "combination": (["option", "iteration ms", "MoE layers ms", "balance ratio", "replicas per layer",
                     "exposed ms: vExperts' gradient sum + moves"],
                    "Parm S2 + SAA with each balancer (no paper measured it)"),
}

NOTES = {
    "parm": """34 of 36 trends agree. Setup: Table III's layers as a grid of B in {2, 8}, L in {512,
2048}, M = H in {1024, 2048} (our reading of "H/N_ES and M/N_ES"), f in {1.2, 2.4}, top-2, E = N_EP
experts (one per EP rank, N_EP = P / N_ESP), uniform routing; speedup = baseline / option of the MoE
layer's forward + backward on the slowest rank, averaged over the grid as Table IV averages over its
1296 layers. Profiles: `parm_testbed_a.yaml` / `parm_testbed_b.yaml` (the paper's all-gather fits,
§VI-B; all-to-all and SAA derived as their descriptions say; compute from the GPUs' data sheets).
What differs and why: the paper's speedups come from measured kernels, ours from one alpha-beta
per collective and a FLOP-rate compute model, so the absolute ratios differ by up to the ratio
column; the paper's large measured start-up (0.66 ms per all-gather on testbed A) makes every
extra collective expensive, which is why our `auto` can beat both S1 and S2: its S1 routes the
whole micro-batch on every TP rank and skips S1's two TP collectives of the gate (counts and
aux-loss sums) and the router-gradient all-reduce (docs/parm.md), which the paper's Parm does
not do. Where Alg. 1 picks the slower candidate (testbed B with 8 GPUs, N_MP = 4, N_ESP = 2: it
picks S2, the timeline finds S1 faster), Parm equals that candidate: Alg. 1 reads the flat
profile the paper fitted on the 32-GPU cluster (§VI-B), while the simulator prices the 8-GPU
layout's own links. The two trends that differ are both on testbed A and both about N_ESP, where
the paper's speedups grow: our Parm at N_MP = 2 stays flat (2.61x and 2.59x), and our S2 gains
less at N_ESP = 4 than at 2: with N_ESP = 4 on 8 GPUs there are 2 EP ranks, S2's EP&ESP-AlltoAll sends every row to 4
shard holders (x N_ESP), and on testbed A all of it crosses the same PCIe fabric at the
all-gather's fitted rate (the paper publishes no all-to-all fit for A; its profile takes the
all-gather's), while the measured kernels behind Table IV also got faster per row with smaller
shards, which a FLOP-rate compute model does not see.""",
    "fastermoe": """9 of 9 trends agree. Setup: MoE-GPT on johnny (16 GPUs), MoE-BERT-Wide on trevor (64
GPUs) with their configs in configs/papers/ (bf16, as they train), one expert per GPU, top-2
dropless, skewed drifting routing (`drift:1.4:0.05`: the paper's expert-selection dataset is not
published; §4.1 reports popular experts taking more than half the tokens; Zipf(1.4) gives the
hottest of 16 experts 44% of the assignments); speedup = FastMoE's MoE-layer time (every layer,
forward + backward) over the option's, per iteration; the paper gives "up to" figures, so the
ratio column compares with our maximum. Shadowing is FasterMoE's Alg. 1 on Eq. 7-8 with Eq. 8 as
printed (`moe.fastermoe.eq8: printed`, the default): once anything is shadowed the printed Eq. 8
has no token term, so the first shadow is decided by Eq. 9-10 alone (its tokens' all-to-all
against its weights' broadcast) and the next ones only by compute. On this trace it shadows the
hottest expert of every layer on johnny (1.0 shadowed expert per layer, `shadowed experts per
layer` in the JSON) and 2.7 per layer on trevor. What differs and why: shadowing and "both" gain
more than the paper's maxima (1.3-1.4x them): our trace is more skewed than whatever §5.5
measured, and removing the hottest expert's tokens from the all-to-all removes most of FastMoE's
time, most on trevor, whose 4 GPUs share one 100 Gb/s NIC. The smart schedule alone gains 1.34x
on johnny (the paper: up to 1.40x) and 1.63x on trevor: its gain is bounded by (comm + comp) /
max(comm, comp) (§5.5), and on these derived links communication dominates. With one expert
shadowed per layer the other experts' all-to-all is still large, so the smart schedule's overlap
adds to shadowing on both clusters ("both" above each alone), as in the paper.""",
    "flexmoe": """4 of 4 trends agree, counted on the default policy (`moe.flexmoe.policy: straggler`,
the "ours" columns): FlexMoE is 1.33-1.63x as fast as FasterMoE (1.50x on average) where the
paper measured 1.30x on average, up to 1.45x. The paper's own Alg. 2 (`policy: printed`, the
fifth column, same setup otherwise) is 1.01-1.20x as fast as FasterMoE (1.09x on average; the 4
trends would agree too, BERT-MoE-L's by 1%), and the default 1.25-1.55x as fast as it. The default
is a local search in FlexMoE's spirit, not Alg. 2 (docs/balancers.md lists how it departs): Alg. 2
expands only the expert with the most tokens per vExpert over all GPUs, so once the slowest GPU
holds none of it Alg. 1 stops with free slots left (balance ratio 2.43-4.53 in the sixth column's
third number). Setup: X-MoE-S (32 experts, 32 GPUs) and X-MoE-L (64 experts, 64 GPUs) from
configs/papers/ (4 layers simulated per model), one expert per GPU plus one free vExpert slot;
FlexMoE as its paper runs it: Alg. 1's threshold trigger checked after every step (Eq. 6 >
`moe.flexmoe.threshold` 1.1; `moe.flexmoe.interval` is left at its default and only caps the load
window), Alg. 2's acceptance test with Eq. 5 and Eq. 8-9 costs (a move amortised over
`moe.flexmoe.amortize_steps` 10 iterations, the default: docs/balancers.md has the sweep and the
scale check that chose it) and best-effort moves (`moe.flexmoe.moves: best_effort`, §4: each
layer's round in flight until its next forward); FasterMoE as its paper runs it (printed Eq. 8,
smart schedule). 100 iterations of drifting Zipf(1.0) routing (§2.4's "routing fluctuation"; its
Fig. 3(a) has the top 10 of 64 experts taking almost 75% of the tokens, Zipf(1.0) gives them 62%);
speedup = FasterMoE's iteration time over FlexMoE's over iterations 51-100, all 100 in
parentheses. Exposed times are per iteration on the critical rank, summed over the layers. What
the numbers show: the default policy balances far better than FasterMoE's shadowing (balance
ratio 1.26-1.59 against 3.03-4.94) and cuts the exposed token all-to-all 3-4x, and best-effort
moves hide 35-50% of the rounds' time (last column). FlexMoE ends up with 14-30 vExperts beyond
one per expert per layer (`replicas` in the JSON); the trainer (`moe/vexperts.py`
`sync_replica_grads`, timed by the simulator as it runs) sums each replicated expert's gradient
after backward, not overlapped, among that expert's holders only: a reduce-scatter and an
all-gather of one chunk per holder, point to point, 2 (k - 1) / k of the expert's gradient per
holder (a ring all-reduce's volume among the k holders, which is what the planner prices by Eq.
9), and nothing on the GPUs that do not hold it. Its exposed time is the column before the last
(1.3-17.2 ms). With `amortize_steps` 5 (the default for part of issue 42) the default policy was
1.32-1.60x as fast as FasterMoE (1.51x on average), balanced 1.31-1.83 and made 133-287 transfers
(196-374 now). Until issue 42 a move was amortised over 100 iterations: the default policy then
moved more experts (872-1148 transfers; the moves' total time 8.7-53.7 ms against 1.9-26.7 ms
now), balanced about as well (1.26-1.53) and was 1.20-1.49x as fast as FasterMoE (1.35x on
average). The version of this page before that ran the gradient sum as one all-reduce over the
whole `ep` group of every replicated expert's gradients, zeros on the ranks that do not hold it,
so every GPU paid for all of the layer's replicated experts: 38.8-423.1 ms exposed, and FlexMoE
at 0.49-0.62x of FasterMoE's speed (0 of 4 trends). What differs and why: ours is above the
paper's average and, for three of the four models, above its maximum (at most 1.26x the paper's
average); the paper's own text points at two differences: Fig. 5 compares two code bases
(FlexMoE inside Hetu with its own kernels and expert-wise layout transformation, §4; FasterMoE on
FastMoE), here both run through the same modelled kernels and collectives; and here FasterMoE's
Trans and Agg overlap the layer's other work (its exposed Trans + Agg is the column's first
number), where §5.2 blames "the global synchronization of expert replicas" for FasterMoE's losses
as GPUs increase. With the paper's Alg. 2 ours is below the paper (0.78-0.92x its 1.30x): the
paper's speedups need a policy that keeps expanding hot experts on the slowest GPU.""",
    "proprophet": """3 of 3 trends agree. Setup: Table IV (4 HPNV nodes, 16 GPUs, 16384 tokens per
iteration: sequence 1024, one per GPU) and Table V (2 LPWNV nodes, 8 GPUs, 4096 tokens: sequence
512, one per GPU; the paper does not say how its 4096 tokens were split), experts = GPUs, k in {1,
2}, drifting Zipf(1.2) routing with locality; DeepSpeed-MoE = the baseline schedule without
balancing; FasterMoE as its paper runs it (printed Eq. 8, smart schedule); Pro-Prophet = planner
with each replica computing its own sources' rows (`moe.proprophet.rows: local`, §IV-A, Fig. 6b) and the
block-wise scheduler (`moe.proprophet.overlap`). RB (§VI-C): the balance degree (std of rows per
device) without balancing over the one with it; we report Pro-Prophet's RB over FasterMoE's per
layer. What the numbers show: Pro-Prophet beats DeepSpeed-MoE and FasterMoE in every row, by
1.01-1.38x over FasterMoE (the paper: 1.08-1.50x), and its RB over FasterMoE's is of the paper's
order but smaller (up to 3.8x against 11.01x). FasterMoE shadows nothing in 9 of the 18 rows (its
balance ratio equals DeepSpeed-MoE's in the balance column): the printed Eq. 8 decides the first
shadow by Eq. 9-10 alone, and for these experts on 100 Gb/s InfiniBand shared by the 4 GPUs of a
node their weights' broadcast to every GPU costs more than their tokens' all-to-all; there its
1.02-1.14x over DeepSpeed-MoE is the smart schedule's. Where it shadows, it shadows at most one
expert per layer. Pro-Prophet's lightweight placements send an expert only to the devices that
route to it (1-3 experts per layer), so they pay off on the same links. What differs and why: our speedups
over DeepSpeed-MoE are 0.54-1.11x the paper's: in our model the MoE layers are 19-70% of
DeepSpeed-MoE's iteration (last column), so balancing them gains less of the whole than in the
paper's measurement; the share is lowest on LPWNV with k = 1 (19-26%), where our speedups are
smallest. With local rows
a device with a replica computes exactly its own sources' rows of it, so Pro-Prophet's balance
ratio stays at 1.5-2.6 (`rows: balanced`, ours, water-fills a replica's rows over its
devices and levels a layer to near 1: 1.06 in the last section's table); its balance degree is far
above the one-row floor, which keeps the RB ratio at a few x; the paper's lowest layers go below 1,
ours stay above (1.37x at the lowest).""",
    "lancet": """6 of 6 trends agree. Setup: GPT2-S/L-MoE (configs/papers/) on 4 nodes = 32 GPUs with two
experts per GPU (64 experts), Switch gate (k = 1, capacity 1.0), batch per GPU as §7 (A100: 24 /
48, V100: 16 / 8), mildly skewed routing (zipf:0.5); RAF = no Lancet pass; Lancet = dW scheduling +
the partitioned forward (ρ = 8 parts at most, partition range by the dynamic program).
"Non-overlapped all-to-all": the critical rank's exposed time of the token all-to-alls (dispatch,
combine, and what the pipelines leave exposed), dW running inside a backward all-to-all counting as
overlap as in Fig. 13; "all communication" adds the dense gradient all-reduce. What differs and
why: the trainer here (and so the simulator) all-reduces the dense gradients after backward, not
overlapped, and neither Lancet pass touches it; with one 100 Gb/s NIC per 8 V100s it is most of
the exposed communication, so the "all communication" cut is far below Fig. 13's while the
all-to-all cut is of the paper's order (0.8-0.9x it on V100, 0.4-0.5x on A100). Lancet's gains are
bounded by the computation available to hide the all-to-alls behind; with our FLOP-rate compute
(90% of peak) that computation is short on the A100s, which is why the A100 cut is smaller than the
V100's, as in the paper.""",
    "combination": """No paper measured Parm's S2 + SAA together with a balancer: Parm's testbed B
(32 GPUs, N_MP = N_ESP = 4, 8 experts, BERT-Base MoE, 4 layers simulated), skewed drifting routing
(`drift:1.2:0.02`). The schedules and balancers compose (docs/design.md §4: every balancer returns
a Placement, every schedule executes one): S2 + SAA removes the baseline's N_MP-fold redundancy,
and the balancers then cut the imbalance S2 leaves (its balance ratio is the baseline's: S2 deals
the same rows). Per-iteration replicas (FasterMoE, Pro-Prophet with `moe.proprophet.rows: balanced`,
our levelling) adapt every iteration; FlexMoE
checks its threshold after every step and moves best-effort (as in its section above), EPLB
re-plans every 2 iterations; both keep their slots between. Pro-Prophet is fastest. FlexMoE's
MoE layers are faster than FasterMoE's, and so is its iteration with the vExperts' gradient sum
(among each replicated expert's holders, as in the FlexMoE section) and moves (last column)
added; EPLB, which fills every redundant slot, pays the most for them and is slower than
FasterMoE. Before the gradient sum ran among the holders only (one all-reduce over all of `ep`),
that column was 26.9 ms for FlexMoE and 44.3 ms for EPLB, and FlexMoE's iteration (140.3 ms) was
slower than FasterMoE's.""",
}
