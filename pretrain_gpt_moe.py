#!/usr/bin/env python
"""Pretrain a GPT-MoE model.

    python pretrain_gpt_moe.py --config configs/gpt_moe_tiny.yaml parallel.tensor=2 moe.top_k=1
    python -m torch.distributed.run --standalone --nproc_per_node 4 pretrain_gpt_moe.py \\
        --config configs/gpt_moe_tiny.yaml parallel.expert=2
"""
import sys

from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.training.entry import main

if __name__ == "__main__":
    sys.exit(main(GPTMoEModel, description=__doc__))
