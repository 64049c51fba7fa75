"""Injected op times for Lancet's `partition_range: auto` (techniques/lancet/lancet_partition.py), so that the
dynamic program picks segments on any machine, however loaded (tests/unit/test_lancet.py,
tests/e2e/test_vexperts.py as a hook of its ranks).

The real measurement still runs (every sublayer at 1..k parts, the max-reduce over the stage's
ranks); its times are then replaced by ones where overlap pays: every sublayer 1/k s per part plus
0.02 s of partition overhead, an MoE FFN's compute half that and each of its all-to-alls 2/k s.
"""
from typing import List

from megatron_moe.techniques.lancet.lancet_partition import ForwardPartitioner
from megatron_moe.techniques.lancet.lancet_partition_model import Instruction, MoECost

MEASURE = ForwardPartitioner.measure


def injected(instructions: List[Instruction]) -> List[Instruction]:
    out = []
    for op in instructions:
        times = {k: 1.0 / k + 0.02 for k in op.times}
        moe = {k: MoECost(0.5 / k + 0.02, 2.0 / k, 2.0 / k) for k in times} if op.moe is not None else None
        out.append(Instruction(op.name, times, moe))
    return out


def measure_injected(partitioner, *args, **kwargs) -> List[Instruction]:
    """`ForwardPartitioner.measure`, run for real, with the injected times."""
    return injected(MEASURE(partitioner, *args, **kwargs))


def inject() -> None:
    """For a whole process (the e2e ranks' hook: tests/forkserver.py `run_script`)."""
    ForwardPartitioner.measure = measure_injected
