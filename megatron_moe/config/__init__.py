"""Typed config tree, YAML + dotted overrides, validation (DESIGN.md §2)."""
from megatron_moe.config.errors import ConfigError
from megatron_moe.config.load import load_config, parse_cli, save_config, to_yaml
from megatron_moe.config.schema import Config
from megatron_moe.config.validate import validate_config

__all__ = ["Config", "ConfigError", "load_config", "parse_cli", "save_config", "to_yaml", "validate_config"]
