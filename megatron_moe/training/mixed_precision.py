"""AdamW with fp32 master weights for bf16 parameters (`training.precision: bf16`, docs/precision.md).

Megatron-LM's `Float16OptimizerWithFloat16Params` (megatron/core/optimizer/optimizer.py): the
optimizer keeps an fp32 master copy of every bf16 parameter, steps the masters with the fp32 main
gradients (`model/precision.py`: `p.main_grad`, flat fp32 buffers that backward accumulates into)
and copies the masters back into the bf16 parameters once per step. The update is torch's AdamW
(`torch.optim.adam.adam(..., decoupled_weight_decay=True)`, the fused kernel where it runs), on
fp32 tensors: the same arithmetic as the fp32 optimizer given the same gradients.

State per parameter `p` (keyed by the bf16 parameter, as a torch optimizer's): "step",
"exp_avg", "exp_avg_sq" (fp32) and "master" (fp32), created at construction. Checkpoints save
"master" as the model's weights (training/checkpoint.py), vExpert moves carry it with the
moments (moe/vexpert_moves.py `state_entries`). `load_state_dict` keeps the state fp32.

The distributed optimizer (training/distributed_optimizer.py) does the same on its shards: the
fp32 master shard is what AdamW steps, next to the sharded moments.

With `training.compile` (`compiled=True`) the step is one TorchInductor graph per parameter group
(`_adamw_into_params`): torch's AdamW arithmetic (the same operations as its single-tensor and
foreach implementations, bias corrections from each parameter's own step count) and the copy of
each master into its bf16 parameter fuse into one pass over each tensor, where the fused kernel
and `_foreach_copy_` read the masters twice. In the compiled bf16 step of docs/performance.md's
Mixtral-shaped benchmark (14.2M parameters), `step()` takes 20.6 ms against 24.6. The learning
rate, the weight-decay factor and the bias corrections enter the graph as tensors (the bias
corrections computed outside it, `_bias_corrections`), so a schedule does not recompile it; a
parameter that changes shape (FlexMoE's vExpert stacks) does (Dynamo then marks the sizes that
changed dynamic).
"""
from __future__ import annotations

import functools
from typing import List

import torch
from torch.optim.adam import adam

from megatron_moe.model.precision import MainGrads, grad_of


class MixedPrecisionAdamW(torch.optim.Optimizer):
    """AdamW over fp32 masters of bf16 parameters, gradients from their fp32 `main_grad` (module docstring)."""

    def __init__(self, param_groups: List[dict], *, lr: float, betas, eps: float, fused: bool = False,
                 compiled: bool = False):
        super().__init__(param_groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.fused, self.compiled = fused, compiled
        params = [p for group in self.param_groups for p in group["params"]]
        self.main_grads = MainGrads(params)
        for p in params:
            self.state[p] = self.fresh_state(p)

    @staticmethod
    def fresh_state(p: torch.Tensor, master: torch.Tensor = None) -> dict:
        master = p.detach().float() if master is None else master
        return {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master), "master": master}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the fp32 main gradients (autograd's `.grad` is folded into them and freed as it lands)."""
        self.main_grads.zero_()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MixedPrecisionAdamW takes no closure"
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            masters = [st["master"] for st in states]
            if self.compiled:
                steps = [st["step"] for st in states]
                torch._foreach_add_(steps, 1.0)
                step_sizes, bias2_sqrts = _bias_corrections(steps, group["lr"], beta1, beta2)
                decay = torch.tensor(1.0 - group["lr"] * group["weight_decay"], device=masters[0].device)
                _compiled_adamw()(masters, [grad_of(p) for p in params], [st["exp_avg"] for st in states],
                                  [st["exp_avg_sq"] for st in states], params, step_sizes, bias2_sqrts, decay,
                                  beta1=beta1, beta2=beta2, eps=group["eps"])
                continue
            adam(
                masters, [grad_of(p) for p in params], [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states], [], [st["step"] for st in states],
                fused=self.fused or None, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            torch._foreach_copy_(params, masters)  # the bf16 weights the next forward uses
        return None

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """After loading masters (checkpoints): the bf16 parameters from them."""
        params = [p for group in self.param_groups for p in group["params"]]
        torch._foreach_copy_(params, [self.state[p]["master"] for p in params])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's format (`state_dict()`), but the state stays fp32: torch's own loader casts
        floating state to the parameter's dtype (bf16)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("MixedPrecisionAdamW.load_state_dict: the number of parameter groups differs")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for index, st in state_dict["state"].items():
            p = params[int(index)]
            master = st.get("master")
            fresh = self.fresh_state(p, None if master is None else master.to(p.device, torch.float32).clone())
            fresh.update({k: v.to(p.device, torch.float32).clone() for k, v in st.items() if k != "master"})
            self.state[p] = fresh


def _bias_corrections(steps, lr: float, beta1: float, beta2: float):
    """([lr / (1 - beta1^t)], [sqrt(1 - beta2^t)]) per parameter, 0-dim tensors, from each one's
    step count t, computed outside the compiled graph: inside it Inductor would evaluate the powers
    once per element."""
    step_sizes = torch._foreach_pow(beta1, steps)
    torch._foreach_mul_(step_sizes, -1.0)
    torch._foreach_add_(step_sizes, 1.0)
    torch._foreach_reciprocal_(step_sizes)
    torch._foreach_mul_(step_sizes, lr)
    bias2_sqrts = torch._foreach_pow(beta2, steps)
    torch._foreach_mul_(bias2_sqrts, -1.0)
    torch._foreach_add_(bias2_sqrts, 1.0)
    torch._foreach_sqrt_(bias2_sqrts)
    return step_sizes, bias2_sqrts


def _adamw_into_params(masters, grads, exp_avgs, exp_avg_sqs, params, step_sizes, bias2_sqrts, decay: torch.Tensor,
                       *, beta1: float, beta2: float, eps: float) -> None:
    """torch's AdamW (decoupled weight decay: `decay` = 1 - lr * weight_decay; `step_sizes`,
    `bias2_sqrts` from `_bias_corrections`) on the fp32 `masters`, then each master into its bf16
    parameter. Compiled (`_compiled_adamw`), one pass per tensor."""
    for master, grad, exp_avg, exp_avg_sq, param, step_size, bias2_sqrt in zip(
            masters, grads, exp_avgs, exp_avg_sqs, params, step_sizes, bias2_sqrts):
        master.mul_(decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        master.sub_(exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps) * step_size)
        param.copy_(master)


@functools.lru_cache(maxsize=None)
def _compiled_adamw():
    """`_adamw_into_params` compiled once per process (a graph per parameter group's shapes)."""
    return torch.compile(torch.no_grad()(_adamw_into_params))
