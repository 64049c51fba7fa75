"""`generate`: autoregressive decoding with a per-layer KV cache (issue #46).

    from megatron_moe import generate, load_model
    from megatron_moe.inference import DROPLESS
    model = load_model("checkpoints/run1", overrides=DROPLESS)
    outs = generate(model, [[5, 9, 2], [7, 1]], max_new_tokens=32)                       # greedy
    outs = generate(model, prompts, 32, temperature=0.8, top_k=50, top_p=0.95, seed=0)   # sampled
    outs[0].tokens, outs[0].time_to_first_token_s, outs[0].tokens_per_s

**Batching.** Prompts of different lengths are left-padded to the longest (right-aligned), so every
sequence's next token is at the same cache slot. Each sequence keeps its own positions (0 at its
first real token): learned position rows and rotary angles (rows of the model's `rotary(n)` tables)
are taken at them, and a query sees only its own sequence's real keys (a validity mask over the
slots). A padding slot sees only itself: its row is never all masked, and no real token sees it.

**Cache.** Per attention layer, keys and values `[b, G/tp, max_len, d]` (G the key/value heads: MHA
G = heads, GQA fewer), preallocated for prompt + `max_new_tokens` slots. A step writes its slots and
attends over the slots filled so far: a decoded token costs one one-token forward per sequence plus
attention over the filled slots, so tokens/s stays flat with the position
(tests/unit/test_generation.py). Sliding-window layers (`model.sliding_window`) mask keys more than
W positions back and sinks (`model.attention_sinks`) join the softmax as in training
(model/attention_variants.py); the keys stay cached (the window is a mask, not a ring buffer).

**Sampling**, per step on the last position's full-vocabulary fp32 logits: temperature 0 = greedy
(argmax); else logits / T, top-k (the k largest), top-p (nucleus: the smallest set of tokens whose
probability reaches p; Holtzman et al. 2020 §3.1), one draw from a generator seeded with `seed`.
A sequence stops after its first stop token (kept in its output) or `max_new_tokens`.

**MoE** layers route each step's tokens, dropless: a model built with `moe.capacity_factor` is
refused (load it with `inference.DROPLESS`: the capacity of a one-token step would drop tokens).

**Layouts.** One process (`inference.load_model`) or tp / ep over several processes under torchrun
(`load_model(path, state=...)`): every rank runs the same batch; the prompts and each step's tokens
are broadcast from world rank 0, and the logits are gathered from the vocab-parallel head.
Pipeline-parallel models are refused. Timing: `perf/timing.Stopwatch` (synchronized: one device
read per step, which the stop check needs anyway).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_moe.distributed import collectives
from megatron_moe.model.transformer import link_moe_layers, moe_ffns
from megatron_moe.perf.timing import Stopwatch


class KVCache:
    """Keys / values of every attention layer of a left-padded batch, and the current step's
    positions and masks (module docstring). `layer(i)` is the view layer i's attention uses."""

    def __init__(self, batch: int, max_len: int, device: torch.device):
        self.max_len, self.length, self.step = max_len, 0, 0  # slots allocated / filled / in this step
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # slot holds a real token
        self.slot_positions = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions: Optional[torch.Tensor] = None  # [b, s] of the current step
        self.kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._tables: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # rotary module -> its cos / sin
        self._masks: Dict[Optional[int], torch.Tensor] = {}  # window -> this step's mask
        self._rows: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # rotary module -> this step's rows

    def begin(self, valid: torch.Tensor) -> torch.Tensor:
        """Start a step of `valid.shape[1]` slots (`valid [b, s]`: real tokens); its positions `[b, s]`."""
        s = valid.shape[1]
        if self.length + s > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} slots; {self.length} filled + {s} do not fit")
        ones = valid.long()
        self.positions = self.next_position[:, None] + ones.cumsum(1) - ones  # [b, s]
        self.next_position = self.next_position + ones.sum(1)
        self.valid[:, self.length:self.length + s] = valid
        self.slot_positions[:, self.length:self.length + s] = self.positions
        self.step, self._masks, self._rows = s, {}, {}
        return self.positions

    def end(self) -> None:
        self.length += self.step

    def layer(self, index: int) -> "LayerCache":
        return LayerCache(self, index)

    def allowed(self, window: Optional[int]) -> torch.Tensor:
        """Bool `[b, 1, s, T]` (T = slots filled after this step): query slot i sees key slot j iff
        j <= i and j is real (and, with a window W, within W positions), or j = i."""
        if window not in self._masks:
            start, end = self.length, self.length + self.step
            slots = torch.arange(end, device=self.valid.device)
            queries = slots[start:, None]  # [s, 1]
            keys = self.valid[:, None, :end] & (slots[None, None, :] <= queries[None])  # [b, s, T]
            if window is not None:
                keys = keys & (self.slot_positions[:, None, :end] > self.positions[:, :, None] - window)
            self._masks[window] = (keys | (slots[None, None, :] == queries[None]))[:, None]
        return self._masks[window]

    def rotary_rows(self, rotary) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows of `rotary(max_len)`'s tables at this step's positions, `[b s, d]`."""
        key = id(rotary)
        if key not in self._rows:
            if key not in self._tables:
                self._tables[key] = rotary(self.max_len)
            at = self.positions.reshape(-1)
            self._rows[key] = tuple(t[at] for t in self._tables[key])
        return self._rows[key]


class LayerCache:
    """Layer `index`'s slots of a `KVCache` (`SelfAttention.forward(..., cache=)`)."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def rotary_rows(self, rotary) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.cache.rotary_rows(rotary)

    def update(self, k: torch.Tensor, v: torch.Tensor, window: Optional[int] = None):
        """Write this step's k, v `[b, G/tp, s, d]`; -> (keys, values `[b, G/tp, T, d]`, mask `[b, 1, s, T]`)."""
        c = self.cache
        if self.index not in c.kv:
            c.kv[self.index] = tuple(x.new_zeros(x.shape[0], x.shape[1], c.max_len, x.shape[3]) for x in (k, v))
        keys, values = c.kv[self.index]
        start, end = c.length, c.length + c.step
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end], c.allowed(window)


