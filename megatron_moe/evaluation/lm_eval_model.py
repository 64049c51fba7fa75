"""The lm-evaluation-harness backend `megatron_moe` (issue #46 items 5-6, docs/evaluation.md).

    python tools/evaluate.py --model_args checkpoint=runs/demo/checkpoints --tasks stdlib_mc \\
        --include_path configs/eval_tasks --batch_size 8
    torchrun --nproc_per_node 2 tools/evaluate.py --model_args checkpoint=DIR,tensor=2 --tasks ...   (tp / ep)

Importing this module registers `MegatronMoELM` with lm-eval as `megatron_moe` (it needs lm-eval:
`pip install -e '.[eval]'`). `model_args`: `checkpoint` (a root or one iter_* directory, loaded
dropless by `inference.load_model`), `tensor` / `expert` (the layout under torchrun: every rank runs
every request, lm-eval sees one process and rank 0 writes), `max_length` (default model.seq_length),
`max_gen_toks` (default 256, a task's own setting wins), `seed` (sampled generation); lm-eval's
`--batch_size` (a number) and `--device` (`cpu`, else the launcher's device). The tokenizer is the
one the checkpoint carries (training/checkpoint_tokenizer.py).

Requests are scored as lm-eval's `hf` backend scores them (lm_eval/models/huggingface.py), so the
numbers agree with `--model hf` on the checkpoint's export (tests/unit/test_lm_eval_backend.py):
* `loglikelihood`: context and continuation encoded whole-then-split (`TemplateLM._encode_pair`: the
  context's trailing spaces move to the continuation); an empty context is the prefix token (the
  export's bos where the tokenizer has one, else eod); context + continuation truncated to the last
  `max_length + 1` tokens; batches of `batch_size`, longest first, right-padded; fp32 log-softmax.
* `loglikelihood_rolling`: disjoint windows of `max_length` tokens, each predicted from the prefix
  token or the previous window's last token (`lm_eval.utils.get_rolling_token_windows`, context 1).
* `generate_until`: contexts left-truncated to `max_length - max_gen_toks` tokens, decoded by
  `generation.generate` (KV cache; greedy unless the task samples), stopping at eod (and at a stop
  string that is one token); the text is cut at the first stop string.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from megatron_moe.generation import generate

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend's default
LOADED: List["MegatronMoELM"] = []  # backends that loaded a checkpoint (tools/evaluate.py closes them)


def prefix_token(spec, tok) -> int:
    """The token an empty context stands for: the export's bos where the tokenizer has one (as the hf
    backend reads it from the export, convert/hf_tokenizer.py), else the end-of-document token."""
    from megatron_moe.convert.hf_tokenizer import extra_specials, hf_backend

    bos = extra_specials(spec, tok).get("bos_token") if spec is not None else None
    return tok.eod if bos is None else hf_backend(tok).token_to_id(bos)


def _batch_size(value) -> int:
    if isinstance(value, str) and not value.strip().isdigit():
        raise ValueError(f"megatron_moe: --batch_size {value!r}: give a number (no 'auto')")
    if int(value) < 1:
        raise ValueError(f"megatron_moe: --batch_size {value} must be >= 1")
    return int(value)


@register_model("megatron_moe")
class MegatronMoELM(TemplateLM):
    """lm-eval's `LM` over a megatron_moe GPT model (module docstring). Built by lm-eval from
    `--model_args`, or in process from a loaded `model` (an `inference.CausalLM`) and `tokenizer`
    (training's periodic evaluation, evaluation/during_training.py)."""

    def __init__(self, checkpoint: Optional[str] = None, batch_size=1, max_batch_size=None, device=None,
                 tensor: int = 1, expert: int = 1, max_length: Optional[int] = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, seed: int = 0, *, model=None, tokenizer=None,
                 prefix_token_id: Optional[int] = None):
        super().__init__()
        self.state = None  # the ParallelState this backend built (destroyed by `close`)
        if model is None:
            model, tokenizer, prefix_token_id = self._load(checkpoint, device, int(tensor), int(expert))
        elif tokenizer is None:
            raise ValueError("MegatronMoELM(model=...) needs its tokenizer")
        self.net = model
        self.tokenizer_obj = tokenizer
        self._prefix = tokenizer.eod if prefix_token_id is None else prefix_token_id
        self._device = next(model.parameters()).device
        self.batch_size = _batch_size(batch_size)
        self.max_length = int(max_length or model.cfg.model.seq_length)
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        if self.max_length < 2:
            raise ValueError(f"megatron_moe: max_length={self.max_length} must be >= 2")
        if model.cfg.model.position_embedding == "learned" and self.max_length > model.cfg.model.seq_length:
            raise ValueError(f"megatron_moe: max_length={self.max_length} exceeds model.seq_length="
                             f"{model.cfg.model.seq_length} (learned position embeddings)")

    def _load(self, checkpoint, device, tensor: int, expert: int):
        from megatron_moe.inference import DROPLESS, launch_layout, load_model
        from megatron_moe.training.checkpoint_tokenizer import checkpoint_tokenizer_spec

        if not checkpoint:
            raise ValueError("megatron_moe: give --model_args checkpoint=DIR (a checkpoint root or iter_* directory)")
        if not os.path.exists(str(checkpoint)):
            raise ValueError(f"megatron_moe: checkpoint {checkpoint}: not found")
        spec = checkpoint_tokenizer_spec(str(checkpoint))
        tok = spec.build()
        info, self.state = launch_layout(tensor, expert)
        where = "cpu" if str(device) == "cpu" else (info.device or "cpu")  # lm-eval's default cuda:0 -> ours
        model = load_model(str(checkpoint), device=where, overrides=DROPLESS, state=self.state)
        LOADED.append(self)
        return model, tok, prefix_token(spec, tok)

    def close(self) -> None:
        """Release the process groups this backend created (tools/evaluate.py calls it at the end)."""
        from megatron_moe.distributed import collectives

        if self.state is not None:
            collectives.destroy_process_group(self.state)
            self.state = None

    # -- lm-eval's interface ----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_obj.eod

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer_obj).__name__

    def tok_encode(self, string: str, add_special_tokens=None, left_truncate_len=None, **kwargs) -> List[int]:
        ids = self.tokenizer_obj.tokenize(string)  # as training tokenized (no specials added)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: List[int]) -> str:
        """Text of `ids` without special tokens (the hf backend decodes with skip_special_tokens)."""
        specials = set(self.tokenizer_obj.special_ids.values())
        return self.tokenizer_obj.detokenize([i for i in ids if i not in specials])

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.net.parameters()),
                "model_dtype": str(next(self.net.parameters()).dtype)}

    @torch.no_grad()
    def _logprobs(self, inputs: List[List[int]]) -> torch.Tensor:
        """Right-padded `inputs` through the model -> fp32 log-probabilities `[b, s, vocab]`."""
        s = max(len(x) for x in inputs)
        tokens = torch.full((len(inputs), s), self.eot_token_id, dtype=torch.long)
        for i, x in enumerate(inputs):
            tokens[i, :len(x)] = torch.as_tensor(x, dtype=torch.long)
        return F.log_softmax(self.net(tokens.to(self._device)).float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        """((context, continuation), context ids, continuation ids) -> (sum of the continuation's
        log-probabilities, whether it is the greedy continuation), as the hf backend computes them."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            inputs = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]  # [s_i]
            logprobs = self._logprobs(inputs)  # [b, s, vocab]
            for (_, _, cont), inp, lp in zip(chunk, inputs, logprobs):
                rows = lp[len(inp) - len(cont):len(inp)]  # [len(cont), vocab]: the positions predicting cont
                target = torch.as_tensor(cont, dtype=torch.long, device=rows.device)
                results.append((float(rows.gather(1, target[:, None]).sum()),
                                bool((rows.argmax(-1) == target).all())))
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        order = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        eos = self.tokenizer_obj.detokenize([self.eot_token_id])
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new = int(kwargs.pop("max_gen_toks"))
            if new >= self.max_length:
                raise ValueError(f"megatron_moe: max_gen_toks={new} must be below max_length={self.max_length}")
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - new) or [self.prefix_token_id]
                       for c in contexts]
            stops = {self.eot_token_id} | {ids[0] for ids in map(self.tok_encode, until) if len(ids) == 1}
            sampled = kwargs.get("do_sample") and kwargs.get("temperature", 0.0) > 0
            outs = generate(self.net, prompts, new, temperature=float(kwargs["temperature"]) if sampled else 0.0,
                            top_k=int(kwargs.get("top_k") or 0) if sampled else 0,
                            top_p=float(kwargs.get("top_p") or 1.0) if sampled else 1.0,
                            seed=self.seed, stop_tokens=sorted(stops), pad_id=self.eot_token_id)
            for out in outs:
                ids = out.tokens
                if self.eot_token_id in ids:  # the text ends before the end of the document
                    ids = ids[:ids.index(self.eot_token_id)]
                results.append(postprocess_generated_text(self.tok_decode(ids), until, None))
        return order.get_original(results)
