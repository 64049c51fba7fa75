"""The five papers' published figures that docs/reproduce.md compares with (tools/reproduce_papers.py).

Each number is copied from the paper (shared/papers/, index in shared/papers/README.md); the
comment on each table names the table, figure or section it comes from.
"""

# Parm (Table IV): average speedup of S1, S2 and Parm over the baseline schedule (DeepSpeed-MoE)
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

# FasterMoE (§5.5, Fig. 13): speedup of the MoE layers over FastMoE
FASTERMOE_FIG13 = {"johnny": {"shadowing": 1.95, "smart": 1.40, "both": 2.20},  # §5.5, "up to"
                   "trevor": {"shadowing": 4.74, "both": 5.72}}

# FlexMoE (§5.2, Fig. 5): training time to the target quality, FasterMoE's over FlexMoE's
FLEXMOE_FIG5 = {"average": 1.30, "max": 1.45}

# Pro-Prophet (Tables IV-V)
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

# Lancet (Fig. 13)
LANCET_FIG13 = {"A100": 0.69, "V100": 0.83}  # non-overlapped communication cut vs RAF, "up to"
