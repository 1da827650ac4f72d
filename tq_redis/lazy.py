"""Public names a package gathers from its modules, imported on first use (PEP 562).

A package ``__init__`` that lists its public names as ``{name: "module.path"}`` gets its module
``__getattr__`` and ``__dir__`` from :func:`lazy_names`, so importing one module of the package
imports no other (and a process that needs no tensors never imports torch). Type checkers see the
package's ``if TYPE_CHECKING:`` imports of the same names instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the module whose globals are ``namespace``: a name of
    ``exports`` is imported from its module when first asked for, then kept in ``namespace``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
