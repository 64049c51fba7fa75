"""DeepSeek-V3's published fine-grained FP8 weights (convert/hf_fp8.py): a tiny transformers
DeepSeek-V3 whose linear weights are stored as float8_e4m3fn + per-block `weight_scale_inv`
imports to the block-wise dequantized bf16 values (checked against a per-block loop), and its
logits equal transformers' model holding those dequantized weights (fp32, 1e-4)."""
import json

import pytest
import torch

from megatron_moe import load_model
from megatron_moe.convert import offline
from megatron_moe.convert.hf_fp8 import dequantize_fp8
from tests.unit.test_hf_deepseek import CASES, SMALL, TOKENS, _build

BLOCK = (8, 8)


def _quantize(w: torch.Tensor):
    """w [out, in] -> (float8_e4m3fn w, fp32 scale_inv per BLOCK), as DeepSeek's act/weight quant does."""
    rows, cols = w.shape
    nr, nc = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    scale = torch.empty(nr, nc)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            block = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _reference_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rows, cols] = (q[rows, cols].float() * scale[i, j]).to(torch.bfloat16)
    return out


def test_fp8_checkpoint_imports_dequantized(tmp_path, capfd):
    from safetensors.torch import load_file, save_file

    family, hf, _ = CASES["deepseek_noqlora_plain_rope_dense0"]
    model = _build(family, dict(SMALL, **hf), SMALL["num_hidden_layers"])
    model.save_pretrained(tmp_path / "hf")
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) == 1
    tensors, stored, expected = load_file(str(files[0])), {}, {}
    for name, t in tensors.items():  # the linear weights DeepSeek stores in FP8 (not norms, embeddings, head, router)
        if name.endswith("proj.weight") and ".mlp.gate." not in name and t.dim() == 2 and t.shape[1] > 8:
            q, scale = _quantize(t.float())
            stored[name], stored[name + "_scale_inv"] = q, scale
            expected[name] = _reference_dequant(q, scale)
        else:
            stored[name] = t
    assert len(expected) > 10
    import shutil

    shutil.copytree(tmp_path / "hf", tmp_path / "dequantized")  # the reference: the dequantized values, unquantized
    save_file({**tensors, **{k: v.float() for k, v in expected.items()}}, str(tmp_path / "dequantized" / files[0].name),
              metadata={"format": "pt"})
    save_file(stored, str(files[0]), metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))

    offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert capfd.readouterr().err.count("dequantized to bf16") == 1
    reference = type(model).from_pretrained(str(tmp_path / "dequantized"), dtype=torch.float32).eval()
    reference.config._attn_implementation = "eager"
    with torch.no_grad():
        ours = load_model(str(tmp_path / "ours"))
        assert (ours(TOKENS) - reference(TOKENS).logits).abs().max().item() < 1e-4
        assert (reference(TOKENS).logits - model(TOKENS).logits).abs().max().item() > 1e-4  # FP8 moved them
    # the o_proj of layer 0 is its dequantized values exactly
    _, weights = offline.model_weights(str(tmp_path / "ours"))
    assert torch.equal(weights["layers.0.attention.proj.weight"], expected["model.layers.0.self_attn.o_proj.weight"].float())


def test_dequantize_fp8_refuses_a_scale_of_the_wrong_shape():
    q = torch.zeros(10, 20, dtype=torch.float8_e4m3fn)
    assert dequantize_fp8(q, torch.ones(2, 3), BLOCK).shape == (10, 20)
    with pytest.raises(ValueError, match=r"needs a scale_inv of shape \(2, 3\), got \(2, 2\)"):
        dequantize_fp8(q, torch.ones(2, 2), BLOCK)
