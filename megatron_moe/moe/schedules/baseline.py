"""Placeholder; replaced by the baseline schedule (Parm Fig. 3(a))."""
from megatron_moe.moe.schedules import SCHEDULES


@SCHEDULES.register("baseline")
class BaselineSchedule:
    pass
