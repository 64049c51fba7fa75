"""KV-cache generation (megatron_moe/generation.py, issue #46).

Greedy decoding of a batch of prompts of different lengths (left-padded) equals recomputing each
sequence alone, without the cache, token for token over 32 new tokens: MHA with learned positions
(the demo's GPT-2 shape), GQA with rotary, sliding windows + sinks + partial rotary, and MLA with
YaRN, all with MoE layers. Sampling is reproducible with a seed and stays inside top-k / top-p;
stop tokens end a sequence; bad requests are one-line ValueErrors; the cost per decoded token is
flat (positions 32 and 512 within 1.5x)."""
import statistics

import pytest
import torch

from megatron_moe.config import load_config, validate_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe import generation
from megatron_moe.generation import KVCache, generate, sample
from megatron_moe.model.gpt import GPTMoEModel

ROPE = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu", "model.bias=false"]
CASES = {
    "mha_learned": [],
    "gqa_rope": ROPE + ["model.num_query_groups=2"],
    "window_sinks": ROPE + ["model.num_query_groups=2", "model.sliding_window=4", "model.attention_sinks=true",
                            "model.layer_types=[sliding_attention,full_attention]", "model.rotary_percent=0.5"],
    "mla_yarn": ROPE + ["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
                        "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=16",
                        "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4.0",
                        "model.rope_scaling.original_max_position_embeddings=16",
                        "model.rope_scaling.mscale_all_dim=1.0"],
}
PROMPTS = [[5, 17, 3, 99, 42, 8, 61, 7, 23], [11, 4, 70], [90, 2, 33, 51, 6, 12]]
NEW = 32


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: tiny ops on a loaded 2-core machine run ~30x slower with two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(overrides=(), seq_length=64) -> GPTMoEModel:
    """The demo config scaled down (8 experts top-2 in both layers), every weight perturbed off its
    init so that the logits are not near-ties."""
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["model.vocab_size=128", f"model.seq_length={seq_length}"]
                      + list(overrides))
    validate_config(cfg, 1)
    torch.manual_seed(0)
    model = GPTMoEModel(cfg, ParallelState.single_process()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@torch.no_grad()
def greedy_without_cache(model, prompt, new):
    """Each new token from the whole sequence so far, one sequence at a time, no padding, no cache."""
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(model.gather_logits(model(torch.tensor([seq])).logits)[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_recomputing_without_cache(case):
    model = tiny_model(CASES[case])
    outs = generate(model, PROMPTS, NEW)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_tokens == len(prompt) and not out.stopped
        assert out.tokens == greedy_without_cache(model, prompt, NEW), case
    assert len({tuple(o.tokens) for o in outs}) > 1  # not one fixed point for every prompt


def test_sampling_is_reproducible_and_stays_in_top_k_top_p():
    model = tiny_model(CASES["gqa_rope"])
    kwargs = dict(temperature=1.0, top_k=20, top_p=0.9)
    first = [o.tokens for o in generate(model, PROMPTS, 16, seed=3, **kwargs)]
    assert first == [o.tokens for o in generate(model, PROMPTS, 16, seed=3, **kwargs)]
    assert first != [o.tokens for o in generate(model, PROMPTS, 16, seed=4, **kwargs)]
    greedy = [o.tokens for o in generate(model, PROMPTS, 16)]
    assert [o.tokens for o in generate(model, PROMPTS, 16, temperature=2.0, top_k=1, seed=5)] == greedy
    assert [o.tokens for o in generate(model, PROMPTS, 16, temperature=2.0, top_p=1e-6, seed=5)] == greedy
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    drawn = torch.stack([sample(logits, 1.0, top_k=3, generator=g) for _ in range(300)], 1)  # [4, 300]
    assert all(set(drawn[i].tolist()) == set(logits[i].topk(3).indices.tolist()) for i in range(4))
    probs = logits.softmax(-1)
    for i in range(4):  # top-p: the smallest prefix of the sorted tokens whose probability reaches p
        ordered = probs[i].sort(descending=True)
        keep = int((ordered.values.cumsum(0) < 0.5).sum()) + 1
        drawn = {int(sample(logits[i:i + 1], 1.0, top_p=0.5, generator=g)) for _ in range(300)}
        assert drawn == set(ordered.indices[:keep].tolist())


def test_stop_tokens_and_max_new_tokens():
    model = tiny_model(CASES["gqa_rope"])
    full = generate(model, PROMPTS, NEW)
    stop = full[0].tokens[5]
    first = full[0].tokens.index(stop)  # the stop token may have come earlier
    outs = generate(model, PROMPTS, NEW, stop_tokens=[stop])
    assert outs[0].tokens == full[0].tokens[:first + 1] and outs[0].stopped
    for o, f in zip(outs[1:], full[1:]):  # the others run on until their own stop or the limit
        end = f.tokens.index(stop) + 1 if stop in f.tokens else NEW
        assert o.tokens == f.tokens[:end] and o.stopped == (stop in f.tokens)
    assert all(len(o.tokens) == 3 for o in generate(model, PROMPTS, 3))
    one = generate(model, PROMPTS[:1], 1)[0]
    assert len(one.tokens) == 1 and one.tokens_per_s is None and one.time_to_first_token_s > 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(prompts=[[1], []]), "at least one token"),
    (dict(prompts=[[1, 128]]), "token id 128"),
    (dict(max_new_tokens=60), "exceed model.seq_length=64"),
])
def test_bad_requests_are_one_line_errors(kwargs, message):
    model = tiny_model()
    args = dict(prompts=PROMPTS, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, args.pop("prompts"), **args)


