"""megatron_moe: Megatron-style MoE pretraining with Parm, FasterMoE, FlexMoE, Pro-Prophet and Lancet."""

__version__ = "0.1.0"
