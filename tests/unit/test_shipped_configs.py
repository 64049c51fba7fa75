"""Every shipped config loads and validates on a world size that fits its parallel degrees."""
import glob

import pytest

from megatron_moe.config import load_config, validate_config

CONFIGS = sorted(glob.glob("configs/*.yaml") + glob.glob("configs/papers/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS)
def test_config_validates(path):
    cfg = load_config(path)
    p = cfg.parallel
    world = p.pipeline * max(p.tensor, p.expert * p.expert_shard)
    validate_config(cfg, world)


def test_paper_models_have_the_published_shapes():
    cases = {  # file: (layers, hidden, ffn, experts)
        "proprophet_moe_gpt_s": (12, 512, 1024, 16), "proprophet_moe_gpt_m": (12, 1024, 2048, 16),
        "proprophet_moe_gpt_l": (12, 2048, 4096, 16), "proprophet_moe_gpt_ds": (24, 512, 1024, 16),
        "proprophet_moe_gpt_dm": (24, 1024, 2048, 16), "flexmoe_gpt_moe_s": (12, 768, 3072, 32),
        "flexmoe_gpt_moe_l": (24, 2048, 8192, 64), "fastermoe_moe_gpt_s": (12, 1024, 2048, 16),
        "fastermoe_moe_gpt": (12, 2048, 4096, 16), "fastermoe_moe_gpt_l": (12, 4096, 8192, 16),
        "flexmoe_bert_moe_s": (12, 768, 3072, 32), "flexmoe_bert_moe_l": (24, 1024, 4096, 64),
        "fastermoe_moe_bert_deep": (24, 1024, 2048, 16), "fastermoe_moe_bert_wide": (12, 1024, 2048, 64),
        "parm_bert_base_moe_a": (12, 768, 3072, 2), "parm_bert_base_moe_b": (12, 768, 3072, 8),
        "lancet_gpt2_s_moe": (12, 768, 3072, 32), "lancet_gpt2_l_moe": (24, 1024, 4096, 32),
    }
    for name, (layers, hidden, ffn, experts) in cases.items():
        cfg = load_config(f"configs/papers/{name}.yaml")
        assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.moe.expert_ffn_hidden_size,
                cfg.moe.num_experts) == (layers, hidden, ffn, experts), name
