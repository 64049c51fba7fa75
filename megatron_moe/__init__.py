"""megatron_moe: Megatron-style MoE pretraining with Parm, FasterMoE, FlexMoE, Pro-Prophet and Lancet."""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy: `from megatron_moe import load_model` without importing torch.distributed.checkpoint eagerly
    if name == "load_model":
        from megatron_moe.inference import load_model

        return load_model
    if name == "generate":  # KV-cache decoding (megatron_moe/generation.py)
        from megatron_moe.generation import generate

        return generate
    if name == "load_checkpoint_tokenizer":  # the tokenizer a checkpoint carries (training/checkpoint_tokenizer.py)
        from megatron_moe.training.checkpoint_tokenizer import load_checkpoint_tokenizer

        return load_checkpoint_tokenizer
    raise AttributeError(name)