@dataclass
class Generation:
    """One prompt's result. Times in seconds from the start of the batch's prefill; `tokens_per_s`:
    the decode rate (tokens after the first / time after the first), None with one new token."""

    prompt_tokens: int
    tokens: List[int]  # the new tokens (a stop token included)
    stopped: bool  # ended on a stop token
    time_to_first_token_s: float
    seconds: float  # until its last token
    tokens_per_s: Optional[float]


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens `[b]` from fp32 logits `[b, V]` (module docstring: greedy, temperature, top-k, top-p)."""
    if temperature == 0.0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # the tokens before it already reach p
        logits = logits.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)


def check_request(net, prompts, max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """One-line ValueErrors for what `generate` cannot do."""
    cfg = net.cfg
    if net.state.pp_size > 1:
        raise ValueError("generation runs on tensor / expert parallel layouts; load with parallel.pipeline=1")
    if cfg.moe.capacity_factor is not None:
        raise ValueError(f"generation is dropless: load the model with moe.capacity_factor=null (it has "
                         f"{cfg.moe.capacity_factor}; inference.DROPLESS)")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature} must be >= 0, top_k={top_k} >= 0 (0 = off), "
                         f"top_p={top_p} in (0, 1]")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < cfg.model.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {cfg.model.vocab_size})")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if cfg.model.position_embedding == "learned" and longest > cfg.model.seq_length:
        raise ValueError(f"prompt + max_new_tokens = {longest} tokens exceed model.seq_length={cfg.model.seq_length} "
                         "(learned position embeddings)")


def _step(net, tokens: torch.Tensor, valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """tokens, valid `[b, s]` through the model with `cache` -> the last slot's fp32 logits `[b, vocab]`."""
    positions = cache.begin(valid)
    x = net.embedding(tokens, positions=positions)  # [b, s, h]
    for layer in net.layers:
        x, _ = layer(x, cache=cache.layer(layer.layer_index))
    cache.end()
    return net.gather_logits(net._logits(net.final_norm(x[:, -1:])))[:, -1].float()


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] = (),
             pad_id: int = 0) -> List[Generation]:
    """Continue each prompt (token ids) by up to `max_new_tokens` tokens (module docstring); `model`:
    an `inference.CausalLM` or a GPT model in eval mode. Collective on a multi-process layout."""
    net = getattr(model, "model", model)
    check_request(net, prompts, max_new_tokens, temperature, top_k, top_p)
    device = next(net.parameters()).device
    world = net.state.world
    b, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((b, longest), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(b, longest, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):  # left padding: right-aligned prompts
        tokens[i, longest - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        valid[i, longest - len(p):] = 1
    collectives.broadcast(tokens, 0, world)
    collectives.broadcast(valid, 0, world)
    link_moe_layers(moe_ffns(net.layers))
    generator = torch.Generator(device).manual_seed(seed)
    stops = torch.as_tensor(list(stop_tokens), dtype=torch.long, device=device)
    cache = KVCache(b, longest + max_new_tokens, device)
    watch = Stopwatch(device)
    logits = _step(net, tokens, valid.bool(), cache)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    one_slot = torch.ones(b, 1, dtype=torch.bool, device=device)  # a decode step's valid [b, 1]
    new, times, ends = [], [], [None] * b
    for t in range(max_new_tokens):
        nxt = collectives.broadcast(sample(logits, temperature, top_k, top_p, generator).masked_fill(done, pad_id),
                                    0, world)  # [b]
        new.append(nxt)
        done = done | torch.isin(nxt, stops)
        finished = done.tolist()  # the step's one host read (and the clock's synchronization)
        times.append(watch.seconds())
        for i, f in enumerate(finished):
            if f and ends[i] is None:
                ends[i] = t + 1
        if all(finished) or t == max_new_tokens - 1:
            break
        logits = _step(net, nxt[:, None], one_slot, cache)
    out = torch.stack(new, 1).tolist()  # [b, steps]
    results = []
    for i, p in enumerate(prompts):
        n = ends[i] or len(new)
        rate = (n - 1) / (times[n - 1] - times[0]) if n > 1 and times[n - 1] > times[0] else None
        results.append(Generation(len(p), out[i][:n], ends[i] is not None, times[0], times[n - 1], rate))
    return results
