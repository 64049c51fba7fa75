"""What one pipeline stage of a model holds (`parallel.pipeline`, `virtual_stages`, `pipeline_layers`;
Megatron-LM's pre_process / post_process model chunks, Narayanan et al. SC'21 §2.2).

The layers are cut into p * v *model chunks* (p stages, v virtual stages each) in forward order:
evenly, or `parallel.pipeline_layers` layers each. Model chunk k = virtual * p + stage, so stage s
holds chunks s, p + s, ...; with v = 1 the layers [s L/p, (s+1) L/p). The first chunk also holds the
input embedding, the last one the final norm, the output head and the loss.

Parameters keep their global names on every layout (`layers.<global index>.…`, `embedding.…`),
so initialization from the seed and checkpoints (`tensor_parallel/param_meta.py`) are layout-independent.
Tied word embeddings (Megatron's embedding group): when the output layer reuses the word embedding
and the last chunk is on another stage than the first, the last stage holds a copy of the word
table under the same name. Both copies are marked `tied_across_stages`: their gradients are summed
over the `embedding` group (first and last stage, `training/grads.py`), so they stay equal; the
last stage's copy is also `pipeline_duplicate`: the global grad norm counts it once. Multi-token
prediction (`model.mtp_depth`, model/mtp.py) lives on the last stage after the final norm and embeds
tokens there: its model shares the word table the same way even with untied output weights.

Dense and MoE layers (`moe_layer_flags`: layer_freq, first_k_dense or layer_pattern) are counted as
layers like any other: `pipeline_layers` / the even split count transformer layers, whatever their
FFN, and the MTP layers are on the last stage beyond them.

`StagedModel` is the part GPT and BERT share: building this stage's embedding, layers and final
norm, and running one model chunk (`run_chunk`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_moe.config.schema import Config
from megatron_moe.distributed.launch import default_device
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.attention import rotary_tables
from megatron_moe.model.compile import compile_layers
from megatron_moe.model.embedding import Embedding
from megatron_moe.model.norm import build_norm
from megatron_moe.tensor_parallel.param_meta import init_model_from_seed_
from megatron_moe.model.transformer import TransformerLayer, moe_ffns, run_layers
from megatron_moe.model.mtp import mtp_layers
from megatron_moe.config.registry import Hooks
from megatron_moe.tensor_parallel import DropoutRNG

# What the floors above add to a stage's model, registered next to their code:
#   "perf.hardware_profile"   (cfg, state, device) -> cfg with a profile when a technique needs one
#                             (training/calibrate.py, collective)
#   "moe.lancet.defer_wgrad"  (model, cfg) -> None: attach the dW scheduler (techniques/lancet/lancet.py)
#   "moe.lancet.partitions"   (cfg, state, rng, layers) -> the chunk's partitioner or None
#                             (techniques/lancet/lancet_partition.py)
STAGE_HOOKS: Hooks = Hooks("staged model hook", ("perf.hardware_profile", "moe.lancet.defer_wgrad",
                                                 "moe.lancet.partitions"))


def chunk_layer_counts(cfg: Config) -> List[int]:
    """Layers per model chunk, in forward order (config validated: they sum to model.num_layers)."""
    par = cfg.parallel
    if par.pipeline_layers is not None:
        return [int(n) for n in par.pipeline_layers]
    chunks = par.pipeline * par.virtual_stages
    return [cfg.model.num_layers // chunks] * chunks


def model_chunk_layers(cfg: Config) -> List[range]:
    """The global layer indices of every model chunk, in forward order."""
    out, start = [], 0
    for n in chunk_layer_counts(cfg):
        out.append(range(start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class StageChunks:
    """The model chunks of one pipeline stage: `layers[c]` are virtual chunk c's global layer indices."""

    stages: int
    stage: int
    layers: Tuple[range, ...]

    @classmethod
    def of(cls, cfg: Config, stage: int) -> "StageChunks":
        p = cfg.parallel.pipeline
        return cls(p, stage, tuple(model_chunk_layers(cfg)[stage::p]))

    @property
    def virtual(self) -> int:
        return len(self.layers)

    def is_first(self, chunk: int) -> bool:
        """Does virtual chunk `chunk` start the model (take the tokens)?"""
        return self.stage == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        """Does virtual chunk `chunk` end the model (compute the loss)?"""
        return self.stage == self.stages - 1 and chunk == self.virtual - 1

    @property
    def has_embedding(self) -> bool:
        return self.is_first(0)

    @property
    def has_head(self) -> bool:
        return self.is_last(self.virtual - 1)


