"""bf16 parameters with fp32 main gradients, the way Megatron-LM's `--bf16` runs (docs/precision.md).

* `cast_params_(model, "bf16")`: every trained parameter becomes bf16 in place (Megatron's `Float16Module`;
  the `Parameter` objects, their `ParamMeta` and other attributes stay). Activations follow the
  parameters' dtype. The router's logits / softmax / top-k, the losses, the norms' statistics,
  rotary embeddings and the attention softmax compute in fp32 and return the input's dtype
  (moe/router.py, tensor_parallel/cross_entropy.py, model/norm.py, model/rotary.py, model/attention.py).
* `attach_main_grads(params, flat)`: each parameter gets `p.main_grad`, an fp32 view into a flat,
  contiguous buffer (Megatron-Core's `DistributedDataParallel` grad buffer, `param.main_grad`);
  vExpert stacks (`varying_rows`) get their own, re-allocated when moves change their rows.
  Backward accumulates every micro-batch's gradient there: kernels that can, write their weight
  gradient straight into it (`accumulate_wgrad_`, Megatron's gradient-accumulation fusion: the
  expert grouped GEMM, `moe/grouped_gemm.py`, Lancet's deferred dW, `moe/lancet.py`, replicas' Agg,
  `moe/replicas.py`); every other gradient autograd leaves in `p.grad` (bf16) is added into it by a
  post-accumulate-grad hook, which frees `p.grad`. Gradient sync, clipping and the optimizer read
  `grad_of(p)`: `p.main_grad` when it exists, else `p.grad` (fp32 runs: unchanged).

Where the product kernel can write fp32 from bf16 operands (CUDA: `torch.mm(..., out_dtype=fp32)`),
`accumulate_wgrad_` uses it; the CPU kernels cannot (`aten::mm.dtype` is CUDA-only in torch 2.13,
and `addmm_` refuses mixed dtypes), so there the product is one bf16 GEMM (fp32 accumulation
inside, rounded once) added into the fp32 buffer: the rounding autograd's own bf16 gradient has,
with the sum over micro-batches and replicas in fp32.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import torch

from megatron_moe.perf.host_sync import to_host

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_OUT_DTYPE_MM: Dict[str, bool] = {}  # device type -> does `torch.mm(bf16, bf16, out_dtype=fp32)` run there?


def param_dtype(precision: str) -> torch.dtype:
    return PARAM_DTYPES[precision]


@torch.no_grad()
def cast_params_(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """Trained parameters to `precision`'s dtype in place (buffers keep theirs: rotary tables,
    masks). Frozen ones (`requires_grad` False: the router's expert bias, moe/expert_bias.py) stay
    fp32: no optimizer keeps a master of them, they are updated in place by their own rule, and
    bf16 would swallow updates below its spacing (Megatron-Core keeps its expert bias fp32 too)."""
    dtype = param_dtype(precision)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype and p.requires_grad:
            p.data = p.data.to(dtype)
    return model


def has_main_grad(p: torch.Tensor) -> bool:
    return getattr(p, "main_grad", None) is not None


def grad_of(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient the optimizer sees: fp32 `main_grad` (bf16 runs), else `.grad`."""
    return p.main_grad if has_main_grad(p) else p.grad


def grad_dtype(p: torch.nn.Parameter) -> torch.dtype:
    """The dtype gradients of `p` are summed in: fp32 for bf16 parameters (their main gradients),
    else the parameter's."""
    return torch.float32 if has_main_grad(p) or p.dtype == torch.bfloat16 else p.dtype


def grad_buffer(p: torch.nn.Parameter) -> torch.Tensor:
    """Where gradient contributions of `p` are added: its fp32 `main_grad`, else its `.grad`
    (created as autograd would). Raises once `p`'s gradient bucket is being reduced
    (`optimizer.overlap_grad_reduce`, training/grads.py): a late addition would be lost."""
    if getattr(p, "grad_reduce_started", False):
        raise RuntimeError(f"a gradient of a parameter {tuple(p.shape)} was added after its bucket's reduction started "
                           "(optimizer.overlap_grad_reduce): its writer runs after the parameter's last gradient hook")
    if has_main_grad(p):
        return p.main_grad
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def fold_grad(p: torch.Tensor) -> None:
    """Post-accumulate-grad hook: autograd's bf16 `.grad` into the fp32 main gradient, then freed
    (a no-op without either: later hooks may call it to be sure it ran)."""
    if p.grad is not None and has_main_grad(p):
        p.main_grad.add_(p.grad)
        p.grad = None


def attach_main_grads(params: Sequence[torch.nn.Parameter], flat: torch.Tensor,
                      starts: Optional[Sequence[int]] = None) -> None:
    """Give each parameter `main_grad`, a view of `flat` (fp32) at `starts` (default: packed in
    order), and the hook that folds autograd's `.grad` into it. Idempotent on the hook."""
    offset = 0
    for i, p in enumerate(params):
        start = offset if starts is None else starts[i]
        p.main_grad = flat[start: start + p.numel()].view(p.shape)
        offset = start + p.numel()
        if not getattr(p, "_main_grad_hook", False):
            p.register_post_accumulate_grad_hook(fold_grad)
            p._main_grad_hook = True


class MainGrads:
    """One flat fp32 gradient buffer per device over `params`, attached as their `main_grad`.
    A parameter marked `varying_rows` (a vExpert stack, moe/vexperts.py: its row count follows
    the experts its rank holds) gets a main gradient of its own instead, re-allocated with its
    shape (`resize_main_grad`)."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        by_device: Dict[torch.device, List[torch.nn.Parameter]] = {}
        self.own: List[torch.nn.Parameter] = []
        for p in params:
            if getattr(p, "varying_rows", False):
                self.own.append(p)
            else:
                by_device.setdefault(p.device, []).append(p)
        self.buffers = []
        for device, group in by_device.items():
            flat = torch.zeros(sum(p.numel() for p in group), dtype=torch.float32, device=device)
            attach_main_grads(group, flat)
            self.buffers.append(flat)
        for p in self.own:
            attach_main_grads([p], torch.zeros(p.numel(), dtype=torch.float32, device=p.device))

    def zero_(self) -> None:
        for flat in self.buffers:
            flat.zero_()
        for p in self.own:
            p.main_grad.zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers + [p.main_grad for p in self.own])


def resize_main_grad(p: torch.nn.Parameter) -> None:
    """A `varying_rows` parameter's main gradient, zero, re-allocated to its current shape."""
    assert getattr(p, "varying_rows", False), "only vExpert stacks change shape"
    p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)


def _out_dtype_mm(device: torch.device) -> bool:
    if device.type not in _OUT_DTYPE_MM:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)  # read once, through the counted helper
            ok = bool(to_host(torch.all(torch.mm(a, a, out_dtype=torch.float32) == 2), "mm out_dtype probe"))
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _OUT_DTYPE_MM[device.type] = ok
    return _OUT_DTYPE_MM[device.type]


def accumulate_wgrad_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> None:
    """out [k, n] += alpha a [k, m] @ b [m, n]: fused into `out` when the dtypes agree (addmm_),
    with an fp32-output GEMM where the device has one for lower-precision operands, else the
    product in the operands' dtype added into `out` (module docstring)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b, alpha=alpha)
    elif _out_dtype_mm(a.device):
        out.add_(torch.mm(a, b, out_dtype=out.dtype), alpha=alpha)
    else:
        out.add_(a @ b, alpha=alpha)
