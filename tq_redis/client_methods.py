"""Client methods made from an operation, so that a long parameter list is written once.

An operation of :mod:`tq_redis.ops` takes the client's context and then exactly the arguments of
the public method that runs it. :func:`blocking` makes the ``TransferQueueClient`` method and
:func:`awaiting` the ``AsyncTransferQueueClient`` coroutine from it: both take the operation's
parameters less the context (``inspect.signature`` and ``help`` show them), the ones from
``keyword_only`` on made keyword-only (tq-redis's additions to the reference's parameters). A call
that breaks that signature raises ``TypeError`` as for any method, before the operation runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["awaiting", "blocking", "method_signature"]

Build = Callable[..., Any]  # an operation: (context, *arguments) -> generator of effects


def method_signature(build: Build, keyword_only: str | None, returns: str) -> inspect.Signature:
    """``(self, <build's parameters less the context>) -> returns``; parameters from
    ``keyword_only`` on become keyword-only."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    for param in list(inspect.signature(build).parameters.values())[1:]:
        if param.name == keyword_only:
            kind = inspect.Parameter.KEYWORD_ONLY
        params.append(param.replace(kind=kind))
    return inspect.Signature(params, return_annotation=returns)


def _positional_limit(signature: inspect.Signature) -> int:
    """How many arguments after ``self`` may be given by position."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in list(signature.parameters.values())[1:] if p.kind in kinds)


def _checked(name: str, limit: int, args: tuple) -> None:
    # Python checks names, duplicates and missing arguments when the operation is called; what it
    # cannot know is that the method made some parameters keyword-only. (Cheaper than
    # Signature.bind, which costs a tiny get_meta ~25 us.)
    if len(args) > limit:
        raise TypeError(f"{name}() takes {limit} positional argument(s) but {len(args)} were given")


def _dress(method: Any, name: str, doc: str, signature: inspect.Signature) -> Any:
    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    method.__signature__ = signature
    return method


def blocking(build: Build, *, doc: str, returns: str, keyword_only: str | None = None) -> Callable[..., Any]:
    """The method running ``build`` with the client's context through ``self.run`` (blocking)."""
    signature = method_signature(build, keyword_only, returns)
    name, limit = build.__name__, _positional_limit(signature)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        _checked(name, limit, args)
        return self.run(build(self.context, *args, **kwargs))

    return _dress(method, name, doc, signature)


def awaiting(build: Build, *, doc: str, returns: str, keyword_only: str | None = None) -> Callable[..., Any]:
    """The ``async_`` coroutine method running ``build`` with the client's context on this loop."""
    signature = method_signature(build, keyword_only, returns)
    name, limit = f"async_{build.__name__}", _positional_limit(signature)

    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        _checked(name, limit, args)
        return await self.arun(build(self.context, *args, **kwargs))

    return _dress(method, name, doc, signature)
