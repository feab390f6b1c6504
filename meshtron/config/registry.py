"""Names a config field may take that map to code: built-in ones (listed here, so that checking a config
needs no import of the code), ones registered in-process, and plugins: entry points of installed
distributions, imported only when a config asks for their name.

The code itself registers from the floor it lives on (nn/moe/router.py registers the routers); config/
only knows the names, so it sits below every floor that registers.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any


class Registry:
    def __init__(self, field: str, entry_point_group: str, builtin: tuple[str, ...], how_to_add: str):
        self.field, self.entry_point_group, self.builtin, self.how_to_add = field, entry_point_group, builtin, how_to_add
        self.registered: dict[str, Any] = {}

    def register(self, name: str, obj: Any) -> None:
        self.registered[name] = obj

    def plugins(self) -> dict[str, metadata.EntryPoint]:
        """Entry points of the group in the installed distributions (nothing imported)."""
        found: dict[str, metadata.EntryPoint] = {}
        for ep in metadata.entry_points(group=self.entry_point_group):
            found.setdefault(ep.name, ep)
        return found

    def names(self) -> tuple[list[str], list[str]]:
        """(built-in and registered names, names only an entry point provides so far), each sorted."""
        known = set(self.builtin) | set(self.registered)
        return sorted(known), sorted(set(self.plugins()) - known)

    def knows(self, name: str) -> bool:
        known, plugins = self.names()
        return name in known or name in plugins

    def unknown_message(self, name: str) -> str:
        known, plugins = self.names()
        return (f"{self.field}: {name!r} is not allowed; registered: {', '.join(known)}; entry points in group "
                f"{self.entry_point_group}: {', '.join(plugins) or 'none'} ({self.how_to_add})")

    def load(self, name: str, check: Callable[[Any, str], None]) -> Any:
        """The object registered as `name`, importing its entry point the first time; ValueError (one line)
        for an unknown name or a plugin that cannot be imported or fails `check(obj, name)`."""
        if name in self.registered:
            return self.registered[name]
        ep = self.plugins().get(name)
        if ep is None:
            raise ValueError(self.unknown_message(name))
        try:
            obj = ep.load()
            check(obj, name)
        except Exception as e:  # an import error or a bad object in the user's package: one line
            raise ValueError(f"{self.field}: entry point {name} = {ep.value} (group {self.entry_point_group}) "
                             f"cannot be used: {type(e).__name__}: {e}") from None
        self.registered[name] = obj
        return obj


ROUTER_REGISTRY = Registry("model.moe_router_type", "meshtron.routers", builtin=("topk",),
                           how_to_add="declare one in your package, or call meshtron.nn.moe.register_router")
