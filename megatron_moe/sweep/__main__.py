"""`python -m megatron_moe.sweep plan | run | status | report ...` (same as tools/sweep.py)."""
import sys

from megatron_moe.sweep.cli import main

sys.exit(main())
