"""Every module that registers a registry entry or a hook (megatron_moe/config/registry.py).

Imported by name, once, before the first registry lookup, config check or hook run
(`registry.load_plugins`): a config is never validated, and a model never built, with a part of
the registrations missing. Add a module here when it registers something.
"""
# registries and entries of the shared floors
import megatron_moe.data.tokenizers  # noqa: F401  (TOKENIZERS, "data.tokenizer.type")
import megatron_moe.model.attention  # noqa: F401  ("model.attention")
import megatron_moe.model.mtp  # noqa: F401  ("model.mtp_depth")
import megatron_moe.model.transformer  # noqa: F401  ("moe.layer_pattern")
import megatron_moe.model.mla  # noqa: F401  (ATTENTIONS: "mla")
import megatron_moe.moe.balancers.base  # noqa: F401  (BALANCERS: "none", "moe.balancer")
import megatron_moe.moe.layer  # noqa: F401  (FFN_LAYERS: "moe")
import megatron_moe.moe.router  # noqa: F401  (GATES: "softmax", "moe.gate", "moe.router")
import megatron_moe.moe.schedules.baseline  # noqa: F401  (SCHEDULES: "baseline", "moe.schedule"; TOKEN_DISPATCH)
import megatron_moe.moe.shared_expert  # noqa: F401  ("moe.shared_expert")
import megatron_moe.training.calibrate  # noqa: F401  (STAGE_HOOKS: "perf.hardware_profile")
import megatron_moe.perf.hardware  # noqa: F401  ("perf.hardware_profile")
# the techniques
import megatron_moe.techniques.eplb.eplb  # noqa: F401  ("eplb", "moe.eplb")
import megatron_moe.techniques.fastermoe.fastermoe  # noqa: F401  ("fastermoe", "moe.fastermoe")
import megatron_moe.techniques.fastermoe.smart  # noqa: F401  (EXCHANGES: "smart", "moe.smart_schedule")
import megatron_moe.techniques.fastermoe.topology_gate  # noqa: F401  (GATES: "topology", "moe.topology_gate")
import megatron_moe.techniques.flexmoe.flexmoe  # noqa: F401  ("flexmoe", "moe.flexmoe")
import megatron_moe.techniques.lancet.lancet  # noqa: F401  (STAGE_HOOKS)
import megatron_moe.techniques.lancet.lancet_partition  # noqa: F401  ("moe.lancet.partitions", STAGE_HOOKS)
import megatron_moe.techniques.node_dedup.node_dedup  # noqa: F401  (TOKEN_DISPATCH: "node_dedup", "moe.node_dedup")
import megatron_moe.techniques.parm.parm  # noqa: F401  ("s1", "s2", "auto", "parm")
import megatron_moe.techniques.proprophet.proprophet  # noqa: F401  ("proprophet", "moe.proprophet")
# training
import megatron_moe.training.checkpoint  # noqa: F401  ("checkpoint")
import megatron_moe.training.distributed_optimizer  # noqa: F401  ("optimizer.distributed")
import megatron_moe.training.lr  # noqa: F401  (LR_SCHEDULES, "optimizer.lr_schedule")
import megatron_moe.training.pipeline_schedules  # noqa: F401  (PIPELINE_SCHEDULES, "parallel.pipeline_schedule")
# evaluation
import megatron_moe.evaluation.during_training  # noqa: F401  ("evaluation", TRAINING_EVALS)
# conversion
import megatron_moe.convert.export_check  # noqa: F401  (EXPORT_CHECKS: "hf", `--check-config --export-family`)
