"""YAML + `section.key=value` overrides -> typed `Config`, via OmegaConf structured configs.

    cfg = load_config("configs/gpt_moe_tiny.yaml", ["parallel.tensor=2", "moe.top_k=1"])

OmegaConf rejects unknown keys and values of the wrong type; its errors are turned into a one-line
`ConfigError` naming the key. Overrides use OmegaConf's dotlist grammar (`moe.capacity_factor=null`,
`data.path=[0.3,a,0.7,b]`).
"""
from __future__ import annotations

import argparse
import functools
import os
from typing import List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config


def _one_line(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if key and str(key) not in msg:
        return f"{key}: {msg}"
    return msg


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The defaults as an OmegaConf node, built once (~30 ms): `OmegaConf.merge` copies it, never
    changes it."""
    return OmegaConf.structured(Config)


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
    """Merge defaults <- YAML file <- overrides and return a typed `Config` (a real dataclass)."""
    try:
        layers = [_schema()]
        if path is not None:
            if not os.path.isfile(path):
                raise ConfigError(f"--config {path}: no such file")
            layers.append(OmegaConf.load(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form section.key=value")
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from None
    except ConfigError:
        raise
    except Exception as exc:  # YAML syntax errors and the like
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None
    assert isinstance(cfg, Config)
    return resolve_defaults(cfg)


def resolve_defaults(cfg: Config) -> Config:
    """Fill in place the null keys whose value follows from others, and return `cfg`:
    `parallel.pipeline_schedule` = interleaved when `parallel.virtual_stages` > 1, else 1f1b (Megatron
    infers interleaving from the virtual pipeline size). `load_config` and `validate_config` call it,
    so the config a run writes (`<run_dir>/config.yaml`) names the schedule that runs."""
    par = cfg.parallel
    if par.pipeline_schedule is None:
        par.pipeline_schedule = "interleaved" if par.virtual_stages > 1 else "1f1b"
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(to_yaml(cfg))


def parse_cli(argv: Optional[List[str]] = None, description: str = "") -> argparse.Namespace:
    """The entry points' command line: `[--check-config [--world-size N]] --config FILE section.key=value ...`
    -> Namespace(config, overrides, check_config, world_size, export_family)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config file (see configs/)")
    parser.add_argument("--check-config", action="store_true",
                        help="only validate the config (no process group, no model) and exit: 0 = ok, 2 = config error")
    parser.add_argument("--world-size", type=int, default=None,
                        help="with --check-config: the number of processes the launch will have "
                             "(default: this process's launcher environment, 1 without one)")
    parser.add_argument("--export-family", default=None, metavar="F",
                        help="with --check-config: also check that export-hf can write this model as Hugging Face "
                             "family F (mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss, deepseek_v3, glm4_moe, or auto: "
                             "its default); 2 = it cannot")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    args = parser.parse_args(argv)
    if args.world_size is not None and (not args.check_config or args.world_size < 1):
        parser.error("--world-size N (N >= 1) goes with --check-config")
    if args.export_family is not None and not args.check_config:
        parser.error("--export-family F goes with --check-config")
    return args
