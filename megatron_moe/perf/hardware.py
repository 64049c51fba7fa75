"""Hardware profiles: the alpha-beta costs (Parm Eq. 12) of the collectives Parm's Alg. 1 compares.

A profile is a YAML file (shipped ones in `configs/hardware/`, fitted ones written by
`tools/profile_comm.py`)::

    name: parm_testbed_a
    description: where the numbers come from
    mp_allgather:    {alpha: 6.64e-4, beta: 5.38e-10}          # AG_MP(x), x = gathered elements
    ep_esp_alltoall: {alpha: 6.64e-4, beta: 5.38e-10}          # A2A_EP&ESP(x), x = this rank's input
    saa:             {alpha: 1.31e-3, beta: 1.064e-9, r2: 0.99} # Overlap(x): S2's second EP&ESP-AlltoAll
                                                               # (input x) with its MP-AllGather
    fit: {...}   # optional, free-form: how it was measured (layout, sizes, R^2, backend)

Times in seconds, x in elements (values, whatever their dtype); `r2` (optional) is the fit quality.
The numbers belong to the group sizes they were measured on (`fit.layout`); Alg. 1 uses them as is.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict

import yaml

from megatron_moe.config.errors import ConfigError
from megatron_moe.perf.alpha_beta import AlphaBeta

OPS = ("mp_allgather", "ep_esp_alltoall", "saa")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    mp_allgather: AlphaBeta  # Eq. 12: alpha_MP^AG, beta_MP^AG
    ep_esp_alltoall: AlphaBeta  # alpha_EP&ESP^A2A, beta_EP&ESP^A2A
    saa: AlphaBeta  # alpha_o, beta_o (Alg. 1)
    description: str = ""
    fit: Dict[str, Any] = field(default_factory=dict)


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
    if unknown or not set(OPS) <= raw.keys():
        raise ConfigError(f"{where}: needs keys {', '.join(OPS)} (optional: name, description, fit); "
                          f"unknown: {sorted(unknown)}")
    ops = {op: _op(raw[op], f"{where}: {op}") for op in OPS}
    return HardwareProfile(str(raw.get("name", os.path.basename(path))), description=str(raw.get("description", "")),
                           fit=dict(raw.get("fit") or {}), **ops)


def save_profile(profile: HardwareProfile, path: str) -> None:
    def op(ab: AlphaBeta) -> Dict[str, float]:
        return {"alpha": ab.alpha, "beta": ab.beta, **({"r2": ab.r2} if ab.r2 is not None else {})}

    raw = {"name": profile.name, "description": profile.description,
           **{name: op(getattr(profile, name)) for name in OPS}, "fit": profile.fit}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
