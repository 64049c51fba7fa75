"""The shipped configs of the 2026 families (issue #45), each as a user runs it:
`python pretrain_gpt_moe.py --config configs/<family>_tiny.yaml` with its defaults (TensorBoard and
the load heatmap on, evaluation, a checkpoint after the last iteration), only the run's directories
and its length overridden. The run learns (loss below ln V), writes its metrics, TensorBoard and
checkpoint, and DeepSeek-V3's logs its multi-token-prediction loss beside the LM loss; the
checkpoint exports to its Hugging Face family, which transformers loads with our logits."""
import json
import math

import pytest
import torch

from tests.e2e.test_train_cli import launch_ranks

pytestmark = pytest.mark.e2e
FAMILIES = {"deepseek_v3_tiny": ("deepseek_v3", "DeepseekV3ForCausalLM"), "glm45_tiny": ("glm4_moe", "Glm4MoeForCausalLM"),
            "gpt_oss_tiny": ("gpt_oss", "GptOssForCausalLM")}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_config_trains_and_exports(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatron_moe import load_model
    from megatron_moe.convert import offline

    run = tmp_path / "run"
    proc = launch_ranks(1, [f"training.run_dir={run}", f"checkpoint.dir={tmp_path / 'ckpt'}", "training.train_iters=12",
                            "training.eval_interval=12"], config=["--config", f"configs/{name}.yaml"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    assert last["iteration"] == 12 and math.isfinite(last["loss"]) and last["loss"] < first["loss"] < math.log(1024) + 0.5
    assert "eval_loss" in last and math.isfinite(last["eval_loss"])
    assert ("mtp_loss" in last) == (name != "gpt_oss_tiny")  # DeepSeek-V3 and GLM-4.5 shapes carry an MTP module
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").rglob("*")), "no TensorBoard"
    family, architecture = FAMILIES[name]
    offline.export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    hf = getattr(transformers, architecture).from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (load_model(str(tmp_path / "ckpt"))(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
