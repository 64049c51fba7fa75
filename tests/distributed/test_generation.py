"""Generation on several processes (megatron_moe/generation.py, issue #46): a checkpoint (a tiny
random Mixtral imported: GQA, 4 experts top-2) loaded into tensor 2 and into expert 2 generates,
greedy and sampled with a seed, the tokens one process generates, on every rank; the prompts of
different lengths are batched (left-padded). On gloo against one CPU process; on NCCL (`make
test-gpu`, 2 GPUs) against one process on the test's GPU (the sampler's generator lives on the
model's device: CPU and CUDA draw different streams)."""
import pytest
import torch

from megatron_moe.convert import offline
from megatron_moe.generation import generate
from megatron_moe.inference import DROPLESS, load_model
from tests.checkpoint_helpers import random_hf_model
from tests.distributed.harness import BACKENDS, device, require_gpus, run_distributed
from tests.unit.test_hf_families import FAMILIES, SMALL

pytest.importorskip("transformers")
PROMPTS = [[5, 17, 3, 90, 42, 8, 61, 7, 23], [11, 4, 70], [90, 2, 33, 51, 6, 12]]
SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.9, seed=7)


def _generate(state, path):
    model = load_model(path, device=str(device()), overrides=DROPLESS, state=state)
    return ([o.tokens for o in generate(model, PROMPTS, 32)], [o.tokens for o in generate(model, PROMPTS, 16, **SAMPLED)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_and_ep2_generate_as_one_process(tmp_path, backend):
    if backend == "nccl":
        require_gpus(2)  # before the single-GPU reference
    config_cls, model_cls, extra = FAMILIES["mixtral"]
    random_hf_model(config_cls, model_cls, dict(SMALL, **extra), tmp_path / "hf")
    path = offline.import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    one = load_model(path, device="cuda" if backend == "nccl" else "cpu", overrides=DROPLESS)
    want = ([o.tokens for o in generate(one, PROMPTS, 32)], [o.tokens for o in generate(one, PROMPTS, 16, **SAMPLED)])
    for layout in (dict(tensor=2), dict(expert=2)):
        for rank, got in enumerate(run_distributed(2, _generate, layout, (path,), backend=backend)):
            assert got == want, (layout, rank)
