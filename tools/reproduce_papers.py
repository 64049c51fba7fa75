"""Reproduce the five papers' headline results with the cluster simulator and write docs/reproduce.md.

    python tools/reproduce_papers.py                 # every experiment (a few minutes on 2 cores)
    python tools/reproduce_papers.py --quick         # fewer configurations and iterations (tests)
    python tools/reproduce_papers.py --only parm --out /tmp/reproduce.md

Each experiment runs the papers' models (configs/papers/) on their testbeds' profiles
(configs/hardware/, numbers from the papers, derivations in each profile's description) through
`megatron_moe.sim` and tabulates the paper's figure, ours and their ratio, with the trends and
what differs and why. The last line printed is a JSON object with every number.
"""
import argparse
import json
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np
import torch

from megatron_moe.perf.hardware import load_profile
from megatron_moe.sim.report import summarize
from megatron_moe.sim.runner import simulate

HW = "configs/hardware"
PAPERS = "configs/papers"


def run(config, overrides, hardware, gpus, trace, iterations, seed=0) -> Dict:
    with tempfile.TemporaryDirectory() as tmp:
        return summarize(simulate(config, overrides, load_profile(f"{HW}/{hardware}.yaml"), gpus, trace, iterations,
                                  tmp, seed))


def ratio(ours: float, paper: float) -> str:
    return f"{ours / paper:.2f}"


