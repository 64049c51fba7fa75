"""`training.compile` (model/compile.py): TorchInductor-compiled layers give the eager run's losses,
gradients and dropout stream (dropout 0.1, capacity drops, two steps), GPT and BERT, alone and
under activation recomputation and Lancet's partitioned forward."""
import pytest

from tests.tiny_model import assert_same_steps, tiny_model_steps


@pytest.mark.parametrize("bert", [False, True], ids=["gpt", "bert"])
def test_compile_is_exact(bert):
    plain = tiny_model_steps([], bert, steps=2)
    assert sum(plain[0].dropped) > 0
    runs = [[], ["training.recompute=full"], ["training.recompute=selective"]]
    if not bert:
        runs.append(["moe.lancet.partitions=2"])
    for extra in runs:
        got = tiny_model_steps(["training.compile=true"] + extra, bert, steps=2)
        assert_same_steps(got, plain, f"compile {extra}")

