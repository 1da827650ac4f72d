"""Samplers: which ready samples a ``get_meta(mode="fetch")`` call hands out.

The interface is the reference system's: ``BaseSampler.sample(ready_indexes, batch_size, **kw) ->
(sampled, consumed)``. The five built-ins run **inside Redis**, in the claim script
(``lua/claim.lua``, rules in ``lua/includes/samplers.lua``), so a claim is one atomic round trip
whatever the partition size:

- :class:`SequentialSampler` -- the first ready samples in id order (the default).
- :class:`GRPOGroupNSampler` -- only whole groups of ``n_samples_per_prompt``. A group is the n
  rows of one prompt: the rows sharing a ``uid`` tag when the partition has that tag, else n
  rows aligned to the start of the ``put`` that inserted the prompt repeated n times. A run of
  ready ids that straddles two prompts is never a group (the reference's run-finding can
  return one).
- :class:`RankAwareSampler` -- every rank of one data-parallel group that asks with the same
  ``dp_rank`` (the group's id) and ``batch_index`` gets the same batch, in any arrival order.
- :class:`PrioritizedSampler` -- ``batch_size`` ready samples drawn without replacement in
  proportion to ``priority ** alpha`` (the ``priority`` tag; ``update_priority`` writes it).
- :class:`SeqlenBalancedSampler` -- the first rank to ask for a ``batch_index`` takes
  ``batch_size * dp_size`` samples in whole groups and splits them into ``dp_size`` parts with
  equal group counts, balanced by the ``total_lengths`` tag (Karmarkar-Karp); rank ``dp_rank``
  gets its part.

Two ``sampling_config`` keys of ours combine with the built-ins (groups stay whole):
``max_tokens`` (token-budget dynamic batching: as many ready samples, up to ``batch_size``, as
fit the budget by ``total_lengths`` -- the one case where a batch may be smaller) and
``min_policy_version`` (only samples tagged ``policy_version >= v``; with ``drop_stale=True``
older ones are put aside for the task, in its poison set, so they stop counting -- kept ones
are scanned past by every later claim, so drop them when they will never be wanted). A sample
lacking the tag a key needs (``total_lengths``, ``policy_version``) is not handed out under it.
With a lease, ``max_deliveries`` (in ``sampling_config`` or as a ``get_meta`` argument) puts a
sample delivered that often aside in the same poison set instead of handing it out again.
``max_times_sampled`` (replay; fetch mode, sequential and GRPO samplers) hands a sample to the
task up to that many times instead of once; it then stays consumed.

Any other :class:`BaseSampler` -- a user's subclass or an instance of one -- runs **in the
client**: it gets the full ready list, chooses, and the client claims the choice with a script
that succeeds only if every chosen id is still free, retrying with a fresh ready list on
conflict.

``sample()`` of a built-in class also works stand-alone on a plain list (as in the reference);
there GRPO groups are the aligned blocks ``[k*n, (k+1)*n)``, which is what the in-Redis rule
yields when every ``put`` inserts a multiple of n samples.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tq_redis.errors import PartitioningError, SamplerError

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "PrioritizedSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "is_builtin",
    "get_seqlen_balanced_partitions",
    "karmarkar_karp",
    "PartitioningError",
    "resolve_sampler",
    "sampler_from_spec",
    "sampler_spec",
]

class BaseSampler(ABC):
    """Chooses which ready samples a fetch hands out and which it marks consumed.

    Subclass it and implement :meth:`sample` to run your own policy in the client; pass the
    class or an instance as ``sampling_config={"sampler": ...}`` or as ``sampler`` in ``init``.
    ``sample`` receives the ready ids (ascending), the batch size, ``task_name=``,
    ``partition_id=`` and every other ``sampling_config`` entry as keyword arguments.
    """

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """Return ``(sampled, consumed)``: the ids handed out, and the ids marked consumed for
        the task (usually the same). Return two empty lists when nothing suitable is ready."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)

    def params(self) -> dict[str, Any]:
        """Constructor parameters, so a built-in can be described in the namespace config."""
        return {}

    # -- reference compatibility: per-process caches of earlier choices ----------------------

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: dict[str, Any] | None = None
    ) -> bool:
        """Whether this process cached a choice for ``(partition, task, dp_rank, batch_index)``."""
        cfg = sampling_config or {}
        dp_rank = cfg.get("dp_rank")
        if dp_rank is None:
            return False
        states = self._states.get(partition_id, {}).get(task_name, {})
        return dp_rank in states and cfg.get("batch_index") in states[dp_rank]

    def clear_cache(self, partition_id: str) -> None:
        """Forget this process's cached choices for a partition."""
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        """Serializable state of the sampler."""
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`save_checkpoint` returned."""
        self._states = state["_states"]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


class SequentialSampler(BaseSampler):
    """The first ``batch_size`` ready samples in id order (in Redis: never a partial batch)."""

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """The first ``batch_size`` of ``ready_indexes`` (all of them if fewer)."""
        chosen = list(ready_indexes[:batch_size])
        return chosen, list(chosen)


def check_alpha(value: Any) -> float:
    """``value`` as PrioritizedSampler's exponent: a finite number >= 0 (else a SamplerError)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise SamplerError(f"alpha (the priority exponent) must be a finite number >= 0, got {value!r}")
    return float(value)


