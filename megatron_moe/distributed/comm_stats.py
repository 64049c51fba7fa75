"""What distributed/collectives.py counts: bytes, calls and times per op kind and group
(`COMM_STATS`), the backward phase, and `TimeSink` for a caller's own async ops. Read through
`collectives` (`C.COMM_STATS`, `C.TimeSink`, ...); see its docstring for what each count means."""
from __future__ import annotations

import copy
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_moe.distributed.group import Group
from megatron_moe.perf.timing import Duration


class CommStats:
    """Bytes (all, and the part sent to other nodes), calls, total and exposed seconds per
    "<kind>/<group>" in this process. Times are `timing.Duration`s, resolved when read
    (`resolve=False` keeps them lazy: a snapshot to read after the device has caught up)."""

    def __init__(self):
        self.bytes: Dict[str, int] = defaultdict(int)
        self.inter_node: Dict[str, int] = defaultdict(int)  # bytes to ranks on other nodes (all-to-all, p2p)
        self.received: Dict[str, int] = defaultdict(int)  # bytes received by point-to-point ops (`p2p_exchange`)
        self.seconds: Dict[str, Duration] = defaultdict(Duration)  # total span
        self.exposed: Dict[str, Duration] = defaultdict(Duration)  # time the caller was blocked
        self.calls: Dict[str, int] = defaultdict(int)
        self.phase = "forward"  # "backward" while the trainer runs backward (set by it)
        # (phase, kind): [exposed, total]
        self.by_phase: Dict[Tuple[str, str], List[Duration]] = defaultdict(lambda: [Duration(), Duration()])
        # bytes of the ops issued inside `tagging(tag)`, also under "<kind>/<group>#<tag>" (a part of
        # one kind: Pro-Prophet's SubAgg1 / SubAgg2); `bytes` counts them under their kind as always
        self.tagged: Dict[str, int] = defaultdict(int)
        self.tag: Optional[str] = None

    def record(self, kind: str, group: Group, nbytes: int, seconds: Duration, inter_node: int = 0) -> None:
        """A synchronous op: `seconds` is both its total and its exposed time."""
        self.record_bytes(kind, group, nbytes, inter_node)
        self.record_time(kind, group, seconds, seconds)

    def record_bytes(self, kind: str, group: Group, nbytes: int, inter_node: int = 0) -> None:
        key = f"{kind}/{group.name}"
        self.bytes[key] += int(nbytes)
        self.calls[key] += 1
        if self.tag is not None:
            self.tagged[f"{key}#{self.tag}"] += int(nbytes)
        if inter_node:
            self.inter_node[key] += int(inter_node)

    def record_received(self, kind: str, group: Group, nbytes: int) -> None:
        """Bytes a point-to-point op receives (its sends are `record_bytes`)."""
        self.received[f"{kind}/{group.name}"] += int(nbytes)

    def record_time(self, kind: str, group: Group, total: Duration, exposed: Duration) -> None:
        key = f"{kind}/{group.name}"
        self.seconds[key] = self.seconds[key] + total
        self.exposed[key] = self.exposed[key] + exposed
        entry = self.by_phase[(self.phase, kind)]
        entry[0], entry[1] = entry[0] + exposed, entry[1] + total

    def reset(self) -> None:
        for counter in (self.bytes, self.inter_node, self.received, self.seconds, self.exposed, self.calls,
                        self.by_phase, self.tagged):
            counter.clear()

    @contextmanager
    def tagging(self, tag: str):
        """Count the bytes of the ops issued inside under `tag` too (`tagged`)."""
        previous, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = previous

    def snapshot(self) -> Dict[str, int]:
        return dict(self.bytes)

    @contextmanager
    def unrecorded(self):
        """Communication inside leaves every counter as it was (measurement passes, e.g. Lancet's
        op profiling, that are not part of any iteration)."""
        saved = copy.deepcopy(self.__dict__)  # Durations are immutable: shared, not copied
        try:
            yield
        finally:
            self.__dict__.update(saved)

    def total_seconds(self) -> float:
        return float(sum(self.seconds.values(), Duration()))

    def exposed_seconds(self) -> float:
        return float(sum(self.exposed.values(), Duration()))

    def bytes_by_kind(self) -> Dict[str, int]:
        """Bytes summed over groups: {"all_to_all": ..., "all_gather": ...}."""
        return _by_kind(self.bytes)

    def inter_node_bytes_by_kind(self) -> Dict[str, int]:
        """The part of `bytes_by_kind` sent to ranks on other nodes (all-to-all and point to point)."""
        return _by_kind(self.inter_node)

    def seconds_by_phase(self, kinds: Sequence[str], resolve: bool = True) -> Dict[str, Dict[str, float]]:
        """{"exposed": {phase: s}, "total": {phase: s}} of the op kinds `kinds`, forward and backward."""
        out = {"exposed": {"forward": Duration(), "backward": Duration()},
               "total": {"forward": Duration(), "backward": Duration()}}
        for (phase, kind), (exposed, total) in self.by_phase.items():
            if kind in kinds:
                out["exposed"][phase] = out["exposed"].get(phase, Duration()) + exposed
                out["total"][phase] = out["total"].get(phase, Duration()) + total
        return resolved(out) if resolve else out

    def seconds_by_kind(self, resolve: bool = True) -> Dict[str, Dict[str, float]]:
        """{"exposed": {kind: s}, "total": {kind: s}}, summed over groups (`Duration`s if not `resolve`)."""
        out = {"exposed": _by_kind(self.exposed), "total": _by_kind(self.seconds)}
        return resolved(out) if resolve else out


def resolved(times: Dict[str, Dict[str, Duration]]) -> Dict[str, Dict[str, float]]:
    """{part: {key: Duration}} -> the same with seconds (waits for the device where it must)."""
    return {part: {key: float(d) for key, d in entries.items()} for part, entries in times.items()}


def _by_kind(counter: Dict[str, object]) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for key, value in counter.items():
        kind = key.split("/")[0]
        out[kind] = out[kind] + value if kind in out else value
    return out


COMM_STATS = CommStats()


@contextmanager
def backward_phase():
    """Count the communication times recorded inside as the backward pass's (`seconds_by_phase`)."""
    previous, COMM_STATS.phase = COMM_STATS.phase, "backward"
    try:
        yield
    finally:
        COMM_STATS.phase = previous


class TimeSink(dict):
    """{kind: [exposed, total]} (`timing.Duration`s) of the async ops issued with it."""

    def add(self, kind: str, exposed: Duration, total: Duration) -> None:
        entry = self.setdefault(kind, [Duration(), Duration()])
        entry[0], entry[1] = entry[0] + exposed, entry[1] + total
