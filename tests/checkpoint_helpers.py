"""Shared pieces of the checkpoint tests: a tiny synthetic dataset (no corpus to build, so spawned
ranks start fast), a Mixtral-shaped tiny config, a hardware profile under which vExperts move, a
tiny random Hugging Face model saved locally, and the tensors of a Hugging Face directory."""
import json

import numpy as np
import yaml

from megatron_moe.config import load_config

MIXTRAL_TINY = "configs/mixtral_tiny.yaml"


class SyntheticTokens:
    """Sample i: seq_length + 1 tokens drawn from seed i; next-token labels, all positions count."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int):
        self.n, self.seq, self.vocab = num_samples, seq_length, vocab_size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = np.random.default_rng(i).integers(0, self.vocab, self.seq + 1, dtype=np.int64)
        return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": np.ones(self.seq, dtype=np.float32)}


def synthetic_datasets(cfg):
    n = max(1, cfg.training.train_iters) * cfg.training.global_batch_size
    return SyntheticTokens(n, cfg.model.seq_length, cfg.model.vocab_size), None


def mixtral_config(tmp, overrides=()):
    return load_config(MIXTRAL_TINY, [f"training.run_dir={tmp}/run", f"checkpoint.dir={tmp}/ckpt",
                                      "logging.tensorboard=false"] + list(overrides))


class SyntheticBertSamples:
    """BERT sample i from seed i: n real tokens (segment A, then B), padding after them, ~15 % of
    the real positions to predict (at least one), a random binary (sentence-order) label."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int):
        self.n, self.seq, self.vocab = num_samples, seq_length, vocab_size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        n = int(rng.integers(self.seq // 2, self.seq + 1))
        real = np.arange(self.seq) < n
        tokens = np.where(real, rng.integers(0, self.vocab, self.seq), 0).astype(np.int64)
        token_types = ((np.arange(self.seq) >= n // 2) & real).astype(np.int64)
        predict = (rng.random(self.seq) < 0.15) & real
        predict[0] = True
        labels = np.where(predict, rng.integers(0, self.vocab, self.seq), 0).astype(np.int64)
        return {"tokens": tokens, "token_types": token_types, "padding_mask": real.astype(np.float32),
                "labels": labels, "loss_mask": predict.astype(np.float32),
                "binary_labels": np.array(rng.integers(0, 2), np.int64)}


def synthetic_bert_datasets(cfg):
    n = max(1, cfg.training.train_iters) * cfg.training.global_batch_size
    return SyntheticBertSamples(n, cfg.model.seq_length, cfg.model.vocab_size), None


def random_hf_model(config_cls: str, model_cls: str, config: dict, path):
    """A `transformers` model of class `model_cls` built from `config_cls(**config)` with seed 0,
    every weight perturbed off its init (norms and biases not at 1 / 0), saved to `path`; eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model


def hf_tensors(path):
    """Every tensor of a Hugging Face directory (`path`: a pathlib.Path): the shards its index
    names, or `model.safetensors`."""
    from safetensors.torch import load_file

    from megatron_moe.convert.hf_common import INDEX

    files = json.loads((path / INDEX).read_text())["weight_map"].values() if (path / INDEX).exists() \
        else ["model.safetensors"]
    out = {}
    for name in sorted(set(files)):
        out.update(load_file(str(path / name)))
    return out


def cheap_moves_profile(tmp_path) -> str:
    """The 2-process CPU profile with point-to-point traffic ~free (written under the pathlib.Path
    `tmp_path`): FlexMoE's cost model then expands, shrinks and migrates often on the tiny model
    (with real costs it rarely moves)."""
    with open("configs/hardware/cpu_gloo_2proc.yaml") as f:
        profile = yaml.safe_load(f)
    profile["p2p"]["alpha"], profile["p2p"]["beta"] = 0.0, 1e-16
    path = tmp_path / "cheap_moves.yaml"
    path.write_text(yaml.safe_dump(profile))
    return str(path)