class PrioritizedSampler(BaseSampler):
    """``batch_size`` ready samples drawn without replacement, each draw in proportion to
    ``priority ** alpha`` among the samples left (``alpha=0``: uniform).

    In Redis (``get_meta``) a sample's priority is its ``priority`` tag, which
    :meth:`~tq_redis.TransferQueueClient.update_priority` (or ``set_custom_meta``) writes; a sample
    without one has priority 1, and one whose priority is not a positive number is never drawn.
    ``sampling_config["alpha"]`` overrides the constructor's. The draw examines every ready
    sample of the task (its cost grows with them, unlike the other built-ins). :meth:`sample`, on
    a bare list, takes the priorities as ``priorities={id: priority}``.
    """

    def __init__(self, alpha: float = 1.0) -> None:
        super().__init__()
        self.alpha = check_alpha(alpha)

    def params(self) -> dict[str, Any]:
        return {"alpha": self.alpha}

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """``batch_size`` of ``ready_indexes`` drawn by ``kwargs["priorities"]`` (default 1 each);
        nothing when fewer than ``batch_size`` have a positive priority."""
        priorities = kwargs.get("priorities") or {}
        alpha = check_alpha(kwargs.get("alpha", self.alpha))
        keyed = []
        for i in ready_indexes:
            p = float(priorities.get(i, 1.0))
            if p > 0:
                u = 1.0 - random.random()  # in (0, 1]
                keyed.append((math.log(u) / p**alpha, i))
        if len(keyed) < batch_size:
            return [], []
        chosen = sorted(i for _, i in heapq.nlargest(batch_size, keyed))
        return chosen, list(chosen)


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SamplerError(f"{name} must be positive, got {value!r}; give a positive integer")
    return value


def _consecutive_groups(ready_indexes: list[int], n: int, groups_wanted: int) -> list[int]:
    """The first ``groups_wanted`` runs of ``n`` consecutive ids in the sorted ready ids, scanning
    left to right and skipping past each run found (the reference system's rule)."""
    ready = sorted(ready_indexes)
    out: list[int] = []
    found = i = 0
    while found < groups_wanted and i + n <= len(ready):
        if ready[i + n - 1] - ready[i] == n - 1 and len(set(ready[i:i + n])) == n:
            out.extend(ready[i:i + n])
            found += 1
            i += n
        else:
            i += 1
    return out if found == groups_wanted else []


