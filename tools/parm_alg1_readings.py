"""How often Parm's Alg. 1 picks S2 under three readings of its S2 + SAA cost (t_D2).

    python tools/parm_alg1_readings.py [--json] [PROFILE.yaml ...]

Notation as in `techniques/parm/parm_model.py`: y = E T M N_ESP (Alg. 1 line 3, E T = k f B L), x = y / N_MP.
t_D1 is the same in every reading: 2 A2A(x) + AG_MP(B L M) (Eq. 11, Alg. 1 line 4). For S2 with SAA:

* R1 (the code, `techniques/parm/parm_model.py`): t_D2 = A2A(x) + Overlap(x); the MP-AllGather of the E T M
  combined rows is inside the measured Overlap (Eq. 7).
* R2 (Alg. 1 line 5 as printed): t_D2 = A2A(y / N_MP) + alpha_o + beta_o * y; the overlap term is
  charged for y, N_MP times the all-to-all's own input.
* R3 (Eq. 14 as printed): t_D2 = A2A(x) + Overlap(x) + AG_MP(E T M); the all-gather charged on top.

N_MP = 1 is S1 in every reading (no MP group; `choose_schedule`). The grid is Parm's Table III
(N_MP, N_ESP, B, L, M, f) with k in {1, 2}; P only sizes the groups a profile was measured on and
E cancels in E T = k f B L. Prints, per profile and reading, how many of the grid's configurations
pick S2 (in total and per N_MP) as a markdown table (docs/parm.md) or as JSON.
"""
import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Dict, Sequence

from megatron_moe.perf.hardware import HardwareProfile, load_profile
from megatron_moe.techniques.parm.parm_model import capacity_assignments, schedule_times

ROOT = Path(__file__).resolve().parents[1]
TESTBEDS = (ROOT / "configs/hardware/parm_testbed_a.yaml", ROOT / "configs/hardware/parm_testbed_b.yaml")
# Parm Table III, plus top-k
TABLE3_GRID = dict(n_mp=(1, 2, 4), n_esp=(1, 2, 4), batch=(2, 4, 8), seq=(512, 1024, 2048),
                   hidden=(1024, 2048, 4096), f=(1.2, 2.4), k=(1, 2))
READINGS = ("R1", "R2", "R3")


def t_d2_saa(reading: str, profile: HardwareProfile, tokens: int, hidden: int, assignments: float, n_mp: int,
             n_esp: int) -> float:
    """S2 + SAA time (s) under one reading; `tokens` = B L, `hidden` = M, `assignments` = E T."""
    _, r1 = schedule_times(profile, tokens, hidden, assignments, n_mp, n_esp, saa=True)
    if reading == "R1":
        return r1
    if reading == "R2":
        y = assignments * hidden * n_esp
        return profile.ep_esp_alltoall.time(y / n_mp) + profile.saa.time(y)
    if reading == "R3":
        return r1 + profile.mp_allgather.time(assignments * hidden)
    raise ValueError(f"unknown reading {reading!r}; one of {', '.join(READINGS)}")


def pick(reading: str, profile: HardwareProfile, tokens: int, hidden: int, assignments: float, n_mp: int,
         n_esp: int) -> str:
    """Alg. 1 lines 6-9 under one reading of line 5: "s1" or "s2"."""
    if n_mp == 1:
        return "s1"
    t_d1, _ = schedule_times(profile, tokens, hidden, assignments, n_mp, n_esp, saa=True)
    return "s1" if t_d1 <= t_d2_saa(reading, profile, tokens, hidden, assignments, n_mp, n_esp) else "s2"


def count_s2(profile: HardwareProfile, grid: Dict[str, Sequence] = TABLE3_GRID) -> Dict[str, Dict[str, int]]:
    """{reading: {"total": S2 picks over the grid, "n_mp=<d>": S2 picks with that N_MP}}."""
    counts = {r: {"total": 0, **{f"n_mp={d}": 0 for d in grid["n_mp"]}} for r in READINGS}
    for n_mp, n_esp, batch, seq, hidden, f, k in itertools.product(*grid.values()):
        tokens = batch * seq
        assignments = capacity_assignments(tokens, k, f)
        for reading in READINGS:
            if pick(reading, profile, tokens, hidden, assignments, n_mp, n_esp) == "s2":
                counts[reading]["total"] += 1
                counts[reading][f"n_mp={n_mp}"] += 1
    return counts


def grid_size(grid: Dict[str, Sequence] = TABLE3_GRID) -> int:
    return len(list(itertools.product(*grid.values())))


def markdown_table(results: Dict[str, Dict[str, Dict[str, int]]], grid: Dict[str, Sequence] = TABLE3_GRID) -> str:
    """One row per (profile, reading): S2 picks out of the grid, and per N_MP."""
    size, per_mp = grid_size(grid), grid_size(grid) // len(grid["n_mp"])
    header = (f"| profile | reading | S2 picks (of {size}) | "
              + " | ".join(f"N_MP={d} (of {per_mp})" for d in grid["n_mp"]) + " |")
    lines = [header, "|" + "---|" * (3 + len(grid["n_mp"]))]
    for name, counts in results.items():
        for reading in READINGS:
            c = counts[reading]
            lines.append(f"| {name} | {reading} | {c['total']} | "
                         + " | ".join(str(c[f"n_mp={d}"]) for d in grid["n_mp"]) + " |")
    return "\n".join(lines)


def count_s2_per_profile(paths: Sequence = TESTBEDS) -> Dict[str, Dict[str, Dict[str, int]]]:
    """{profile name: count_s2(profile)} for profile YAML files."""
    return {profile.name: count_s2(profile) for profile in (load_profile(str(path)) for path in paths)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="*", default=[str(t) for t in TESTBEDS], help="hardware profile YAML files")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = p.parse_args(argv)
    results = count_s2_per_profile(args.profiles)
    print(json.dumps(results, indent=2) if args.json else markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
