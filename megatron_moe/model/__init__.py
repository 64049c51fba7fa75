"""GPT-MoE model: embedding, attention, dense MLP, transformer layer, GPT (MoE layer in `megatron_moe.moe`)."""
