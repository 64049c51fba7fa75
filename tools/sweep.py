#!/usr/bin/env python
"""Experiment sweeps from a YAML file: plan | run | status | report (docs/sweeps.md).

    python tools/sweep.py plan configs/sweeps/balancers_ep2.yaml
    python tools/sweep.py plan configs/sweeps/paper_scale_sim.yaml --simulate configs/hardware/flexmoe_azure_a100.yaml
    python tools/sweep.py run configs/sweeps/balancers_ep2.yaml
    python tools/sweep.py status runs/sweeps/balancers_ep2
    python tools/sweep.py report runs/sweeps/balancers_ep2 --group-by moe.schedule
"""
import sys

from megatron_moe.sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
