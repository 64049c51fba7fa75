"""LR schedules: linear warmup, cosine decay to min_lr, constant (worked values)."""
import math

import pytest

from megatron_moe.config import ConfigError
from megatron_moe.config.schema import OptimizerConfig
from megatron_moe.training.lr import LR_SCHEDULES

OPT = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_iters=10)


def test_cosine_warmup_then_decay():
    f = LR_SCHEDULES.get("cosine")
    assert f(OPT, 1, 110) == pytest.approx(1e-4)  # 1/10 of lr
    assert f(OPT, 5, 110) == pytest.approx(5e-4)
    assert f(OPT, 10, 110) == pytest.approx(1e-3)  # warmup ends at the peak
    # halfway through the 100 decay iterations: (lr + min_lr) / 2
    assert f(OPT, 60, 110) == pytest.approx(5.5e-4)
    assert f(OPT, 35, 110) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.25)))
    assert f(OPT, 110, 110) == pytest.approx(1e-4)
    assert f(OPT, 500, 110) == pytest.approx(1e-4)  # past the end: stays at min_lr
    lrs = [f(OPT, i, 110) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_no_warmup_and_constant():
    no_warmup = OptimizerConfig(lr=2e-3, min_lr=0.0, warmup_iters=0)
    assert LR_SCHEDULES.get("cosine")(no_warmup, 0, 100) == pytest.approx(2e-3)
    assert LR_SCHEDULES.get("cosine")(no_warmup, 50, 100) == pytest.approx(1e-3)
    const = LR_SCHEDULES.get("constant")
    assert const(OPT, 2, 100) == pytest.approx(2e-4)
    assert const(OPT, 10, 100) == const(OPT, 99, 100) == pytest.approx(1e-3)


def test_unknown_schedule_lists_registered():
    with pytest.raises(ConfigError, match="constant.*cosine"):
        LR_SCHEDULES.get("linear")