def table(header: List[str], rows: List[List]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


# -- Parm Table IV --------------------------------------------------------------------------------------
PARM_TABLE_IV = {  # (schedule, N_MP, N_ESP) -> {testbed/GPUs: speedup over the baseline}
    ("S1", 2, 2): {"A8": 2.10, "B8": 2.62, "B16": 2.46, "B32": 2.72},
    ("S1", 2, 4): {"A8": 2.24, "B8": 3.37, "B16": 2.85, "B32": 2.85},
    ("S1", 4, 2): {"A8": 3.72, "B8": 4.18, "B16": 4.12, "B32": 3.92},
    ("S1", 4, 4): {"A8": 4.19, "B8": 5.77, "B16": 5.08, "B32": 4.57},
    ("S2", 2, 2): {"A8": 1.99, "B8": 2.42, "B16": 2.20, "B32": 2.57},
    ("S2", 2, 4): {"A8": 2.41, "B8": 3.05, "B16": 2.44, "B32": 2.75},
    ("S2", 4, 2): {"A8": 3.21, "B8": 3.58, "B16": 3.81, "B32": 4.10},
    ("S2", 4, 4): {"A8": 4.12, "B8": 5.38, "B16": 4.82, "B32": 4.91},
    ("Parm", 2, 2): {"A8": 2.10, "B8": 2.62, "B16": 2.46, "B32": 2.57},
    ("Parm", 2, 4): {"A8": 2.41, "B8": 3.37, "B16": 2.85, "B32": 2.85},
    ("Parm", 4, 2): {"A8": 3.70, "B8": 4.18, "B16": 4.12, "B32": 4.06},
    ("Parm", 4, 4): {"A8": 4.20, "B8": 5.77, "B16": 5.08, "B32": 4.91},
}
PARM_OPTIONS = {"baseline": ["moe.schedule=baseline"], "S1": ["moe.schedule=s1"],
                "S2": ["moe.schedule=s2", "moe.saa=true"], "Parm": ["moe.schedule=auto", "moe.saa=true"]}


def parm_layer(gpus, mp, esp, batch, seq, width, factor) -> List[str]:
    """One of Table III's MoE layers: P GPUs, N_MP, N_ESP, B, L, M = H = `width`, f; E = N_EP experts
    (one per EP rank), top-2."""
    ep = gpus // esp
    return [f"model.hidden_size={width}", f"model.ffn_hidden_size={width}", f"moe.expert_ffn_hidden_size={width}",
            "model.num_layers=1", "model.num_attention_heads=16", f"model.seq_length={seq}", "model.vocab_size=1024",
            f"moe.num_experts={ep}", "moe.top_k=2", f"moe.capacity_factor={factor}",
            f"parallel.tensor={mp}", f"parallel.expert={ep}", f"parallel.expert_shard={esp}",
            f"training.micro_batch_size={batch}", f"training.global_batch_size={batch * gpus // mp}"]


def parm(quick: bool) -> Dict:
    grid = [(b, l, w, f) for b in (2, 8) for l in (512, 2048) for w in (1024, 2048) for f in (1.2, 2.4)]
    if quick:
        grid = grid[:2]
    testbeds = [("A8", "parm_testbed_a", 8), ("B8", "parm_testbed_b", 8), ("B16", "parm_testbed_b", 16),
                ("B32", "parm_testbed_b", 32)]
    if quick:
        testbeds = testbeds[:2]
    ours: Dict = {}
    for tb, hardware, gpus in testbeds:
        for mp in (2, 4):
            for esp in (2, 4):
                speedups = {name: [] for name in PARM_OPTIONS if name != "baseline"}
                for point in grid:
                    layer = parm_layer(gpus, mp, esp, *point)
                    times = {name: sum(run(None, layer + opt, hardware, gpus, "uniform", 2)["moe_layer_ms"])
                             for name, opt in PARM_OPTIONS.items()}
                    for name in speedups:
                        speedups[name].append(times["baseline"] / times[name])
                for name, values in speedups.items():
                    ours[(name, mp, esp, tb)] = float(np.mean(values))
    rows = []
    for (name, mp, esp), paper in PARM_TABLE_IV.items():
        for tb, value in paper.items():
            if (name, mp, esp, tb) in ours:
                rows.append([name, mp, esp, tb, f"{value:.2f}x", f"{ours[(name, mp, esp, tb)]:.2f}x",
                             ratio(ours[(name, mp, esp, tb)], value)])
    return {"rows": rows, "ours": {f"{k[0]} mp{k[1]} esp{k[2]} {k[3]}": v for k, v in ours.items()},
            "grid": grid, "testbeds": [t[0] for t in testbeds]}


def parm_trends(result: Dict) -> List[str]:
    ours = result["ours"]
    notes = []
    for tb in result["testbeds"]:
        for name in ("S1", "S2", "Parm"):
            grows_mp = all(ours[f"{name} mp4 esp{e} {tb}"] > ours[f"{name} mp2 esp{e} {tb}"] for e in (2, 4))
            grows_esp = all(ours[f"{name} mp{m} esp4 {tb}"] > ours[f"{name} mp{m} esp2 {tb}"] for m in (2, 4))
            notes.append(f"{tb} {name}: speedup grows with N_MP: {'yes' if grows_mp else 'no'}; "
                         f"with N_ESP: {'yes' if grows_esp else 'no'}")
        best = all(ours[f"Parm mp{m} esp{e} {tb}"] >= min(ours[f"S1 mp{m} esp{e} {tb}"], ours[f"S2 mp{m} esp{e} {tb}"])
                   - 1e-9 for m in (2, 4) for e in (2, 4))
        notes.append(f"{tb} Parm at least the worse of S1 and S2 everywhere: {'yes' if best else 'no'}")
    return notes


# -- FasterMoE Fig. 13 ------------------------------------------------------------------------------------
FASTERMOE_FIG13 = {"johnny": {"shadowing": 1.95, "smart": 1.40, "both": 2.20},  # §5.5, "up to"
                   "trevor": {"shadowing": 4.74, "both": 5.72}}
FASTERMOE_OPTIONS = {"FastMoE": ["moe.balancer=none", "moe.smart_schedule=false"],
                     "shadowing": ["moe.balancer=fastermoe", "moe.smart_schedule=false"],
                     "smart": ["moe.balancer=none", "moe.smart_schedule=true"],
                     "both": ["moe.balancer=fastermoe", "moe.smart_schedule=true"]}
FASTERMOE_TRACE = "drift:1.4:0.05"  # skewed, drifting: "popular experts can be selected by more than half the input tokens" (§4.1)


def fastermoe(quick: bool) -> Dict:
    """MoE-GPT on johnny (16 GPUs), MoE-BERT-Wide on trevor (64 GPUs); every MoE layer's forward +
    backward time (§5.2), per option over FastMoE (expert parallelism, no balancing)."""
    setups = [("johnny", "fastermoe_moe_gpt", "fastermoe_johnny", 16), ("trevor", "fastermoe_moe_bert_wide",
                                                                       "fastermoe_trevor", 64)]
    iterations = 2 if quick else 8
    out = {}
    for cluster, model, hardware, gpus in setups[:1] if quick else setups:
        base = [f"parallel.expert={gpus}", f"training.global_batch_size={4 * gpus}"] + \
            (["model.num_layers=2"] if quick else [])
        times = {}
        for name, option in FASTERMOE_OPTIONS.items():
            with tempfile.TemporaryDirectory() as tmp:
                results = simulate(f"{PAPERS}/{model}.yaml", base + option, load_profile(f"{HW}/{hardware}.yaml"), gpus,
                                   FASTERMOE_TRACE, iterations, tmp)
            times[name] = np.array([sum(layer.seconds for layer in r.layers) for r in results])
            if name == "shadowing":
                out[f"{cluster} shadowed experts per layer"] = float(np.mean([np.mean([layer.replicas for layer in
                                                                                      r.layers]) for r in results]))
        for name in ("shadowing", "smart", "both"):
            per_iteration = times["FastMoE"] / times[name]
            out[f"{cluster} {name}"] = {"mean": float(per_iteration.mean()), "max": float(per_iteration.max())}
    rows = []
    for cluster, figures in FASTERMOE_FIG13.items():
        for name in ("shadowing", "smart", "both"):
            key = f"{cluster} {name}"
            if key not in out:
                continue
            paper = figures.get(name)
            rows.append([cluster, name, f"up to {paper:.2f}x" if paper else "(not given)",
                         f"{out[key]['mean']:.2f}x (max {out[key]['max']:.2f}x)",
                         ratio(out[key]["max"], paper) if paper else "-"])
    return {"rows": rows, "ours": out}


# -- FlexMoE Fig. 5 -------------------------------------------------------------------------------------------
FLEXMOE_TRACE = "drift:1.0:0.03"  # routing fluctuation: smooth, continuous changes (§2.4)


def flexmoe(quick: bool) -> Dict:
    """X-MoE-S (32 experts) on 32 GPUs and X-MoE-L (64 experts) on 64 GPUs of the Azure A100
    testbed: iteration time of FasterMoE over FlexMoE (both dropless; Fig. 5 is time to a target
    quality, which for two dropless systems is iteration time times the same iteration count)."""
    models = [("GPT-MoE-S", "flexmoe_gpt_moe_s", 32), ("BERT-MoE-S", "flexmoe_bert_moe_s", 32),
              ("GPT-MoE-L", "flexmoe_gpt_moe_l", 64), ("BERT-MoE-L", "flexmoe_bert_moe_l", 64)]
    if quick:
        models = models[:1]
    iterations = 4 if quick else 30
    out = {}
    for name, model, gpus in models:
        base = [f"parallel.expert={gpus}", f"training.global_batch_size={4 * gpus}", "moe.flexmoe.interval=5"] + \
            (["model.num_layers=2"] if quick else ["model.num_layers=4"])
        times = {}
        for balancer in ("fastermoe", "flexmoe"):
            summary = run(f"{PAPERS}/{model}.yaml", base + [f"moe.balancer={balancer}"], "flexmoe_azure_a100", gpus,
                          FLEXMOE_TRACE, iterations)
            times[balancer] = summary["iteration_ms"]["mean"]
            out[f"{name} {balancer} balance ratio"] = float(np.mean(summary["balance_ratio"]))
        out[name] = times["fastermoe"] / times["flexmoe"]
    speedups = [out[name] for name, _, _ in models]
    rows = [[name, "1.30x average, up to 1.45x", f"{out[name]:.2f}x", ratio(out[name], 1.30)] for name, _, _ in models]
    rows.append(["average", "1.30x", f"{np.mean(speedups):.2f}x", ratio(float(np.mean(speedups)), 1.30)])
    return {"rows": rows, "ours": out}


# -- Pro-Prophet Tables IV-V --------------------------------------------------------------------------------
PROPROPHET_TABLES = {  # (cluster, k, model) -> (FasterMoE, Pro-Prophet) speedup over DeepSpeed-MoE
    ("HPNV", 1, "S"): (1.63, 1.98), ("HPNV", 1, "M"): (1.99, 2.22), ("HPNV", 1, "L"): (1.62, 1.80),
    ("HPNV", 1, "DS"): (1.34, 1.70), ("HPNV", 1, "DM"): (1.68, 2.26),
    ("HPNV", 2, "S"): (2.31, 2.62), ("HPNV", 2, "M"): (1.82, 2.10), ("HPNV", 2, "L"): (1.94, 2.23),
    ("HPNV", 2, "DS"): (1.77, 1.94), ("HPNV", 2, "DM"): (1.84, 2.07),
    ("LPWNV", 1, "S"): (1.20, 1.30), ("LPWNV", 1, "M"): (1.02, 1.18), ("LPWNV", 1, "DS"): (1.12, 1.30),
    ("LPWNV", 1, "DM"): (0.96, 1.26),
    ("LPWNV", 2, "S"): (1.56, 1.91), ("LPWNV", 2, "M"): (1.29, 1.94), ("LPWNV", 2, "DS"): (1.44, 1.64),
    ("LPWNV", 2, "DM"): (1.25, 1.58),
}
PROPROPHET_TRACE = "drift:1.2:0.02"  # imbalanced, with locality across iterations (§III, Fig. 4)


def proprophet(quick: bool) -> Dict:
    """Table IV (4 HPNV nodes, 16 GPUs, 16384 tokens per iteration) and Table V (2 LPWNV nodes, 8
    GPUs, 4096 tokens): iteration time of DeepSpeed-MoE (the baseline schedule, no balancing) over
    FasterMoE and over Pro-Prophet (planner + block-wise scheduler); §VI-C's RB: the balance degree
    (std of rows per device) without balancing over the one with it, Pro-Prophet's over FasterMoE's."""
    clusters = {"HPNV": ("proprophet_hpnv", 16, 1024), "LPWNV": ("proprophet_lpwnv", 8, 512)}
    keys = list(PROPROPHET_TABLES)
    if quick:
        keys = keys[:1]
    iterations = 2 if quick else 10
    out, rb = {}, []
    for cluster, k, model in keys:
        hardware, gpus, seq = clusters[cluster]
        base = [f"parallel.expert={gpus}", f"moe.num_experts={gpus}", f"moe.top_k={k}", f"model.seq_length={seq}",
                "training.micro_batch_size=1", f"training.global_batch_size={gpus}"] + \
            (["model.num_layers=2"] if quick else [])
        config = f"{PAPERS}/proprophet_moe_gpt_{model.lower()}.yaml"
        summaries = {name: run(config, base + option, hardware, gpus, PROPROPHET_TRACE, iterations) for name, option in
                     {"DeepSpeed-MoE": ["moe.balancer=none"], "FasterMoE": ["moe.balancer=fastermoe"],
                      "Pro-Prophet": ["moe.balancer=proprophet", "moe.proprophet.overlap=true"]}.items()}
        ds = summaries["DeepSpeed-MoE"]["iteration_ms"]["mean"]
        fm, pp = (ds / summaries[n]["iteration_ms"]["mean"] for n in ("FasterMoE", "Pro-Prophet"))
        out[f"{cluster} k{k} {model}"] = {"FasterMoE": fm, "Pro-Prophet": pp}
        none = np.array(summaries["DeepSpeed-MoE"]["balance_degree"])  # std of rows per device, per layer
        # a degree below one row is a perfect balance of whole rows: floored there, so RB stays finite
        rb_fm = none / np.maximum(summaries["FasterMoE"]["balance_degree"], 1.0)
        rb_pp = none / np.maximum(summaries["Pro-Prophet"]["balance_degree"], 1.0)
        rb += list(rb_pp / rb_fm)
    rows = []
    for (cluster, k, model), (paper_fm, paper_pp) in PROPROPHET_TABLES.items():
        key = f"{cluster} k{k} {model}"
        if key in out:
            ours = out[key]
            rows.append([cluster, k, f"MoE-GPT-{model}", f"{paper_fm:.2f}x / {paper_pp:.2f}x",
                         f"{ours['FasterMoE']:.2f}x / {ours['Pro-Prophet']:.2f}x",
                         f"{ratio(ours['FasterMoE'], paper_fm)} / {ratio(ours['Pro-Prophet'], paper_pp)}",
                         f"{paper_pp / paper_fm:.2f}x / {ours['Pro-Prophet'] / ours['FasterMoE']:.2f}x"])
    return {"rows": rows, "ours": out, "rb_ratio_max": float(max(rb)), "rb_ratio_median": float(np.median(rb))}


# -- Lancet Fig. 13 ---------------------------------------------------------------------------------------------
LANCET_FIG13 = {"A100": 0.69, "V100": 0.83}  # non-overlapped communication cut vs RAF, "up to"
A2A_OPS = ("dispatch", "combine", "smart", "lancet_all_to_all")  # the token all-to-alls in the breakdown


def lancet(quick: bool) -> Dict:
    """GPT2-S/L-MoE on 4 nodes (32 GPUs, two experts per GPU, Switch gate, capacity 1.0): the
    critical rank's exposed communication per iteration without Lancet (RAF) and with both
    passes (dW scheduling, partitioned forward with the dynamic program)."""
    models = [("GPT2-S-MoE", "lancet_gpt2_s_moe", {"A100": 24, "V100": 16}),
              ("GPT2-L-MoE", "lancet_gpt2_l_moe", {"A100": 48, "V100": 8})]
    clusters = {"A100": "lancet_p4de", "V100": "lancet_p3dn"}
    if quick:
        models, clusters = models[:1], {"V100": "lancet_p3dn"}
    out = {}
    for cluster, hardware in clusters.items():
        for name, model, batch in models:
            base = ["parallel.expert=32", "moe.num_experts=64", f"training.micro_batch_size={batch[cluster]}",
                    f"training.global_batch_size={32 * batch[cluster]}"] + (["model.num_layers=2"] if quick else [])
            plain = run(f"{PAPERS}/{model}.yaml", base + ["moe.lancet.defer_wgrad=false", "moe.lancet.partitions=1"],
                        hardware, 32, "zipf:0.5", 2)
            lancet_ = run(f"{PAPERS}/{model}.yaml", base, hardware, 32, "zipf:0.5", 2)
            a2a = [sum(v["exposed"] for op, v in x["breakdown_ms"].items() if op in A2A_OPS) for x in (plain, lancet_)]
            comm = [plain["communication_exposed_ms"], lancet_["communication_exposed_ms"]]
            out[f"{cluster} {name}"] = {"cut_a2a": 1 - a2a[1] / a2a[0], "cut_all": 1 - comm[1] / comm[0],
                                        "a2a_ms": a2a, "all_ms": comm, "overlap_ms": lancet_["overlap_ms"],
                                        "speedup": plain["iteration_ms"]["mean"] / lancet_["iteration_ms"]["mean"]}
    rows = [[key.split()[0], key.split()[1], f"up to {LANCET_FIG13[key.split()[0]] * 100:.0f}%",
             f"{v['cut_a2a'] * 100:.0f}% ({v['a2a_ms'][0]:.0f} -> {v['a2a_ms'][1]:.0f} ms)",
             f"{v['cut_all'] * 100:.0f}% ({v['all_ms'][0]:.0f} -> {v['all_ms'][1]:.0f} ms)", f"{v['speedup']:.2f}x",
             ratio(v["cut_a2a"], LANCET_FIG13[key.split()[0]])] for key, v in out.items()]
    return {"rows": rows, "ours": out}


# -- Parm S2 + SAA with each balancer (no paper measured it) ------------------------------------------------------
def combination(quick: bool) -> Dict:
    """Parm's BERT-Base MoE (testbed B, 32 GPUs, N_MP = N_ESP = 4, 8 experts) under skewed routing:
    S2 + SAA with each balancer, and the baseline schedule, per iteration."""
    base = ["moe.schedule=s2", "moe.saa=true"] + (["model.num_layers=2"] if quick else ["model.num_layers=4"])
    out = {}
    options = {"baseline schedule": ["moe.schedule=baseline", "moe.saa=false"], "S2+SAA": []}
    options.update({f"S2+SAA + {b}": [f"moe.balancer={b}"] for b in ("fastermoe", "proprophet", "flexmoe", "eplb")})
    options["S2+SAA + proprophet (scheduler)"] = ["moe.balancer=proprophet", "moe.proprophet.overlap=true"]
    for name, option in options.items():
        s = run(f"{PAPERS}/parm_bert_base_moe_b.yaml", base + option + ["training.global_batch_size=32",
                                                                          "moe.flexmoe.interval=2", "moe.eplb.interval=2"],
                "parm_testbed_b", 32, "drift:1.2:0.02", 3 if quick else 10)
        out[name] = {"iteration_ms": s["iteration_ms"]["mean"], "moe_ms": sum(s["moe_layer_ms"]),
                     "balance_ratio": float(np.mean(s["balance_ratio"])), "replicas": float(np.mean(s["replicas"]))}
    return {"rows": [[name, f"{v['iteration_ms']:.1f}", f"{v['moe_ms']:.1f}", f"{v['balance_ratio']:.2f}",
                      f"{v['replicas']:.1f}"] for name, v in out.items()], "ours": out}


# -- the document ----------------------------------------------------------------------------------------------
def trends(name: str, r: Dict) -> List:
    """(claim from the paper, does our simulation show it) per experiment."""
    o = r["ours"]
    if name == "parm":
        out = []
        for tb in r["testbeds"]:
            for sched in ("S1", "S2", "Parm"):
                out.append((f"{tb}: {sched}'s speedup grows with N_MP (Table IV)",
                            all(o[f"{sched} mp4 esp{e} {tb}"] > o[f"{sched} mp2 esp{e} {tb}"] for e in (2, 4))))
                out.append((f"{tb}: {sched}'s speedup grows with N_ESP (Table IV, §VI-C)",
                            all(o[f"{sched} mp{m} esp4 {tb}"] > o[f"{sched} mp{m} esp2 {tb}"] for m in (2, 4))))
            out.append((f"{tb}: S1, S2 and Parm beat the baseline everywhere (§VI-C)",
                        all(v > 1 for k, v in o.items() if k.endswith(tb))))
            out.append((f"{tb}: Parm is at least the worse of S1 and S2, within 1% (§VI-C: 8-10.5% above it)",
                        all(o[f"Parm mp{m} esp{e} {tb}"] >= 0.99 * min(o[f"S1 mp{m} esp{e} {tb}"],
                                                                      o[f"S2 mp{m} esp{e} {tb}"])
                            for m in (2, 4) for e in (2, 4))))
            out.append((f"{tb}: Parm beats the worse of S1 and S2 on average (§VI-C: by 8% on A, 10.5% on B)",
                        np.mean([o[f"Parm mp{m} esp{e} {tb}"] / min(o[f"S1 mp{m} esp{e} {tb}"], o[f"S2 mp{m} esp{e} {tb}"])
                                 for m in (2, 4) for e in (2, 4)]) > 1.0))
        return out
    if name == "fastermoe":
        clusters = sorted({k.split()[0] for k in o if isinstance(o[k], dict)})
        out = [(f"{c}: {opt} speeds the MoE layers up", o[f"{c} {opt}"]["mean"] > 1)
               for c in clusters for opt in ("shadowing", "smart", "both")]
        out += [(f"{c}: both together beat each alone", o[f"{c} both"]["mean"] >= max(o[f"{c} shadowing"]["mean"],
                                                                                        o[f"{c} smart"]["mean"]))
                for c in clusters]
        if len(clusters) == 2:
            out.append(("shadowing gains more on trevor (64 GPUs) than on johnny (16)",
                        o["trevor shadowing"]["max"] > o["johnny shadowing"]["max"]))
        return out
    if name == "flexmoe":
        models = [k for k, v in o.items() if isinstance(v, float) and "balance" not in k]
        return [(f"{m}: FlexMoE faster than FasterMoE", o[m] > 1) for m in models]
    if name == "proprophet":
        return [("Pro-Prophet faster than DeepSpeed-MoE in every row", all(v["Pro-Prophet"] > 1 for v in o.values())),
                ("Pro-Prophet faster than FasterMoE in every row",
                 all(v["Pro-Prophet"] > v["FasterMoE"] for v in o.values())),
                ("Pro-Prophet's RB above FasterMoE's on some layer (up to 11.01x, Fig. 16)", r["rb_ratio_max"] > 1)]
    if name == "lancet":
        out = [(f"{k}: Lancet cuts the non-overlapped all-to-all time", v["cut_a2a"] > 0) for k, v in o.items()]
        pairs = [(a, v) for a in o for v in o if a.startswith("A100") and v.startswith("V100") and
                 a.split()[1] == v.split()[1]]
        out += [(f"{v.split()[1]}: the cut is larger on V100 than on A100 (83% vs 69%)", o[v]["cut_a2a"] > o[a]["cut_a2a"])
                for a, v in pairs]
        return out
    return []


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
FasterMoE's Alg. 1 on Eq. 7-8 (`moe.fastermoe.token_term` true, as FastMoE's released policy),
fed the derived profiles; with the strong skew of our trace it shadows the most popular experts
every iteration and the all-to-all of the hot expert's tokens dominates FastMoE's time, so our
gains are larger than the paper's, most on trevor whose 4 GPUs share one 100 Gb/s NIC. The smart
schedule's gain is bounded by (comm + comp) / max(comm, comp) (§5.5); with communication far
above computation on these derived links it stays near 1.2-1.3x, below the paper's 1.40x. Where
shadowing has already removed most of the hot experts' all-to-all (johnny), what is left to
overlap is small and the smart schedule's pairwise steps (16 per direction, each paying a
start-up) cost about what they hide, so "both" lands within a few percent of shadowing alone,
below it on johnny; the paper measured both above each.""",
    "flexmoe": """Setup: X-MoE-S (32 experts, 32 GPUs) and X-MoE-L (64 experts, 64 GPUs) from
