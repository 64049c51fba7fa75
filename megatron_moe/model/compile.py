"""`training.compile`: TorchInductor (`torch.compile`) for each transformer layer's dense compute.

Compiled regions, per layer (`compile_layers`):

* the attention sublayer, `x + dropout(attention(norm_1(x)))`: norm, QKV projection, rotary,
  SDPA, output projection and the residual add fuse around the matmuls;
* the FFN sublayer of a dense layer, `x + dropout(mlp(norm_2(x)))`;
* of an MoE layer only `norm_2`, the experts' activation (`Experts.activation_fn`: SwiGLU's
  silu * up, gpt-oss's clamped SwiGLU or GELU over the grouped rows, a dynamic number of them) and the gate-weighted combine
  (`Schedule.weighted_sum`, `moe/schedules/base.py` `gate_weighted_sum`: the gather of the gate
  weights, the product and the scatter-add into the tokens' rows fuse, forward and backward;
  5.4 -> 2.3 ms per layer at docs/performance.md's bf16 shape). Routing, dispatch and the grouped
  GEMMs stay eager: they read counts on the host and run variable-size collectives.

In bf16 (`training.precision: bf16`) the optimizer step is compiled too: AdamW on the fp32 masters
and their copy into the bf16 weights in one pass (`MixedPrecisionAdamW(compiled=True)`,
training/mixed_precision.py; built by the trainer from `training.compile`; `optimizer.distributed`'s
sharded step stays eager).

What TorchDynamo cannot trace runs eagerly inside a compiled region (a graph break), with
the same result: the tensor-parallel collectives (`collectives.py` keeps its byte counters) and
dropout drawn from the model's own generators (`tensor_parallel/random.py`), so dropout masks
equal the eager run's. Inductor's fused kernels round differently from eager ones, so losses
agree with the plain run to float tolerance, not bitwise (tests/unit/test_compile.py).

Layers of the same shape share their compiled graphs (parameters are graph inputs); a region
recompiles when its input shapes change (evaluation's batch size, a BERT batch's padding).
"""
from __future__ import annotations

import functools

import torch

from megatron_moe.model.mlp import ffn_activation

# recompilations one compiled region may do before it runs eagerly (torch's default is 8): the
# MoE activation sees a new row count every forward until Dynamo marks the row dimension dynamic
_RECOMPILE_LIMIT = 16


def compile_layers(layers) -> None:
    """Replace each TransformerLayer's dense regions by compiled ones, in place (module docstring)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _RECOMPILE_LIMIT)
    for layer in layers:
        layer.attention_sublayer = torch.compile(layer.attention_sublayer)
        if layer.is_moe:
            layer.ffn_norm.compile()  # in place: parameter names (checkpoints) unchanged
            layer.ffn.experts.activation_fn = compiled_dynamic(ffn_activation)
            schedule = layer.ffn.schedule  # its class's combine (an instance attribute once compiled)
            schedule.weighted_sum = compiled_dynamic(type(schedule).weighted_sum)
        else:
            layer.ffn_sublayer = torch.compile(layer.ffn_sublayer)


@functools.lru_cache(maxsize=None)
def compiled_dynamic(fn):
    """`fn` compiled once per process with dynamic sizes (the MoE activation's rows, the combine's
    rows and tokens change every forward), shared by all MoE layers."""
    return torch.compile(fn, dynamic=True)