def test_capacity_mode_is_refused():
    model = tiny_model(["moe.capacity_factor=1.0"])
    with pytest.raises(ValueError, match="moe.capacity_factor=null"):
        generate(model, PROMPTS, 4)


def test_cache_mask_sees_own_real_keys_only():
    cache = KVCache(2, 6, torch.device("cpu"))
    pos = cache.begin(torch.tensor([[False, True, True], [True, True, True]]))
    assert pos.tolist() == [[0, 0, 1], [0, 1, 2]]
    mask = cache.allowed(None)[:, 0]  # [b, s, T]
    assert mask[0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    cache.end()
    cache.begin(torch.tensor([[True], [True]]))
    assert cache.positions.tolist() == [[2], [3]]
    assert cache.allowed(2)[:, 0, 0].tolist() == [[False, False, True, True], [False, False, True, True]]


def _rate_ratios(model, pairs: int = 7) -> list:
    """Decode tokens/s after a 32-token prompt over that after a 512-token prompt, for `pairs`
    back-to-back pairs (the order alternated within each): a load spike on a shared machine slows
    both runs of a pair, and the median drops the pairs it hit only one of."""
    ratios = []
    for i in range(pairs):
        rates = {}
        for length in ((32, 512) if i % 2 == 0 else (512, 32)):
            rates[length] = generate(model, [[(7 * j) % 128 for j in range(length)]], 24)[0].tokens_per_s
        ratios.append(rates[32] / rates[512])
    return ratios


def test_cost_per_token_is_flat(monkeypatch):
    """The median of the pairs' ratios is within 1.5x (about 1.05 measured); the same measurement of
    a decoder that recomputes the whole sequence each step (no cache; about 3x) fails it, so the
    check resolves a cost that grows with the position on this machine."""
    model = tiny_model(CASES["gqa_rope"], seq_length=1024)
    ratios = _rate_ratios(model)
    assert statistics.median(ratios) < 1.5, ratios
    step = generation._step

    def recompute(net, tokens, valid, cache):  # the sequence so far through a fresh cache: no reuse
        cache.seq = tokens if cache.length == 0 else torch.cat([cache.seq, tokens], 1)
        cache.real = valid if cache.length == 0 else torch.cat([cache.real, valid], 1)
        cache.length += tokens.shape[1]
        return step(net, cache.seq, cache.real, KVCache(tokens.shape[0], cache.seq.shape[1], tokens.device))
    monkeypatch.setattr(generation, "_step", recompute)
    uncached = _rate_ratios(model, pairs=3)
    assert statistics.median(uncached) > 1.5, uncached