configs/papers/ (4 layers simulated per model to bound the planner time), one expert per GPU plus
one free vExpert slot, decisions every 5 iterations (`moe.flexmoe.interval`), drifting Zipf(1.0)
routing (FlexMoE §2.4's "routing fluctuation"); speedup = FasterMoE's iteration time over
FlexMoE's. What differs and why: the decisions are our FlexMoE planner's (`flexmoe_plan.schedule`,
Alg. 1-2 on Eq. 5-9). Alg. 2 expands only e0, the expert with the most tokens per vExpert; once
one Expand has split the hottest expert, the busiest GPU holds the second-hottest expert, a
further Expand of e0 no longer lowers Eq. 5's max over GPUs, Alg. 2 returns no plan and Alg. 1
stops (one or two Expands per decision on these loads: our balance ratio stays near 3-6 where
FasterMoE's shadowing reaches 2-4). FasterMoE meanwhile broadcasts the hot experts to every GPU,
cheap on this testbed's links. The paper's own text explains the gap it measured by FasterMoE's
"global synchronization of expert replicas" as GPUs increase; with our derived 25-37.5 GB/s per
GPU that synchronization is cheap, so our trend disagrees with Fig. 5. A planner that picks the
expert on the busiest GPU (not only e0) would balance further; this is worth fixing in
`flexmoe_plan.make_scheduling_plan`.""",
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
HEADERS = {
    "parm": (["schedule", "N_MP", "N_ESP", "testbed (GPUs)", "paper", "ours", "ours / paper"],
             "Parm Table IV: average speedup over the baseline schedule (DeepSpeed-MoE)"),
    "fastermoe": (["cluster", "optimization", "paper (Fig. 13)", "ours: mean (max) over iterations", "max / paper"],
                  "FasterMoE Fig. 13: speedup of the MoE layers over FastMoE"),
    "flexmoe": (["model", "paper (Fig. 5)", "ours", "ours / 1.30"],
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


def write_doc(results: Dict, path: str, quick: bool, seconds: float) -> None:
    lines = ["# Reproducing the five papers with the cluster simulator", "",
             "Generated by `python tools/reproduce_papers.py` (do not edit by hand"
             + ("; this copy ran with --quick: fewer configurations" if quick else "") + f"; {seconds:.0f} s on this "
             "machine). Each experiment runs the papers' models (`configs/papers/`) on profiles of their testbeds "
             "(`configs/hardware/`: the numbers each paper publishes, the rest derived as each profile's description "
             "says) through the cluster simulator (`megatron_moe/sim/`, docs/simulator.md). Every schedule, "
             "balancer and overlap decision is made by the training code on the trace's counts; only time is "
             "modelled. The papers' routing traces are not published, so the traces are synthetic and named in "
             "each section. Ratios far from 1 are expected where a paper's number is a measurement of kernels and "
             "links we only model; the trends are what the comparison is about.", ""]
    verdicts = []
    for name, result in results.items():
        header, title = HEADERS[name]
        lines += [f"## {title}", "", table(header, result["rows"]), ""]
        if name == "proprophet":
            lines += [f"Pro-Prophet's RB over FasterMoE's, per layer and configuration (balance degrees floored at "
                      f"one row): up to {result['rb_ratio_max']:.2f}x (median {result['rb_ratio_median']:.2f}x); the "
                      "paper: up to 11.01x (Fig. 16), below 1 in some layers.", ""]
        checks = trends(name, result)
        if checks:
            lines += ["Trends (the paper's claim: does ours show it):", ""]
            lines += [f"- {claim}: {'yes' if ok else '**no**'}" for claim, ok in checks]
            lines.append("")
            verdicts.append((name, sum(ok for _, ok in checks), len(checks)))
        lines += [NOTES[name].replace("\n", " "), ""]
    lines += ["## Summary", "", table(["experiment", "trends that agree"], [[n, f"{a} of {t}"] for n, a, t in verdicts]),
              ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


EXPERIMENTS = {"parm": parm, "fastermoe": fastermoe, "flexmoe": flexmoe, "proprophet": proprophet, "lancet": lancet,
               "combination": combination}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer configurations and iterations (tests)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(EXPERIMENTS)}")
    p.add_argument("--out", default="docs/reproduce.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the planners' tensors are small: more threads only contend for the cores
    names = args.only.split(",") if args.only else list(EXPERIMENTS)
    unknown = set(names) - set(EXPERIMENTS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)} (choose from {', '.join(EXPERIMENTS)})")
    results, begin = {}, time.perf_counter()
    for name in names:
        start = time.perf_counter()
        results[name] = EXPERIMENTS[name](args.quick)
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    write_doc(results, args.out, args.quick, time.perf_counter() - begin)
    print(f"wrote {args.out}", flush=True)
    print(json.dumps({name: r["ours"] for name, r in results.items()}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