class LayerStack(torch.nn.Module):
    """This stage's transformer layers under their global indices (`layers.<i>`), iterated in order;
    `chunk(c)` lists virtual chunk c's layers."""

    def __init__(self, layers: Dict[int, torch.nn.Module], chunks: Tuple[range, ...]):
        super().__init__()
        for index in sorted(layers):
            self.add_module(str(index), layers[index])
        self.chunks = chunks

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, position: int) -> torch.nn.Module:
        return list(self._modules.values())[position]

    def chunk(self, chunk: int) -> List[torch.nn.Module]:
        return [self._modules[str(i)] for i in self.chunks[chunk]]


class StagedModel(torch.nn.Module):
    """Embedding (first chunk), transformer layers, final norm (last chunk) of this pipeline stage.
    Subclasses build their heads after `__init__` and call `finish_init()` last."""

    def __init__(self, cfg: Config, state: ParallelState, *, causal: bool, num_token_types: int = 0,
                 tied_head: bool = True):
        """`tied_head`: the last stage needs the word table (a tied output layer, or MTP's embedding)."""
        super().__init__()
        if cfg.model.mtp_depth and not causal:
            raise ValueError(f"model.mtp_depth={cfg.model.mtp_depth}: multi-token prediction is for GPT "
                             "(causal) models; set model.mtp_depth=0")
        # a technique that needs a hardware profile (moe.schedule=auto, the balancers' cost models,
        # Lancet's dW budget) and has none: calibrate on these ranks as the trainer does (collective;
        # a no-op when the trainer already did, or when the config names one)
        cfg = STAGE_HOOKS.get("perf.hardware_profile")(cfg, state, default_device(cfg.parallel.backend))
        m = cfg.model
        self.cfg, self.state = cfg, state
        self.stage = StageChunks.of(cfg, state.pp.rank)
        self.dropout_rng = DropoutRNG(cfg.training.seed, state)
        self.embedding = None
        if self.stage.has_embedding:
            self.embedding = Embedding(m, state, self.dropout_rng, num_token_types=num_token_types)
        elif self.stage.has_head and tied_head:  # the output layer's copy of the word table
            self.embedding = Embedding(m, state, self.dropout_rng, word_only=True)
        self.rotary = rotary_tables(m)  # rope: cos / sin computed once, shared by the layers
        self.layers = LayerStack({i: TransformerLayer(cfg, state, i, self.dropout_rng, causal=causal,
                                                      rotary=self.rotary)
                                  for chunk in self.stage.layers for i in chunk}, self.stage.layers)
        self.final_norm = build_norm(m, state) if self.stage.has_head else None
        self.mtp = None  # the MTP depths (model/mtp.py), built by the GPT head on the last stage
        self.tied_head = tied_head
        self.has_binary_loss = False  # a second loss term next to lm_loss (BERT's binary head)

    def finish_init(self) -> None:
        """Initialize every parameter from the seed; Lancet, compile and partitioners per chunk."""
        cfg = self.cfg
        init_model_from_seed_(self, cfg.training.seed, self.state)
        if self.tied_head and self.state.pp.size > 1 and self.embedding is not None:
            word = self.embedding.word.weight
            word.tied_across_stages = True  # gradient summed over the `embedding` group
            word.pipeline_duplicate = not self.stage.has_embedding  # the grad norm counts the first stage's
        STAGE_HOOKS.get("moe.lancet.defer_wgrad")(self, cfg)
        if cfg.training.compile:
            compile_layers(list(self.layers) + mtp_layers(self.mtp))
        partitioner = STAGE_HOOKS.get("moe.lancet.partitions")
        self.partitioners = [partitioner(cfg, self.state, self.dropout_rng, self.layers.chunk(c))
                             for c in range(self.stage.virtual)]  # moe.lancet.partitions

    def moe_layers(self) -> List[torch.nn.Module]:
        """This stage's MoE layers, in layer order (the MTP layers last)."""
        return moe_ffns(list(self.layers) + mtp_layers(self.mtp))

    def run_chunk(self, chunk: int, hidden: Optional[torch.Tensor], embed, padding_mask=None):
        """Virtual chunk `chunk` on `hidden` [b, s, h] (the previous stage's output), or on
        `embed()` for the model's first chunk -> (x [b, s, h], aux loss of its MoE layers, their stats)."""
        if self.stage.is_first(chunk):
            hidden = embed()
        elif hidden is None:
            raise ValueError(f"pipeline stage {self.stage.stage} chunk {chunk} needs the previous stage's "
                             "hidden states")
        layers = self.layers.chunk(chunk)
        x, aux_loss = run_layers(layers, hidden, padding_mask, self.partitioners[chunk])
        return x, aux_loss, [moe.last_stats for moe in moe_ffns(layers)]
