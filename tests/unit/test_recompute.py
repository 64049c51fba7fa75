"""Activation recomputation (`training.recompute`, model/recompute.py): selective and full give the
plain run's losses, gradients and dropout stream (dropout 0.1, capacity drops, GPT and BERT, with
Lancet's deferred dW too), and keep fewer bytes for backward."""
import pytest

from megatron_moe.config import ConfigError, load_config, validate_config
from tests.tiny_model import assert_same_steps, tiny_model_steps


@pytest.mark.parametrize("bert", [False, True], ids=["gpt", "bert"])
def test_recompute_is_exact_and_keeps_less(bert):
    plain = tiny_model_steps([], bert, steps=2)
    assert sum(plain[0].dropped) > 0
    kept = {}
    for level, extra in [("selective", []), ("full", []), ("full", ["moe.lancet.defer_wgrad=true"])]:
        got = tiny_model_steps([f"training.recompute={level}"] + extra, bert, steps=2)
        assert_same_steps(got, plain, f"{level} {extra}")
        kept[level] = got[0].saved_bytes
    # activation bytes autograd keeps for backward outside the recomputed regions (measured: full
    # keeps 1/4.8 of the plain run's for GPT, 1/3.6 for BERT, whose heads stay outside the layers)
    assert kept["full"] < kept["selective"] < plain[0].saved_bytes, (kept, plain[0].saved_bytes)
    assert kept["full"] < plain[0].saved_bytes / 3


def test_recompute_config_errors():
    with pytest.raises(ConfigError, match="training.recompute='some' must be one of none, selective, full"):
        validate_config(load_config("configs/gpt_moe_tiny.yaml", ["training.recompute=some"]), 1)
    with pytest.raises(ConfigError, match="moe.lancet.partitions>1 and training.recompute=full"):
        validate_config(load_config("configs/gpt_moe_tiny.yaml", ["training.recompute=full", "moe.lancet.partitions=2"]),
                        1)
