"""The effects an operation yields, and nothing else: what to do, not how.

Every client operation (:mod:`tq_redis.ops`) is a generator that yields these values and receives
their results: a Redis command (:class:`Cmd`), a call of a function of the Lua library
(:class:`FCall`), several in one round trip (:class:`Pipe`), blocking store I/O (:class:`Offload`),
a backoff (:class:`Pause`), a wait on an event stream or a token list (:class:`Wait`,
:class:`WaitToken`, :class:`WaitThenCall`), and a question to durable mode (:class:`Unconfirmed`).
The drivers in :mod:`tq_redis.client.driver` carry them out, blocking or with asyncio, so each
operation is written once for both clients; tests can run an operation against a fake by answering
its effects.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Cmd:
    """A plain Redis command."""

    args: tuple


@dataclass(frozen=True, slots=True)
class FCall:
    """Call a function of the tq_redis library (``FCALL tq_<name>``)."""

    name: str
    keys: tuple
    args: tuple


@dataclass(frozen=True, slots=True)
class Pipe:
    """Several commands / function calls in one round trip (not a transaction)."""

    calls: tuple


@dataclass(frozen=True, slots=True)
class Offload:
    """Blocking work (store I/O): run inline by the sync driver, in a thread by the async one."""

    fn: Callable[..., Any]
    args: tuple


@dataclass(frozen=True, slots=True)
class Pause:
    """Sleep ``seconds`` (a retry's backoff); the async drivers yield to the event loop meanwhile."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until an entry newer than ``last_id`` is added to ``stream`` or ``timeout_s`` passes."""

    stream: str
    last_id: str
    timeout_s: float


@dataclass(frozen=True)
class WaitToken:
    """Block until a token can be popped from the list ``key`` (``BLPOP``) or ``timeout_s`` passes.

    Returns whether a token was taken.
    """

    key: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class WaitThenCall:
    """``wait`` (a :class:`WaitToken`), then ``call`` the moment it ends, whether it took a token
    or timed out. Returns ``(took_token, call_reply)``.

    A blocking client's lane sends both in one write: the server queues the call behind the
    blocked ``BLPOP`` on that connection and runs it as soon as the wait ends, so the woken
    consumer's claim costs no round trip of its own (and no wake-up of the client in between).
    Other clients run the two one after the other. The call is built before the wait: its
    arguments must still hold after it (a claim's clock argument is then as old as the wait).
    """

    wait: WaitToken
    call: FCall


@dataclass(frozen=True, slots=True)
class Unconfirmed:
    """What durable mode found unconfirmed so far in this operation: the list of shortfalls
    (empty when every write was confirmed, and always without durable mode). No round trip."""


Operation = Generator[Any, Any, Any]
