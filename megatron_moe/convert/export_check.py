"""Can a run of this config be exported to a Hugging Face family? Answered from the config alone,
before training (`--check-config --export-family F`, training/entry.py), with the rules
`tools/convert_checkpoint.py export-hf` applies to the checkpoint later (`hf_common.check_shape`;
docs/checkpoints.md)."""
from __future__ import annotations

from typing import List

from megatron_moe.config.errors import ConfigError
from megatron_moe.config.schema import Config
from megatron_moe.training.entry import EXPORT_CHECKS

AUTO = "auto"  # the family export-hf picks without --family (offline.guess_family)


def exportable_families(cfg: Config) -> List[str]:
    """The `model_type`s export-hf accepts for a GPT-MoE run of `cfg`."""
    from megatron_moe.convert.hf_common import check_shape
    from megatron_moe.convert.hf_families import FAMILIES

    out = []
    for name, family in sorted(FAMILIES.items()):
        try:
            check_shape(family, cfg)
        except ValueError:
            continue
        out.append(name)
    return out


@EXPORT_CHECKS.register("hf")
def check_export(cfg: Config, family: str, model_cls: type) -> str:
    """The family `export-hf --family <family>` (`auto`: without --family) will write for a checkpoint
    of a `model_cls` run of `cfg`; ConfigError, one line naming why and the families it would accept,
    if it will refuse it."""
    from megatron_moe.convert.hf_common import check_shape
    from megatron_moe.convert.hf_families import FAMILIES
    from megatron_moe.convert.offline import guess_family
    from megatron_moe.model.gpt import GPTMoEModel

    if family != AUTO and family not in FAMILIES:
        raise ConfigError(f"--export-family {family}: not a family export-hf writes "
                          f"(one of {', '.join(sorted(FAMILIES))}, or {AUTO})")
    if not issubclass(model_cls, GPTMoEModel):
        raise ConfigError(f"{model_cls.__name__} exports to no Hugging Face family (only GPT-MoE models do; "
                          "docs/checkpoints.md)")
    name = guess_family(cfg) if family == AUTO else family
    try:
        check_shape(FAMILIES[name], cfg)
    except ValueError as exc:
        others = exportable_families(cfg)
        picked = " (the family export-hf picks for this shape)" if family == AUTO else ""
        raise ConfigError(f"cannot export to {name}{picked}: {exc}; this config exports to "
                          f"{', '.join(others) if others else 'no family'}") from None
    return name
