"""Issue #46 items 5-6: lm-eval's `megatron_moe` backend on a checkpoint scores the local tasks of
configs/eval_tasks as lm-eval's `hf` backend scores the checkpoint's export: per-sample
log-likelihoods within 1e-4 (fp32), the same accuracies and the same generations; and
loglikelihood_rolling (several windows) and generate_until agree request by request. No downloads."""
import inspect
import json
import os

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from megatron_moe.convert import offline  # noqa: E402
from megatron_moe.data.tokenizer_training import train_bpe  # noqa: E402
from megatron_moe.data.tokenizers import TokenizerSpec  # noqa: E402
from megatron_moe.evaluation.lm_eval_model import MegatronMoELM  # noqa: E402
from megatron_moe.inference import build_single_process_model  # noqa: E402
from tests.checkpoint_helpers import mixtral_config  # noqa: E402

os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
INCLUDE = "configs/eval_tasks"
TASKS = ["stdlib_mc", "stdlib_gen"]
SEQ = 40  # some contexts + continuations are longer: left truncation is compared too
SHAPE = ["model.vocab_size=384", f"model.seq_length={SEQ}", "model.num_layers=2"]


def _texts():
    rows = []
    for name in ("stdlib_mc", "stdlib_gen"):
        with open(os.path.join(INCLUDE, f"{name}.jsonl")) as f:
            rows += [json.loads(line) for line in f]
    return [r["context"] + "".join(r.get("choices", [r.get("target", "")])) for r in rows]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A random tiny Mixtral-shaped checkpoint carrying a BPE trained on stdlib sources, and its export."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    corpus = [inspect.getsource(m) for m in (json, os, inspect)] + _texts()
    files = train_bpe(str(tmp / "tok"), 320, texts=corpus, special_tokens=("<|endoftext|>",))
    spec = TokenizerSpec("GPT2BPETokenizer", files["vocab_file"], files["merge_file"])
    cfg = mixtral_config(tmp, SHAPE)
    torch.manual_seed(0)
    weights = {n: p.detach().clone() * 4 for n, p in build_single_process_model(cfg).named_parameters()}  # peaked
    offline.write_model_checkpoint(str(tmp / "ckpt"), cfg, weights, tokenizer=spec)
    offline.export_hf(str(tmp / "ckpt"), str(tmp / "hf"))
    return str(tmp / "ckpt"), str(tmp / "hf"), corpus


def _evaluate(model, model_args, batch_size):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=batch_size,
                                   device="cpu", log_samples=True, bootstrap_iters=0,
                                   task_manager=TaskManager(include_path=INCLUDE, include_defaults=False))


def _by_doc(samples):
    return {s["doc_id"]: s for s in samples}


def test_backend_agrees_with_hf_on_the_export(built):
    torch.set_num_threads(1)
    ckpt, hf_dir, _ = built
    ours = _evaluate("megatron_moe", f"checkpoint={ckpt}", 4)
    theirs = _evaluate("hf", f"pretrained={hf_dir},dtype=float32", 4)
    one_by_one = _evaluate("megatron_moe", f"checkpoint={ckpt}", 1)  # padding in a batch changes nothing
    for run in (theirs, one_by_one):
        mc_ours, mc_theirs = _by_doc(ours["samples"]["stdlib_mc"]), _by_doc(run["samples"]["stdlib_mc"])
        assert sorted(mc_ours) == sorted(mc_theirs) == list(range(20))
        for doc_id, sample in mc_ours.items():
            mine = [r[0] for r in sample["resps"]]  # [(loglikelihood, is_greedy)] per choice
            other = [r[0] for r in mc_theirs[doc_id]["resps"]]
            assert [g for _, g in mine] == [g for _, g in other], doc_id
            assert max(abs(float(a) - float(b)) for (a, _), (b, _) in zip(mine, other)) < 1e-4, doc_id
        gen_ours, gen_theirs = _by_doc(ours["samples"]["stdlib_gen"]), _by_doc(run["samples"]["stdlib_gen"])
        assert {d: s["resps"] for d, s in gen_ours.items()} == {d: s["resps"] for d, s in gen_theirs.items()}
        for task in TASKS:
            a, b = ours["results"][task], run["results"][task]
            assert {k: v for k, v in a.items() if "stderr" not in k} == {k: v for k, v in b.items() if "stderr" not in k}
    assert any(s["resps"][0][0].strip() for s in gen_ours.values())  # something was generated


def test_rolling_and_generation_agree_request_by_request(built):
    from lm_eval.models.huggingface import HFLM

    torch.set_num_threads(1)
    ckpt, hf_dir, corpus = built
    ours = MegatronMoELM(checkpoint=ckpt, batch_size=3)
    theirs = HFLM(pretrained=hf_dir, dtype="float32", device="cpu", batch_size=3)
    assert ours.max_length == theirs.max_length == SEQ and ours.prefix_token_id == theirs.prefix_token_id
    texts = [corpus[0][:400], "x", corpus[-1], corpus[1][1000:1300]]  # several windows, one token, ...
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    a, b = ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling)
    assert len(ours.tok_encode(texts[0])) > 3 * SEQ
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)
    prompts = [("def main(", {"until": ["\n"], "max_gen_toks": 6}), (corpus[2][:300], {"until": [")"], "max_gen_toks": 9}),
               ("import ", {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False})]
    generate = [Instance("generate_until", {}, p, i) for i, p in enumerate(prompts)]
    assert ours.generate_until(generate) == theirs.generate_until(generate)
    empty = [Instance("loglikelihood", {}, ("", "import os"), 0), Instance("loglikelihood", {}, ("x = ", "1"), 1)]
    assert max(abs(x[0] - y[0]) for x, y in zip(ours.loglikelihood(empty), theirs.loglikelihood(empty))) < 1e-4
