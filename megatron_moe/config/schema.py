"""Typed configuration tree: one dataclass per section (DESIGN.md §2).

Every knob a user can set lives here with its default and a one-line comment; `docs/configs.md`
documents them. YAML files and `section.key=value` overrides are merged onto these dataclasses by
`config/load.py` (OmegaConf structured configs), which rejects unknown keys and wrong types;
`config/validate.py` checks the combinations.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256  # dense FFN width (non-MoE layers)
    num_attention_heads: int = 4
    seq_length: int = 64
    vocab_size: int = 256  # padded up to a multiple of `parallel.tensor` internally
    dropout: float = 0.0  # attention-probability, residual and embedding dropout
    normalization: str = "layernorm"  # layernorm | rmsnorm
    activation: str = "gelu"  # gelu | swiglu (dense FFN and experts)
    position_embedding: str = "learned"  # learned | rope
    bias: bool = True  # biases in linear layers (and LayerNorm)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = True  # output layer shares the input embedding


@dataclass
class MoEConfig:
    num_experts: int = 4
    top_k: int = 2  # 1 = Switch, 2 = GShard
    capacity_factor: Optional[float] = None  # null = dropless
    layer_freq: int = 1  # every Nth transformer layer's FFN is an MoE layer (layer index % N == N-1)
    aux_loss_coeff: float = 0.01  # Switch/GShard load-balancing loss
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    expert_ffn_hidden_size: Optional[int] = None  # null = model.ffn_hidden_size
    schedule: str = "baseline"  # registry: moe/schedules
    balancer: str = "none"  # registry: moe/balancers


@dataclass
class ParallelConfig:
    tensor: int = 1  # tensor (model) parallel degree, N_MP
    expert: int = 1  # expert parallel degree, N_EP
    expert_shard: int = 1  # expert-sharding degree, N_ESP (shards each expert's FFN dim)
    pipeline: int = 1  # pipeline degree (only 1 is supported for now)
    backend: str = "auto"  # auto (nccl if CUDA else gloo) | gloo | nccl
    timeout_s: float = 600.0  # process-group timeout


@dataclass
class TrainingConfig:
    train_iters: int = 100
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50  # 0 = never
    eval_iters: int = 4
    run_dir: str = "runs/default"
    precision: str = "fp32"  # fp32 | bf16 (autocast, fp32 master weights, fp32 router softmax)


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 10
    weight_decay: float = 0.01
    clip_grad: float = 1.0  # global grad-norm clip; 0 = off
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    lr_schedule: str = "cosine"  # registry: cosine | constant


@dataclass
class DataConfig:
    # null = embedded demo corpus (no files, no downloads)
    path: Optional[List[Any]] = None
    split: str = "969,30,1"
    num_workers: int = 0


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    save_interval: int = 0  # 0 = never
    keep_last: int = 2
    load: Optional[str] = None


@dataclass
class LoggingConfig:
    tensorboard: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
