"""Markers for the public API: what `meshtron check-api` holds stable, and how a name leaves it.

The public API is every public name (no leading underscore, or listed in a module's `__all__`) of
every module under `meshtron`, except `meshtron.experimental`. Three decorators adjust that:

    @internal_api        public-looking, but free to change (plumbing shared between packages)
    @experimental_api    may change or go away in any release
    @deprecated("0.2", "0.4", "meshtron.x.new_name")   still works, warns on use, may go in 0.4

`check-api` reads these decorators from the source, so they must be applied by name
(`@internal_api` or `@api.internal_api`), not through another variable.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

STABILITY_ATTR = "__meshtron_api__"


def internal_api(obj: T) -> T:
    """Exempt a function or class from the API check: callers outside meshtron must not rely on it."""
    setattr(obj, STABILITY_ATTR, "internal")
    return obj


def experimental_api(obj: T) -> T:
    """Exempt a function or class from the API check: it may change or disappear in any release."""
    setattr(obj, STABILITY_ATTR, "experimental")
    return obj


def stability(obj: Any) -> str:
    """'internal', 'experimental', 'deprecated' or 'stable', as set by the decorators above."""
    return getattr(obj, STABILITY_ATTR, "stable")


def deprecated(version: str, removal_version: str, alternative: str) -> Callable[[T], T]:
    """Mark a function or class as deprecated since `version`, to be removed in `removal_version`.

    Calling the function (or instantiating the class) emits a `DeprecationWarning` that names the
    alternative. From `removal_version` on, `check-api` accepts the name's removal.
    """
    for name, value in (("version", version), ("removal_version", removal_version), ("alternative", alternative)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"deprecated(): {name} must be a non-empty string, got {value!r}")

    def mark(obj: T) -> T:
        qualname = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
        message = (f"{qualname} is deprecated since meshtron {version} and will be removed in {removal_version}; "
                   f"use {alternative} instead")
        if inspect.isclass(obj):
            original_init = obj.__init__

            @functools.wraps(original_init)
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                warnings.warn(message, DeprecationWarning, stacklevel=2)
                original_init(self, *args, **kwargs)

            obj.__init__ = __init__  # type: ignore[misc]
            wrapped: Any = obj
        elif callable(obj):
            func = obj

            @functools.wraps(func)
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                warnings.warn(message, DeprecationWarning, stacklevel=2)
                return func(*args, **kwargs)
        else:
            raise TypeError(f"deprecated() applies to functions and classes, not {type(obj).__name__}")
        setattr(wrapped, STABILITY_ATTR, "deprecated")
        wrapped.__deprecated__ = message  # the attribute PEP 702 (`warnings.deprecated`) sets
        return wrapped

    return mark
