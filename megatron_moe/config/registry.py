"""Small name -> class registries for pluggable parts (schedules, balancers, lr schedules, ...),
and ordered hooks (config section checks, hardware-profile needs).

    SCHEDULES = Registry("moe.schedule")

    @SCHEDULES.register("baseline")
    class BaselineSchedule: ...

    SCHEDULES.get("s2")  # ConfigError listing the registered names if unknown

This module is on the bottom floor (it imports only `config.errors`): registries are defined where
the code that uses them lives, and their entries register from the floors above at import time
(techniques/, training/, data/). So that no lookup can miss an entry whose module nobody imported
yet, every lookup first imports `PLUGINS` (once): `megatron_moe/plugins.py` imports every module
that registers something. It is a plugin load by name (`importlib`), not a static import, so the
static import graph stays acyclic (tests/unit/test_layout.py checks both).
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, Generic, Iterator, Sequence, Tuple, TypeVar

from megatron_moe.config.errors import ConfigError

T = TypeVar("T")

PLUGINS = ("megatron_moe.plugins",)  # the modules whose import registers every entry and hook
_plugins = {"state": "unloaded"}  # unloaded -> loading -> loaded


def load_plugins() -> None:
    """Import `PLUGINS` once. A lookup made while they are being imported (an import-time lookup)
    sees the entries registered so far."""
    if _plugins["state"] != "unloaded":
        return
    _plugins["state"] = "loading"
    try:
        for name in PLUGINS:
            importlib.import_module(name)
    except BaseException:
        _plugins["state"] = "unloaded"
        raise
    _plugins["state"] = "loaded"


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
        load_plugins()
        if name not in self._entries:
            raise ConfigError(f"{self.key}={name!r} is not registered; choose one of {self.names()}")
        return self._entries[name]

    def names(self) -> list:
        load_plugins()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        load_plugins()
        return name in self._entries


class Hooks(Generic[T]):
    """Named hooks run in a fixed `order`. Every name of `order` must be registered once the
    plugins are loaded (a missing one is an internal error, never a silently skipped hook)."""

    def __init__(self, what: str, order: Sequence[str]):
        self.what, self.order = what, tuple(order)
        self._hooks: Registry[T] = Registry(what)

    def register(self, name: str) -> Callable[[T], T]:
        if name not in self.order:
            raise ValueError(f"{self.what}: '{name}' is not one of {self.order}")
        return self._hooks.register(name)

    def get(self, name: str) -> T:
        """The hook registered as `name` (one of `order`)."""
        return dict(self.items((name,)))[name]

    def items(self, names: Sequence[str] = ()) -> Iterator[Tuple[str, T]]:
        """(name, hook) for `names` (default: all), in `order`."""
        load_plugins()
        for name in self.order:
            if names and name not in names:
                continue
            if name not in self._hooks._entries:
                raise RuntimeError(f"{self.what}: nothing registered '{name}' "
                                   "(is its module in megatron_moe/plugins.py?)")
            yield name, self._hooks._entries[name]
