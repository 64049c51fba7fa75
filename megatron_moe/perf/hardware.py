"""Hardware profiles: alpha-beta costs (Parm Eq. 12) of the collectives and compute the cost models
compare (Parm's Alg. 1, FasterMoE's Eq. 7-10, ...).

A profile is a YAML file (shipped ones in `configs/hardware/`, fitted ones written by
`tools/profile_comm.py` or by start-up calibration, `perf/calibrate.py`)::

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
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import yaml

from megatron_moe.config.errors import ConfigError
from megatron_moe.perf.alpha_beta import AlphaBeta

PARM_OPS = ("mp_allgather", "ep_esp_alltoall", "saa")  # Parm Alg. 1
BALANCER_OPS = ("p2p", "broadcast", "expert_compute")  # FasterMoE Eq. 7-10 (and the balancers after it)
OPS = PARM_OPS + BALANCER_OPS


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


def load_profile(path: str) -> HardwareProfile:
    """Read and check a profile; a ConfigError names `perf.hardware_profile` and the problem."""
    where = f"perf.hardware_profile={path}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = raw.keys() - {"name", "description", "fit", *OPS}
    if unknown or not set(OPS) & raw.keys():
        raise ConfigError(f"{where}: needs one or more of {', '.join(OPS)} (optional: name, description, fit); "
                          f"unknown: {sorted(unknown)}")
    ops = {op: _op(raw[op], f"{where}: {op}") for op in OPS if op in raw}
    return HardwareProfile(str(raw.get("name", os.path.basename(path))), description=str(raw.get("description", "")),
                           fit=dict(raw.get("fit") or {}), **ops)


def profile_dict(profile: HardwareProfile) -> Dict[str, Any]:
    """The YAML mapping of `profile` (what `load_profile` reads back)."""
    def op(ab: AlphaBeta) -> Dict[str, float]:
        return {"alpha": ab.alpha, "beta": ab.beta, **({"r2": ab.r2} if ab.r2 is not None else {})}

    return {"name": profile.name, "description": profile.description,
            **{name: op(getattr(profile, name)) for name in OPS if getattr(profile, name) is not None},
            "fit": profile.fit}


def save_profile(profile: HardwareProfile, path: str) -> None:
    """Write `profile` as YAML (atomically: ranks sharing a cache directory may write the same file)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(profile_dict(profile), f, sort_keys=False)
    os.replace(tmp, path)
