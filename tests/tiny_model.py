"""One process, a tiny GPT- or BERT-MoE with dropout 0.1 and capacity drops: the steps that the
exactness tests of Lancet's partitioned forward and of activation recomputation compare."""
from dataclasses import dataclass
from typing import Dict, List

import torch

from megatron_moe.config import load_config, validate_config
from megatron_moe.distributed.parallel_state import ParallelState

BASE = ["model.seq_length=12", "model.vocab_size=300", "training.micro_batch_size=4", "model.dropout=0.1",
        "moe.capacity_factor=1.0", "moe.num_experts=4"]


@dataclass
class Step:
    loss: float
    aux: float
    grads: Dict[str, torch.Tensor]
    dropped: List[int]  # per MoE layer
    tokens_per_expert: List[torch.Tensor]  # per MoE layer
    saved_bytes: int  # activations autograd kept for backward (outside recomputed regions; parameters not counted)


def tiny_model_steps(overrides, bert: bool = False, steps: int = 1) -> List[Step]:
    """`steps` forward + backward steps of one model built from the seed, on the same tokens (a
    second step checks that the dropout generators go on as in the plain run). With
    `training.precision=bf16` the parameters are bf16 and the gradients their fp32 main grads."""
    from megatron_moe.model.bert import BertMoEModel
    from megatron_moe.model.gpt import GPTMoEModel
    from megatron_moe.model.precision import MainGrads, cast_params_, grad_of

    cfg = load_config("configs/bert_moe_tiny.yaml" if bert else "configs/gpt_moe_tiny.yaml", BASE + list(overrides))
    validate_config(cfg, 1)
    model = (BertMoEModel if bert else GPTMoEModel)(cfg, ParallelState.single_process())
    cast_params_(model, cfg.training.precision)
    main_grads = MainGrads(model.parameters()) if cfg.training.precision != "fp32" else None
    tokens = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(4, 12)
    pad[1, 8:] = 0
    pad[3, 5:] = 0
    results = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if main_grads is not None:
            main_grads.zero_()
        saved = [0]

        def pack(t):  # activations only: a saved parameter costs no memory of its own
            if not isinstance(t, torch.nn.Parameter):
                saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if bert:
                out = model(tokens, torch.zeros_like(tokens), pad, tokens, pad, torch.tensor([0, 1, 1, 0]))
                loss = out.lm_loss + out.binary_loss + out.aux_loss
            else:
                out = model(tokens, tokens)
                loss = out.lm_loss + out.aux_loss
        loss.backward()
        results.append(Step(float(out.lm_loss.detach()), float(out.aux_loss.detach()),
                            {n: grad_of(p).clone() for n, p in model.named_parameters()},
                            [s.dropped for s in out.moe_stats], [s.tokens_per_expert for s in out.moe_stats],
                            saved[0]))
    return results


def assert_same_steps(got: List[Step], want: List[Step], label: str) -> None:
    """Losses (rel 1e-6), drops, counts and every gradient (rtol 1e-5) equal."""
    import pytest

    for i, (a, b) in enumerate(zip(got, want)):
        where = f"{label} step {i}"
        assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.aux == pytest.approx(b.aux, rel=1e-6), where
        assert a.dropped == b.dropped, where
        assert all(torch.equal(x, y) for x, y in zip(a.tokens_per_expert, b.tokens_per_expert)), where
        for name, grad in b.grads.items():
            torch.testing.assert_close(a.grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{where} {name}: {m}")
