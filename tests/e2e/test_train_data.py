"""Train from user-preprocessed data: tools/preprocess_data.py (Megatron-LM flags, --workers 2) ->
pretrain_gpt_moe.py with data.path=[prefix], and with a weighted blend of two prefixes."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_moe.data.tokenizer_training import train_bpe

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
TRAIN = ["--config", "configs/gpt_moe_tiny.yaml", "training.train_iters=3", "training.log_interval=1",
         "training.eval_interval=3", "training.eval_iters=1", "model.seq_length=32", "model.vocab_size=320"]


def _preprocess(d, name, texts, tok):
    jsonl = d / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(jsonl), "--json-keys", "text",
           "--output-prefix", str(d / name), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
           tok["vocab_file"], "--merge-file", tok["merge_file"], "--append-eod", "--workers", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return str(d / f"{name}_text_document")


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    prose = [f"Document {i}: the quick brown fox {'jumps ' * (i % 7)}over the lazy dog number {i}." for i in range(200)]
    code = [f"def f{i}(x):\n    return x * {i} + {i % 5}\n" for i in range(200)]
    tok = train_bpe(str(d / "tok"), 300, texts=prose + code)
    flags = [f"data.tokenizer.type=GPT2BPETokenizer", f"data.tokenizer.vocab_file={tok['vocab_file']}",
             f"data.tokenizer.merge_file={tok['merge_file']}"]
    return _preprocess(d, "prose", prose, tok), _preprocess(d, "code", code, tok), flags


def _train(overrides, run_dir):
    proc = subprocess.run([sys.executable, "pretrain_gpt_moe.py"] + TRAIN + overrides + [f"training.run_dir={run_dir}"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_train_from_prefix_and_blend(prefixes, tmp_path):
    prose, code, tok = prefixes
    single = _train(tok + [f"data.path=[{prose}]"], tmp_path / "single")
    assert [r["iteration"] for r in single] == [1, 2, 3]
    assert single[0]["loss"] == pytest.approx(math.log(300), rel=0.05)  # untrained: ~uniform over the 300 tokens
    assert math.isfinite(single[-1]["eval_loss"])
    # a blend whose second weight is 0 reads exactly the first prefix's samples
    degenerate = _train(tok + [f"data.path=[1.0,{prose},0.0,{code}]"], tmp_path / "degenerate")
    assert [r["loss"] for r in degenerate] == pytest.approx([r["loss"] for r in single], rel=1e-6)
    blend = _train(tok + [f"data.path=[0.5,{prose},0.5,{code}]"], tmp_path / "blend")
    assert blend[0]["loss"] != pytest.approx(single[0]["loss"], rel=1e-4)
    assert all(math.isfinite(r["loss"]) for r in blend)
    assert list(Path(prose).parent.glob("blend.*.dataset_index.npy"))  # blend indices cached beside the data


def test_bad_data_path_is_a_one_line_config_error(prefixes, tmp_path):
    _, _, tok = prefixes
    proc = subprocess.run([sys.executable, "pretrain_gpt_moe.py"] + TRAIN + tok + [f"data.path=[{tmp_path}/nope]"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("config error:") and "nope.idx: file not found" in proc.stderr
