"""megatron_moe: Megatron-style MoE pretraining with Parm, FasterMoE, FlexMoE, Pro-Prophet and Lancet."""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy: `from megatron_moe import load_model` without importing torch.distributed.checkpoint eagerly
    if name == "load_model":
        from megatron_moe.inference import load_model

        return load_model
    raise AttributeError(name)
