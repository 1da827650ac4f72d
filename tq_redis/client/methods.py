"""Client methods made from an operation, so that a long parameter list is written once.

An operation of :mod:`tq_redis.ops` takes the client's context and then exactly the arguments of
the public method that runs it (keyword-only ones included). :func:`blocking` makes the
``TransferQueueClient`` method and :func:`awaiting` the ``AsyncTransferQueueClient`` coroutine
from it. Both take the operation's parameters less the context, and return its result:

* type checkers and IDEs see them through the builders' types (a ``ParamSpec`` for the
  parameters, :data:`~tq_redis.ops.context.Op`'s result type for the return), so
  ``client.put(td, tiemout=5)`` is flagged as it would be for a method written out;
* at run time ``inspect.signature`` and ``help`` show the same, and a call that breaks the
  signature raises ``TypeError`` from the operation, before it runs.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from tq_redis.ops.context import Context, Op

__all__ = ["awaiting", "blocking", "method_signature"]

P = ParamSpec("P")
R = TypeVar("R")


def method_signature(build: Callable[..., Any]) -> inspect.Signature:
    """``(self, <build's parameters less the context>) -> <the result type of build's Op>``."""
    signature = inspect.signature(build)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += list(signature.parameters.values())[1:]
    return inspect.Signature(params, return_annotation=_result_annotation(signature.return_annotation))


def _result_annotation(annotation: Any) -> Any:
    """What an operation annotated ``-> Op[X]`` returns: ``X`` (a string under postponed annotations)."""
    if isinstance(annotation, str):
        return annotation[3:-1] if annotation.startswith("Op[") and annotation.endswith("]") else annotation
    args = typing.get_args(annotation)
    return args[2] if len(args) == 3 else annotation


def _dress(method: Any, name: str, doc: str, build: Callable[..., Any]) -> None:
    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    method.__signature__ = method_signature(build)


def blocking(build: Callable[Concatenate[Context, P], Op[R]], *, doc: str) -> Callable[Concatenate[Any, P], R]:
    """The method running ``build`` with the client's context through ``self.run`` (blocking)."""

    def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.run(build(self.context, *args, **kwargs))

    _dress(method, build.__name__, doc, build)
    return method


def awaiting(
    build: Callable[Concatenate[Context, P], Op[R]], *, doc: str
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]:
    """The ``async_`` coroutine method running ``build`` with the client's context on this loop."""

    async def method(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self.arun(build(self.context, *args, **kwargs))

    _dress(method, f"async_{build.__name__}", doc, build)
    return method
