"""Small name -> class registries for pluggable parts (schedules, balancers, lr schedules, ...).

    SCHEDULES = Registry("moe.schedule")

    @SCHEDULES.register("baseline")
    class BaselineSchedule: ...

    SCHEDULES.get("s2")  # ConfigError listing the registered names if unknown
"""
from __future__ import annotations

from typing import Callable, Dict, Generic, TypeVar

from megatron_moe.config.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, key: str):
        self.key = key  # the config key that selects an entry, for error messages
        self._entries: Dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.key}: '{name}' is registered twice")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ConfigError(f"{self.key}={name!r} is not registered; choose one of {self.names()}")
        return self._entries[name]

    def names(self) -> list:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