class GRPOGroupNSampler(BaseSampler):
    """Only whole groups of ``n_samples_per_prompt`` samples (the n responses of one prompt).

    ``batch_size`` must be a multiple of n. In Redis (``get_meta``) a group is the rows sharing
    a ``uid`` tag (when the partition has that tag) or n rows aligned to the start of the ``put``
    that inserted them, so a group never straddles two prompts;
    ``sampling_config["n_samples_per_prompt"]`` overrides the constructor's n. :meth:`sample`,
    called on a bare list of ids that carries no group information, finds runs of n consecutive
    ids as the reference does.
    """

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        self.n_samples_per_prompt = _check_positive("n_samples_per_prompt", n_samples_per_prompt)

    def params(self) -> dict[str, Any]:
        return {"n_samples_per_prompt": self.n_samples_per_prompt}

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """``batch_size / n`` runs of n consecutive ready ids, or two empty lists if too few
        (:class:`SeqlenBalancedSampler`: this rank's part of a balanced choice, see there)."""
        return self._choose(ready_indexes, batch_size, task_name, partition_id, kwargs)

    def _choose(
        self, ready_indexes: list[int], batch_size: int, task_name: str, partition_id: str, options: dict[str, Any]
    ) -> tuple[list[int], list[int]]:
        """What :meth:`sample` returns (subclasses choose differently, with the same parameters)."""
        n = self.n_samples_per_prompt
        if batch_size % n:
            raise SamplerError(f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})")
        chosen = _consecutive_groups(ready_indexes, n, batch_size // n)
        return chosen, list(chosen)


class RankAwareSampler(BaseSampler):
    """Every rank of one data-parallel group gets the same batch.

    Ranks of a group pass the group's id as ``dp_rank`` and a step counter as ``batch_index``;
    the first of them to ask selects (sequentially, or in whole groups when
    ``n_samples_per_prompt`` is given), the others get the same ids back, in whatever order
    they arrive. Different groups never share a sample. In Redis the choice is stored under
    ``<ns>:{<partition>}:rank:<task>:<dp_rank>:<batch_index>`` for ``cache_ttl_s`` seconds.
    """

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        dp_rank: int = 0,
        batch_index: int = 0,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """The cached choice for ``(partition, task, dp_rank, batch_index)``, else the first
        ``batch_size`` ready ids (cached), else two empty lists."""
        if dp_rank < 0:
            raise SamplerError(
                f"dp_rank {dp_rank} must be greater than or equal to 0; pass the data-parallel group's id"
            )
        states = self._states.setdefault(partition_id, {}).setdefault(task_name, {}).setdefault(dp_rank, {})
        if batch_index in states:
            chosen = states[batch_index]
            return list(chosen), list(chosen)
        if len(ready_indexes) < batch_size:
            return [], []
        chosen = list(ready_indexes[:batch_size])
        states[batch_index] = chosen
        return list(chosen), list(chosen)


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Whole groups balanced by ``total_lengths`` across ``dp_size`` data-parallel ranks.

    ``batch_size`` is per rank. The first rank to ask for a ``batch_index`` takes
    ``batch_size * dp_size`` samples in whole groups of ``n_samples_per_prompt`` and splits the
    groups into ``dp_size`` parts of equal count whose summed ``total_lengths`` are balanced
    (Karmarkar-Karp, as the reference); rank ``dp_rank`` (0 .. dp_size-1) gets part ``dp_rank``.
    A sample without a ``total_lengths`` tag weighs 1.
    """

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt)
        self.dp_size = _check_positive("dp_size", dp_size)
        self._balanced_cache: dict[tuple, list[list[int]]] = {}

    def params(self) -> dict[str, Any]:
        return {"n_samples_per_prompt": self.n_samples_per_prompt, "dp_size": self.dp_size}

    def _choose(
        self, ready_indexes: list[int], batch_size: int, task_name: str, partition_id: str, options: dict[str, Any]
    ) -> tuple[list[int], list[int]]:
        """:meth:`sample` returns rank ``dp_rank``'s part of the balanced global batch for
        ``batch_index``; ``total_lengths`` maps id -> length (default 1): all three are keyword
        arguments of ``sample``.

        As in the reference, a ``dp_rank`` outside ``[0, dp_size)`` gets two empty lists here
        (``get_meta`` refuses it with a ``SamplerError`` instead: a rank that would never get data
        is a configuration error there). The parts of every rank are cached in ``_states``.
        """
        dp_rank = int(options.get("dp_rank", 0))
        batch_index = options.get("batch_index", 0)
        if dp_rank < 0:
            raise SamplerError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        key = (partition_id, task_name, batch_index)
        parts = self._balanced_cache.get(key)
        if parts is None:
            chosen, _ = super()._choose(ready_indexes, batch_size * self.dp_size, task_name, partition_id, {})
            if not chosen:
                return [], []
            lengths = options.get("total_lengths") or {}
            parts = balance_groups(chosen, self.n_samples_per_prompt, self.dp_size, lengths)
            self._balanced_cache[key] = parts
            states = self._states.setdefault(partition_id, {}).setdefault(task_name, {})
            for rank, part in enumerate(parts):
                states.setdefault(rank, {})[batch_index] = (list(part), list(part))
        if dp_rank >= len(parts):
            return [], []
        mine = parts[dp_rank]
        return list(mine), list(mine)

    def clear_cache(self, partition_id: str) -> None:
        super().clear_cache(partition_id)
        for key in [k for k in self._balanced_cache if k[0] == partition_id]:
            del self._balanced_cache[key]


# ------------------------------------------------------------------ balancing


@dataclass
class _Set:
    sum: float
    items: list[int]
    low: int


def _set_desc(s: _Set) -> tuple[float, int, int]:
    # sets are ordered by (sum, item count, smallest item); a state keeps its largest first
    return (-s.sum, -len(s.items), -s.low)


class _State:
    __slots__ = ("sets", "spread", "low")

    def __init__(self, sets: list[_Set]) -> None:
        self.sets = sets
        self.settle()

    def settle(self) -> None:
        self.sets.sort(key=_set_desc)
        self.spread = self.sets[0].sum - self.sets[-1].sum
        self.low = min(s.low for s in self.sets)

    def __lt__(self, other: _State) -> bool:  # heapq pops the state to merge first
        if self.spread != other.spread:
            return self.spread > other.spread
        a, b = _set_desc(self.sets[0]), _set_desc(other.sets[0])
        if a != b:
            return a < b
        return self.low < other.low


_NO_ITEM = sys.maxsize  # ``low`` of a set that holds no item yet


def karmarkar_karp(weights: list[float], k: int, equal_size: bool = True) -> list[list[int]]:
    """Split items ``0..len(weights)-1`` into ``k`` parts with balanced sums.

    Largest differencing (Karmarkar-Karp) with the tie-breaking the claim script uses, so the
    result equals the in-Redis one. With ``equal_size`` (the default) every part gets the same
    number of items and ``len(weights)`` must be a multiple of ``k``; without it only the sums
    are balanced. Returns the parts heaviest first, each ascending.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise PartitioningError(f"k_partitions must be a positive integer, got {k!r}")
    if equal_size and len(weights) % k:
        raise PartitioningError(
            f"{len(weights)} items cannot be split into {k} parts of equal size; give a multiple of {k} "
            f"items or pass equal_size=False"
        )
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_size:
        heap = [
            _State([_Set(weights[i], [i], i) for i in order[start : start + k]]) for start in range(0, len(order), k)
        ]
    else:  # each item alone in one set of a k-set state
        heap = [_State([_Set(weights[i], [i], i)] + [_Set(0, [], _NO_ITEM) for _ in range(k - 1)]) for i in order]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        for i in range(k):
            s, t = a.sets[i], b.sets[k - 1 - i]
            s.items.extend(t.items)
            s.sum += t.sum
            s.low = min(s.low, t.low)
        a.settle()
        heapq.heappush(heap, a)
    return [sorted(s.items) for s in heap[0].sets] if heap else [[] for _ in range(k)]


def get_seqlen_balanced_partitions(seqlen_list: list[float], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Indexes of ``seqlen_list`` split into ``k_partitions`` non-empty parts with balanced sums.

    The reference's (and verl's) helper: each part ascending; with ``equal_size`` every part has
    the same number of items. Raises :class:`PartitioningError` (an ``AssertionError``, as the
    reference's checks are) when there are fewer items than parts, when ``equal_size`` is asked
    of a count that ``k_partitions`` does not divide, or when a part would be empty.
    """
    if len(seqlen_list) < k_partitions:
        raise PartitioningError(
            f"number of items [{len(seqlen_list)}] < k_partitions [{k_partitions}]; "
            f"ask for at most {len(seqlen_list)} partitions"
        )
    parts = karmarkar_karp(list(seqlen_list), k_partitions, equal_size=equal_size)
    empty = [i for i, part in enumerate(parts) if not part]
    if empty:
        raise PartitioningError(
            f"partitions {empty} of {k_partitions} came out empty for {len(seqlen_list)} items; "
            f"use fewer partitions or equal_size=True"
        )
    return parts


def balance_groups(ids: list[int], n: int, k: int, lengths: dict[int, float]) -> list[list[int]]:
    """Split ``ids`` (whole groups of ``n`` in order) into ``k`` balanced parts of sample ids."""
    groups = [ids[g * n : (g + 1) * n] for g in range(len(ids) // n)]
    weights = [sum(lengths.get(i, 1) for i in group) for group in groups]
    return [[i for g in part for i in groups[g]] for part in karmarkar_karp(weights, k)]


# ------------------------------------------------------------------ dispatch

_BUILTINS: dict[str, type[BaseSampler]] = {
    "SequentialSampler": SequentialSampler,
    "GRPOGroupNSampler": GRPOGroupNSampler,
    "RankAwareSampler": RankAwareSampler,
    "SeqlenBalancedSampler": SeqlenBalancedSampler,
    "PrioritizedSampler": PrioritizedSampler,
}
_BUILTIN_CLASSES = frozenset(_BUILTINS.values())


def resolve_sampler(spec: Any) -> BaseSampler:
    """A sampler instance from a built-in's name, a :class:`BaseSampler` subclass or an instance."""
    if spec is None:
        return SequentialSampler()
    if isinstance(spec, BaseSampler):
        return spec
    if isinstance(spec, str):
        cls = _BUILTINS.get(spec)
        if cls is None:
            raise SamplerError(
                f"unknown sampler {spec!r}; built-in samplers are {sorted(_BUILTINS)} "
                f"(pass your own BaseSampler subclass or instance instead of a name)"
            )
        return cls()
    if isinstance(spec, type) and issubclass(spec, BaseSampler):
        try:
            return spec()
        except TypeError as exc:
            raise SamplerError(
                f"cannot build sampler {spec.__name__}() without arguments ({exc}); pass an instance"
            ) from exc
    raise SamplerError(
        f"sampler must be a built-in's name, a BaseSampler subclass or an instance, got {type(spec).__name__}"
    )


def is_builtin(sampler: BaseSampler) -> bool:
    """True for an instance of exactly one of the built-in classes (those run inside Redis);
    a subclass of a built-in overrides ``sample`` and runs in the client."""
    return type(sampler) in _BUILTIN_CLASSES


def sampler_spec(sampler: Any) -> str | dict[str, Any]:
    """What the namespace config records for a default sampler: a built-in's name, or
    ``{"name": ..., "params": {...}}`` for a built-in instance with parameters. A user sampler
    is recorded by class name (other processes must pass it per call)."""
    if isinstance(sampler, str):
        return sampler
    inst = resolve_sampler(sampler)
    params = inst.params()
    name = type(inst).__name__
    return {"name": name, "params": params} if params and is_builtin(inst) else name


def sampler_from_spec(raw: str | bytes | None) -> BaseSampler:
    """The sampler the namespace config (``<ns>:config`` field ``sampler``, JSON) describes."""
    if raw is None:
        return SequentialSampler()
    value = json.loads(raw)
    if isinstance(value, dict):
        name, params = value.get("name"), value.get("params") or {}
    else:
        name, params = value, {}
    cls = _BUILTINS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise SamplerError(
            f"the namespace's default sampler {name!r} is not built in, so this process cannot rebuild it; "
            f"pass it per call: sampling_config={{'sampler': {name}(...)}}"
        )
    try:
        return cls(**params)
    except (TypeError, SamplerError) as exc:
        raise SamplerError(f"namespace default sampler {value!r} is invalid: {exc}") from exc
