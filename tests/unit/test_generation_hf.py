"""Greedy generation equals transformers' `generate(do_sample=False)` on the export of every
supported Hugging Face family (issue #46): a tiny random model of the family (as
tests/unit/test_hf_families.py, test_hf_gpt_oss.py and test_hf_deepseek.py build them) imported, exported again, and
loaded by transformers from the export; our batched generation (prompts of different lengths,
left-padded, KV cache) from the imported checkpoint gives transformers' tokens for each prompt
alone, 32 new tokens."""
import pytest
import torch

from megatron_moe import generate, load_model
from megatron_moe.convert import offline
from megatron_moe.convert.hf_families import FAMILIES as SUPPORTED
from megatron_moe.inference import DROPLESS
from tests.checkpoint_helpers import random_hf_model
from tests.unit import test_hf_deepseek, test_hf_families, test_hf_gpt_oss

transformers = pytest.importorskip("transformers")
CASES = {family: (config_cls, model_cls, dict(test_hf_families.SMALL, **extra))
         for family, (config_cls, model_cls, extra) in test_hf_families.FAMILIES.items()}
CASES["gpt_oss"] = ("GptOssConfig", "GptOssForCausalLM", test_hf_gpt_oss.TINY)
for family, case in (("deepseek_v3", "deepseek_qlora_interleave_yarn_mtp"), ("glm4_moe", "glm_qknorm_bias_mtp")):
    CASES[family] = (*test_hf_deepseek.CLASSES[family],  # MLA + YaRN; partial rotary + QK-norm + biases
                     dict(test_hf_deepseek.SMALL, **test_hf_deepseek.CASES[case][1], num_nextn_predict_layers=0))
PROMPTS = [[5, 17, 3, 90, 42, 8, 61, 7, 23], [11, 4, 70], [90, 2, 33, 51, 6, 12]]  # 12 > gpt-oss's window 4
NEW = 32


def test_every_supported_family_has_a_case():
    assert set(SUPPORTED) <= set(CASES), f"add a generation case for {sorted(set(SUPPORTED) - set(CASES))}"


@pytest.mark.parametrize("family", sorted(CASES))
def test_greedy_equals_transformers_generate_on_the_export(family, tmp_path):
    torch.set_num_threads(1)
    config_cls, model_cls, config = CASES[family]
    random_hf_model(config_cls, model_cls, config, tmp_path / "hf")
    offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    offline.export_hf(str(tmp_path / "ours"), str(tmp_path / "out"))
    hf = getattr(transformers, model_cls).from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ours = generate(load_model(str(tmp_path / "ours"), overrides=DROPLESS), PROMPTS, NEW)
    for prompt, out in zip(PROMPTS, ours):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None,
                                 pad_token_id=0)
        assert out.tokens == theirs[0, len(prompt):].tolist(), family
