"""Typed configuration tree: one dataclass per section (DESIGN.md §2).

Every knob a user can set lives here with its default and a one-line comment; `docs/configs.md`
documents them. YAML files and `section.key=value` overrides are merged onto these dataclasses by
`config/load.py` (OmegaConf structured configs), which rejects unknown keys and wrong types;
`config/validate.py` checks the combinations (each section's rules next to its code, §0.2 of docs/design.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class RopeScalingConfig:
    """Rotary frequency scaling (HF `rope_scaling` / `rope_parameters`; model/rotary.py)."""

    type: str = "none"  # none | yarn (YaRN, Peng et al. 2023: DeepSeek-V3, gpt-oss)
    factor: float = 1.0  # context extension factor s
    original_max_position_embeddings: int = 4096  # the pretraining context YaRN extends
    beta_fast: float = 32.0  # YaRN's alpha / beta ramp bounds (rotations per context)
    beta_slow: float = 1.0
    mscale: float = 1.0  # DeepSeek: attention factor 0.1 mscale ln(s) + 1 (cos / sin scaled by mscale / mscale_all_dim)
    mscale_all_dim: float = 0.0  # DeepSeek-V3 MLA: softmax scale x (0.1 mscale_all_dim ln(s) + 1)^2; 0 = off
    truncate: bool = True  # gpt-oss: false keeps the ramp bounds unrounded


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256  # dense FFN width (non-MoE layers)
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # grouped-query attention: key/value heads (divides the heads); null = MHA
    head_dim: Optional[int] = None  # per-head width (Megatron kv_channels); null = hidden_size / num_attention_heads
    qk_norm: str = "none"  # none | head (Qwen3: RMSNorm of each q / k head) | full (OLMoE: RMSNorm of the whole q / k projection)
    qkv_bias: Optional[bool] = None  # biases of the q/k/v projection; null = model.bias (Qwen2-MoE: true, rest false)
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
    binary_head: str = "sop"  # BERT only: sop (sentence order) | nsp (next sentence) | none
    # registry model.attention: standard (MHA / GQA, model/attention.py) | mla (multi-head latent
    # attention, DeepSeek-V2 §2.1 / V3 §2.1.1, model/mla.py: the five keys below)
    attention: str = "standard"
    q_lora_rank: Optional[int] = None  # MLA: query down-projection rank; null = a full-rank query projection
    kv_lora_rank: Optional[int] = None  # MLA: compressed key/value latent width d_c (required with mla)
    qk_nope_head_dim: Optional[int] = None  # MLA: per-head query/key width without rotary (required with mla)
    qk_rope_head_dim: Optional[int] = None  # MLA: per-head decoupled rotary query/key width (required with mla)
    v_head_dim: Optional[int] = None  # MLA: per-head value width (required with mla)
    rotary_percent: float = 1.0  # rotary on the first this fraction of each head's dims (GLM-4.5: 0.5)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    attention_output_bias: Optional[bool] = None  # bias of the attention output projection; null = model.bias
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in each softmax denominator
    sliding_window: Optional[int] = None  # keys within this many positions (query's included); null = full
    # per layer: full_attention | sliding_attention (HF's names); null = sliding everywhere when
    # model.sliding_window is set (gpt-oss: alternating, sliding first)
    layer_types: Optional[List[str]] = None
    mtp_depth: int = 0  # multi-token prediction modules D (DeepSeek-V3 §2.2, model/mtp.py); 0 = off


@dataclass
class FasterMoEConfig:
    min_shadow: int = 0  # shadow at least the k most popular experts every forward, whatever Eq. 7-8 say
    eq8: str = "printed"  # Eq. 8: printed (the paper) | token_term (Eq. 7's token term kept) | fastmoe (FastMoE's release)


@dataclass
class ProProphetConfig:
    alpha: float = 0.5  # Eq. 7: the search stops once max H - min H < alpha x (assignments / experts)
    plan_interval: int = 1  # search every N iterations on the last forward's distribution (locality, §III)
    bottom_k: int = 0  # Alg. 1's n: devices with the fewest rows of a selected expert that do not get it
    overlap: bool = False  # block-wise scheduler (Alg. 2): Plan during the all-to-all, Trans one block early, Eq. 8
    min_replicas: int = 0  # place at least k experts on several devices every forward, whatever Eq. 6 says (tests)
    # a replica's rows: local (each device computes its own sources' rows: the paper's, §IV-A Fig. 6b) |
    # balanced (ours: water-filled over the expert's devices, levelling their loads)
    rows: str = "local"


@dataclass
class FlexMoEConfig:
    slots_per_rank: Optional[int] = None  # vExpert slots per EP rank (>= E/ep); null = E/ep + 1
    interval: int = 10  # trigger=interval: run Alg. 1 every N iterations; trigger=threshold: longest load window
    threshold: float = 1.1  # Alg. 1: Expand / Shrink while the balance ratio (Eq. 6) exceeds this
    trigger: str = "threshold"  # threshold: check Eq. 6 every iteration, plan when it exceeds threshold | interval
    policy: str = "straggler"  # Alg. 2's candidates: straggler (relative to the slowest GPU, general Migrate) | printed
    amortize_steps: Optional[int] = None  # iterations a move's transfer cost is spread over; null = 10 (threshold) / interval
    moves: str = "sync"  # sync: moves land right after the optimizer step | best_effort: in flight until the layer's next forward (§4)


@dataclass
class EPLBConfig:
    redundant_slots: Optional[int] = None  # slots beyond E over the EP group ((E + this) % ep == 0); null = ep (0 on one rank)
    interval: int = 10  # re-plan every N iterations
    ema: float = 0.5  # weight of the newest window's loads in the moving average (1 = newest only)
    # pack experts onto nodes first: auto (only where group-limited routing limits a token's nodes:
    # moe.router_group_topk < min(moe.top_k, nodes of the ep group)) | true | false
    hierarchical: str = "auto"


@dataclass
class LancetConfig:
    defer_wgrad: bool = False  # §4 Alg. 1: dW of every linear runs while backward all-to-alls are in flight
    partitions: int = 1  # §5: micro-batch split into this many batch parts around MoE layers (auto: at most this many); 1 = off
    partition_range: str = "auto"  # §5.1: auto (dynamic program over measured op times) | N sublayers before/after each MoE FFN
    # §5.1's iota, for partition_range=auto: the longest segment (sublayers) the dynamic program
    # considers; null = 2 x moe.layer_freq, one MoE FFN to the next (the paper's: one pipeline per MoE layer)
    max_range: Optional[int] = None


@dataclass
class TopologyGateConfig:
    # W_net / W_local: inter- over intra-node bandwidth per rank; a rank may send L = ratio / M x its
    # assignments to other nodes (M = parallel.ranks_per_node), the rest re-select on their node
    bandwidth_ratio: float = 0.25


@dataclass
class MoEConfig:
    num_experts: int = 4
    top_k: int = 2  # 1 = Switch, 2 = GShard
    capacity_factor: Optional[float] = None  # null = dropless
    layer_freq: int = 1  # every Nth transformer layer's FFN is an MoE layer (layer index % N == N-1)
    first_k_dense: int = 0  # the first k layers are dense whatever layer_freq says (DeepSeek's first_k_dense_replace)
    layer_pattern: Optional[List[int]] = None  # per layer 1 = MoE, 0 = dense (replaces layer_freq / first_k_dense)
    aux_loss_coeff: float = 0.01  # Switch/GShard load-balancing loss
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    expert_ffn_hidden_size: Optional[int] = None  # null = model.ffn_hidden_size
    activation: Optional[str] = None  # experts' activation: null = model.activation | swiglu_oss (gpt-oss's clamped SwiGLU)
    swiglu_limit: float = 7.0  # swiglu_oss: gate clamped to <= limit, up to [-limit, limit]
    router_bias: bool = False  # gpt-oss: a learned bias on the router's logits
    expert_proj_bias: Optional[bool] = None  # biases of the experts' projections; null = model.bias
    score_function: str = "softmax"  # router scores: softmax | sigmoid (DeepSeek-V3)
    norm_topk_prob: Optional[bool] = None  # scale the k chosen scores to sum to 1; null = when top_k > 1
    topk_scaling_factor: float = 1.0  # combine weights x this (DeepSeek-V3's routed_scaling_factor)
    expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for selection only
    expert_bias_rate: float = 1e-3  # bias += rate * sign(mean load - load) after every step
    router_groups: int = 1  # group-limited routing: experts in this many contiguous groups; 1 = off
    router_group_topk: Optional[int] = None  # tokens choose their experts among this many best groups (1..router_groups)
    shared_expert_ffn_hidden_size: Optional[int] = None  # shared experts (dense, every token): their FFN width; null = none
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output x sigmoid(x w_g), w_g [1, h]
    schedule: str = "baseline"  # registry: moe/schedules
    # registry moe.token_dispatch (the baseline's EP-AlltoAll pair): per_copy = one row per (token, expert) |
    # node_dedup = one row per (token, node) over the network, forwarded inside the node (DeepSeek-V3 §3.2.2)
    token_dispatch: str = "per_copy"
    balancer: str = "none"  # registry: moe/balancers
    saa: bool = False  # Parm SAA: overlap S2's second EP&ESP-AlltoAll with its MP-AllGather (s2, auto)
    fastermoe: FasterMoEConfig = field(default_factory=FasterMoEConfig)  # moe.balancer=fastermoe (docs/balancers.md)
    proprophet: ProProphetConfig = field(default_factory=ProProphetConfig)  # moe.balancer=proprophet (docs/balancers.md)
    flexmoe: FlexMoEConfig = field(default_factory=FlexMoEConfig)  # moe.balancer=flexmoe (docs/balancers.md)
    eplb: EPLBConfig = field(default_factory=EPLBConfig)  # moe.balancer=eplb (docs/balancers.md)
    lancet: LancetConfig = field(default_factory=LancetConfig)  # Lancet (docs/lancet.md)
    gate: str = "softmax"  # registry moe.gate: softmax | topology (FasterMoE §4.3: changes routing)
    topology_gate: TopologyGateConfig = field(default_factory=TopologyGateConfig)  # moe.gate=topology
    smart_schedule: bool = False  # FasterMoE §4.2: all-to-all + experts + all-to-all as pipelined pairwise steps
    smart_group_size: int = 1  # EP ranks per fine-grained group of the smart schedule (divides parallel.expert)


@dataclass
class ParallelConfig:
    tensor: int = 1  # tensor (model) parallel degree, N_MP
    expert: int = 1  # expert parallel degree, N_EP
    expert_shard: int = 1  # expert-sharding degree, N_ESP (shards each expert's FFN dim)
    pipeline: int = 1  # pipeline stages (docs/pipeline.md)
    # registry training/pipeline_schedules.py: 1f1b | interleaved (virtual stages); null = interleaved when
    # virtual_stages > 1, else 1f1b (as Megatron infers it from the virtual pipeline size; config/load.py)
    pipeline_schedule: Optional[str] = None
    virtual_stages: int = 1  # model chunks per pipeline stage (> 1: interleaved 1F1B)
    # layers per model chunk in forward order (parallel.pipeline * parallel.virtual_stages entries,
    # each >= 1, summing to model.num_layers); null = an even split
    pipeline_layers: Optional[List[int]] = None
    backend: str = "auto"  # auto (nccl if CUDA else gloo) | gloo | nccl
    # ranks per node (consecutive ranks share a node): null = where the ranks run (their hostnames,
    # gathered at start-up); on several hosts a value must match that; on one machine it simulates nodes
    ranks_per_node: Optional[int] = None
    timeout_s: float = 600.0  # process-group timeout


@dataclass
class TrainingConfig:
    train_iters: int = 100
    # the LR decays until this iteration, then stays at optimizer.min_lr (Megatron's --lr-decay-iters);
    # null = train_iters. Set it to keep a run's schedule when a resume changes train_iters
    lr_decay_iters: Optional[int] = None
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50  # 0 = never
    eval_iters: int = 4
    # evaluate the checkpoint that checkpoint.load names on the valid batches training's eval reads,
    # print the loss and perplexity, append them to <run_dir>/eval.jsonl, and exit (Megatron's --skip-train)
    eval_only: bool = False
    run_dir: str = "runs/default"
    precision: str = "fp32"  # fp32 | bf16 (bf16 weights, fp32 main grads + master weights; docs/precision.md)
    on_nonfinite: str = "skip"  # NaN/Inf loss or grad norm: skip (drop the update, count it) | stop (exit 3)
    recompute: str = "none"  # activation recomputation: none | selective (core attention) | full (every layer)
    compile: bool = False  # torch.compile (TorchInductor) each layer's dense compute (model/compile.py)
    mtp_loss_weight: float = 0.1  # multi-token prediction: lambda / D x the sum of the D depths' losses (DeepSeek-V3 Eq. 25)
    # TEST ONLY: make the loss NaN at this iteration on the last pipeline stage's first rank (0 = never)
    inject_nan_at: int = 0


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
    # ZeRO-1: AdamW state sharded over dp (dense params) / edp (expert params), gradients
    # reduce-scattered, parameters all-gathered (training/distributed_optimizer.py)
    distributed: bool = False
    # reduce each gradient bucket over dp / edp from gradient hooks during the last micro-batch's
    # backward, on a side channel, waited before clipping (Megatron's overlap_grad_reduce; training/grads.py)
    overlap_grad_reduce: bool = False
    grad_bucket_mb: float = 32.0  # gradient buckets (one all-reduce per bucket and group): at most this many MiB


@dataclass
class TokenizerConfig:
    type: Optional[str] = None  # registry (Megatron-LM names): GPT2BPETokenizer | HuggingFaceTokenizer | ...
    vocab_file: Optional[str] = None  # vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)
    merge_file: Optional[str] = None  # merges.txt (GPT2BPETokenizer)
    model: Optional[str] = None  # SentencePiece .model, or tokenizer.json / its directory


@dataclass
class DataConfig:
    # null = embedded corpus (stdlib sources, BPE-tokenized, cached); Megatron-LM's --data-path forms:
    # prefix | [prefix1, prefix2, ...] | [w1, prefix1, w2, prefix2, ...] | "w1 prefix1 w2 prefix2" (data/blend.py)
    path: Any = None
    split: str = "969,30,1"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # required with data.path
    cache_dir: Optional[str] = None  # embedded corpus + indices (null: ~/.cache/megatron_moe; indices by the data)
    embedded_vocab_size: int = 4096  # BPE vocabulary trained for the embedded corpus
    mask_prob: float = 0.15  # BERT: fraction of tokens masked for MLM (80% [MASK], 10% random, 10% kept)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # root: iter_<k>/ directories + `latest` (docs/checkpoints.md); null = <run_dir>/checkpoints
    save_interval: int = 0  # save every N iterations and after the last (0 = never periodically; a stop signal still saves)
    keep_last: int = 2  # complete checkpoints kept (0 = all)
    load: Optional[str] = None  # null | auto (this run's newest complete under dir) | a checkpoint path


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    image_interval: int = 100  # TensorBoard layer x expert load heatmap every N iterations (0 = never)
    routing_trace: bool = False  # record token counts [source, expert] per MoE layer and iteration to <run_dir>/routing/


@dataclass
class EvaluationConfig:
    # lm-evaluation-harness tasks run on the model during training (docs/evaluation.md); [] = never
    lm_eval_tasks: List[str] = field(default_factory=list)
    lm_eval_interval: int = 0  # run them every N iterations (0 = after the last only)
    lm_eval_include_path: Optional[str] = None  # directory of extra task YAMLs (configs/eval_tasks)
    lm_eval_limit: Optional[int] = None  # at most this many samples per task; null = all
    lm_eval_batch_size: int = 8


@dataclass
class PerfConfig:
    # hardware profile YAML (alpha-beta costs, configs/hardware/) for `moe.schedule: auto` and
    # `moe.balancer: fastermoe`; null = calibrate on the ranks at start-up (cached per machine and layout)
    hardware_profile: Optional[str] = None
    calibration_cache: Optional[str] = None  # directory of calibrated profiles (null: <cache dir>/hardware)


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
    perf: PerfConfig = field(default_factory=PerfConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
