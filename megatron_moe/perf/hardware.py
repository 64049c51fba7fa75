"""Hardware profiles: alpha-beta costs (Parm Eq. 12) of the collectives and compute the cost models
compare (Parm's Alg. 1, FasterMoE's Eq. 7-10, ...).

A profile is a YAML file (shipped ones in `configs/hardware/`, fitted ones written by
`tools/profile_comm.py` or by start-up calibration, `training/calibrate.py`)::

    name: parm_testbed_a
    description: where the numbers come from
    mp_allgather:    {alpha: 6.64e-4, beta: 5.38e-10}          # AG_MP(x), x = gathered elements
    ep_esp_alltoall: {alpha: 6.64e-4, beta: 5.38e-10}          # A2A_EP&ESP(x), x = this rank's input
    saa:             {alpha: 1.31e-3, beta: 1.064e-9, r2: 0.99} # Overlap(x): S2's second EP&ESP-AlltoAll
                                                               # (input x) with its MP-AllGather
    p2p:             {alpha: ..., beta: ...}   # x elements sent between two ranks of `ep` (W_net = 4 / beta B/s)
    broadcast:       {alpha: ..., beta: ...}   # x elements broadcast from one rank of `ep` to the others
    expert_compute:  {alpha: ..., beta: ...}   # expert FFN forward of x FLOPs on one rank (P = 1 / beta)
    fit: {...}   # optional, free-form: how it was measured (layout, sizes, R^2, backend)

Times in seconds, x in elements (values, whatever their dtype) or FLOPs; `r2` (optional) is the fit
quality. Every entry is optional; a technique names what it needs (`require`) and a profile that
lacks it is refused with a one-line error. The numbers belong to the group sizes they were
measured on (`fit.layout`); the models use them as is.

A *cluster* profile (the simulator's, `megatron_moe/sim/`, docs/simulator.md) adds an optional
``cluster`` block: the node size and, per collective, alpha-beta inside a node and across nodes::

    cluster:
      node_size: 8                       # ranks (GPUs) per node; consecutive ranks share a node
      links:                             # per collective: intra- and inter-node alpha-beta
        all_to_all: {intra: {alpha: 1.0e-5, beta: 2.0e-11}, inter: {alpha: 3.0e-5, beta: 3.2e-10}}
        all_gather: {intra: {...}, inter: {...}}   # x = gathered elements (as above)
        all_reduce: {intra: {...}, inter: {...}}   # x = elements of the tensor
        p2p:        {intra: {...}, inter: {...}}   # x = elements one rank sends to one peer
        broadcast:  {...}                          # x = elements of the tensor (optional: p2p's)
        reduce:     {...}                          # x = elements of the tensor (optional: broadcast's)
      dense_compute: {alpha: 0.0, beta: 1.0e-14}  # non-expert compute, s per FLOP (optional: expert_compute's)

All-to-all and point to point: x = elements a rank sends to (or receives from) peers over that
kind of link, its own slice excluded; a group collective uses `inter` when its group spans nodes.
A link without `inter` costs `intra` everywhere. The flat ops above stay what the cost models of
training read; the simulator derives what it needs from either (`sim/cluster.py`).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import yaml

from megatron_moe.config.errors import ConfigError
from megatron_moe.perf.alpha_beta import AlphaBeta
from megatron_moe.config.validate import GATED, expert_activation, expert_ffn_hidden_size, section_check
from megatron_moe.config.registry import Hooks

PARM_OPS = ("mp_allgather", "ep_esp_alltoall", "saa")  # Parm Alg. 1
BALANCER_OPS = ("p2p", "broadcast", "expert_compute")  # FasterMoE Eq. 7-10 (and the balancers after it)
LANCET_OPS = ("ep_esp_alltoall",)  # Lancet Alg. 1's all-to-all time (techniques/lancet/lancet.py); expert_compute seeds dW's
OPS = PARM_OPS + BALANCER_OPS
LINK_KINDS = ("all_to_all", "all_gather", "all_reduce", "p2p", "broadcast", "reduce")  # cluster.links


@dataclass(frozen=True)
class ExpertShape:
    """One expert shard's FFN: hidden h, FFN units f (this shard's), gated (SwiGLU) or not."""

    hidden: int = 1024
    ffn: int = 4096
    gated: bool = False

    @property
    def flops_per_row(self) -> float:
        return 2.0 * self.hidden * self.ffn * (3 if self.gated else 2)

    def params(self, bias: bool, esp_size: int) -> int:
        """Elements of one expert shard's parameters: w1 [h, (2,) f], w2 [f, h], b1 [(2,) f] and
        b2's h / N_ESP slice (what *Trans* moves and *Agg* sums)."""
        width = self.ffn * (2 if self.gated else 1)
        return self.hidden * (width + self.ffn) + ((width + self.hidden // esp_size) if bias else 0)


def expert_shape(cfg, state) -> ExpertShape:
    """One expert shard of `cfg` on `state` (a ParallelState: its ESP degree)."""
    return ExpertShape(cfg.model.hidden_size, expert_ffn_hidden_size(cfg) // state.esp_size,
                       expert_activation(cfg) in GATED)


@dataclass(frozen=True)
class Link:
    """One collective's alpha-beta inside a node (`intra`) and across nodes (`inter`, None: as intra)."""

    intra: AlphaBeta
    inter: Optional[AlphaBeta] = None

    def across(self, spans_nodes: bool) -> AlphaBeta:
        return self.inter if spans_nodes and self.inter is not None else self.intra


@dataclass(frozen=True)
class ClusterSpec:
    """The `cluster` block: ranks per node, per-collective links, optional dense compute."""

    node_size: Optional[int] = None  # None: every rank on one node
    links: Dict[str, Link] = field(default_factory=dict, hash=False)  # LINK_KINDS -> Link
    dense_compute: Optional[AlphaBeta] = None  # s per FLOP of non-expert compute (None: expert_compute's)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    mp_allgather: Optional[AlphaBeta] = None  # Eq. 12: alpha_MP^AG, beta_MP^AG
    ep_esp_alltoall: Optional[AlphaBeta] = None  # alpha_EP&ESP^A2A, beta_EP&ESP^A2A
    saa: Optional[AlphaBeta] = None  # alpha_o, beta_o (Alg. 1)
    description: str = ""
    fit: Dict[str, Any] = field(default_factory=dict)
    p2p: Optional[AlphaBeta] = None  # point to point on `ep`, x = elements: W_net
    broadcast: Optional[AlphaBeta] = None  # one rank of `ep` to the others, x = elements
    expert_compute: Optional[AlphaBeta] = None  # x = FLOPs of an expert FFN forward: P
    cluster: Optional[ClusterSpec] = None  # node size, intra / inter-node links (the simulator's)

    def require(self, ops: Sequence[str], who: str) -> "HardwareProfile":
        """Self, or a ConfigError naming what `who` (a config key=value) needs and this profile lacks."""
        missing = [op for op in ops if getattr(self, op) is None]
        if missing:
            raise ConfigError(f"{who} needs {', '.join(missing)} in its hardware profile ({self.name} has "
                              f"{', '.join(op for op in OPS if getattr(self, op) is not None) or 'none'}); re-fit it "
                              "with tools/profile_comm.py or leave perf.hardware_profile unset to calibrate at start-up")
        return self


def _op(raw: Any, where: str) -> AlphaBeta:
    if not isinstance(raw, dict) or not {"alpha", "beta"} <= raw.keys() or not raw.keys() <= {"alpha", "beta", "r2"}:
        raise ConfigError(f"{where} must be a mapping with keys alpha, beta (and optionally r2)")
    try:
        values = {k: float(v) for k, v in raw.items()}
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: alpha, beta and r2 must be numbers") from None
    if values["alpha"] < 0 or values["beta"] < 0:
        raise ConfigError(f"{where}: alpha and beta must be >= 0")
    return AlphaBeta(values["alpha"], values["beta"], values.get("r2"))


def _cluster(raw: Any, where: str) -> ClusterSpec:
    where = f"{where}: cluster"
    if not isinstance(raw, dict) or not raw.keys() <= {"node_size", "links", "dense_compute"}:
        raise ConfigError(f"{where} must be a mapping with keys node_size, links, dense_compute")
    node_size = raw.get("node_size")
    if node_size is not None and (not isinstance(node_size, int) or node_size < 1):
        raise ConfigError(f"{where}.node_size must be a positive integer (ranks per node), got {node_size!r}")
    links_raw = raw.get("links") or {}
    if not isinstance(links_raw, dict) or not links_raw.keys() <= set(LINK_KINDS):
        raise ConfigError(f"{where}.links: a mapping of {', '.join(LINK_KINDS)}; unknown: "
                          f"{sorted(set(links_raw) - set(LINK_KINDS)) if isinstance(links_raw, dict) else links_raw}")
    links = {}
    for kind, entry in links_raw.items():
        if not isinstance(entry, dict) or "intra" not in entry or not entry.keys() <= {"intra", "inter"}:
            raise ConfigError(f"{where}.links.{kind} must be a mapping with keys intra (and optionally inter)")
        links[kind] = Link(_op(entry["intra"], f"{where}.links.{kind}.intra"),
                           _op(entry["inter"], f"{where}.links.{kind}.inter") if "inter" in entry else None)
    dense = _op(raw["dense_compute"], f"{where}.dense_compute") if "dense_compute" in raw else None
    return ClusterSpec(node_size, links, dense)


def load_profile(path: str) -> HardwareProfile:
    """Read and check a profile; a ConfigError names `perf.hardware_profile` and the problem. The
    file is read on every call; parsing is cached by its content (every balancer and schedule of a
    model loads the same profile, the simulator one per layer and candidate), so the profile
    returned may be shared: it is frozen, and its `fit` must not be changed in place."""
    if not os.path.isfile(path):
        raise ConfigError(f"perf.hardware_profile={path}: no such file")
    with open(path) as f:
        return _parse_profile(path, f.read())


@functools.lru_cache(maxsize=64)
def _parse_profile(path: str, text: str) -> HardwareProfile:
    where = f"perf.hardware_profile={path}"
    try:
        raw = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml when built with it
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = raw.keys() - {"name", "description", "fit", "cluster", *OPS}
    if unknown or not (set(OPS) | {"cluster"}) & raw.keys():
        raise ConfigError(f"{where}: needs one or more of {', '.join(OPS)} or a cluster block (optional: name, "
                          f"description, fit); unknown: {sorted(unknown)}")
    ops = {op: _op(raw[op], f"{where}: {op}") for op in OPS if op in raw}
    cluster = _cluster(raw["cluster"], where) if "cluster" in raw else None
    return HardwareProfile(str(raw.get("name", os.path.basename(path))), description=str(raw.get("description", "")),
                           fit=dict(raw.get("fit") or {}), cluster=cluster, **ops)


def configured_profile(cfg, ops: Sequence[str], who: str) -> HardwareProfile:
    """`perf.hardware_profile` of `cfg`, loaded and checked for `ops` (needed by `who`, a config
    key=value). Unset, a ConfigError says what to pass: the trainer and the models
    (`model/pipeline_stages.py`) calibrate one first (`training/calibrate.py`), a schedule, balancer
    or Lancet scheduler built on its own cannot."""
    path = cfg.perf.hardware_profile
    if not path:
        raise ConfigError(f"{who} needs perf.hardware_profile: set it, or pass the config through "
                          "training.calibrate.resolve_hardware_profile(cfg, state, device) first (the trainer, "
                          "GPTMoEModel and BertMoEModel do: they calibrate one on the ranks)")
    return load_profile(path).require(ops, who)


def profile_dict(profile: HardwareProfile) -> Dict[str, Any]:
    """The YAML mapping of `profile` (what `load_profile` reads back)."""
    def op(ab: AlphaBeta) -> Dict[str, float]:
        return {"alpha": ab.alpha, "beta": ab.beta, **({"r2": ab.r2} if ab.r2 is not None else {})}

    out = {"name": profile.name, "description": profile.description,
           **{name: op(getattr(profile, name)) for name in OPS if getattr(profile, name) is not None},
           "fit": profile.fit}
    cluster = profile.cluster
    if cluster is not None:
        out["cluster"] = {
            **({"node_size": cluster.node_size} if cluster.node_size is not None else {}),
            "links": {kind: {"intra": op(link.intra), **({"inter": op(link.inter)} if link.inter else {})}
                      for kind, link in cluster.links.items()},
            **({"dense_compute": op(cluster.dense_compute)} if cluster.dense_compute else {})}
    return out


def save_profile(profile: HardwareProfile, path: str) -> None:
    """Write `profile` as YAML (atomically: ranks sharing a cache directory may write the same file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(profile_dict(profile), f, sort_keys=False)
    os.replace(tmp, path)


# (cfg) -> [(ops, the config key=value that needs them)]: each technique says what its cost model
# needs from the hardware profile, in this order
PROFILE_NEEDS: Hooks = Hooks("hardware profile needs", ("parm", "fastermoe", "flexmoe", "proprophet", "lancet"))


def profile_needs(cfg) -> list:
    """[(hardware profile ops, the config key=value that needs them)] for `cfg`'s techniques."""
    return [need for _, needs in PROFILE_NEEDS.items() for need in needs(cfg)]


@section_check("perf.hardware_profile")
def _check_profile(cfg, world_size: int) -> None:
    """A given hardware profile must have what the configured techniques' models need (without
    one, they are calibrated at start-up)."""
    profile = cfg.perf.hardware_profile
    if profile:
        loaded = load_profile(profile)  # ConfigError naming perf.hardware_profile if missing or malformed
        for ops, who in profile_needs(cfg):
            loaded.require(ops, who)
