#!/usr/bin/env python
"""Pretrain a BERT-MoE model (masked LM + sentence-order or next-sentence head).

    python pretrain_bert_moe.py --config configs/bert_moe_tiny.yaml parallel.tensor=2
    python -m torch.distributed.run --standalone --nproc_per_node 4 pretrain_bert_moe.py \\
        --config configs/bert_moe_tiny.yaml parallel.expert=2
"""
import sys

from megatron_moe.data.bert_dataset import build_bert_datasets_from_config
from megatron_moe.model.bert import BertMoEModel
from megatron_moe.training.entry import main

if __name__ == "__main__":
    sys.exit(main(BertMoEModel, description=__doc__, datasets=build_bert_datasets_from_config))
