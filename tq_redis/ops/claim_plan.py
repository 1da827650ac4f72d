"""The claim plan: how ``lua/claim.lua`` runs a built-in sampler (its Lua name, the batch size and
the options the script reads), built from the sampler and the call's ``sampling_config``.

This is the claim script's argument list seen from Python, so a claim option touches this module
and the script only (``lua/claim.lua``, whose sampler rules are in ``lua/includes/samplers.lua``);
:mod:`tq_redis.ops.transitions` puts a plan into the script's ARGV and :mod:`tq_redis.ops.claim`
builds one per claim. The sampler classes themselves, which users import and subclass, stay in
:mod:`tq_redis.samplers`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tq_redis.errors import SamplerError
from tq_redis.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    PrioritizedSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
    check_alpha,
)

__all__ = ["DEFAULT_CACHE_TTL_S", "LUA_NAMES", "SamplerPlan", "builtin_plan"]

#: default lifetime of a stored RankAware / SeqlenBalanced choice (seconds)
DEFAULT_CACHE_TTL_S = 3600.0

#: the name ``lua/claim.lua`` knows each built-in sampler class by (its ``sampler`` argument)
LUA_NAMES: dict[type[BaseSampler], str] = {
    SequentialSampler: "sequential",
    GRPOGroupNSampler: "grpo",
    RankAwareSampler: "rank",
    SeqlenBalancedSampler: "balance",
    PrioritizedSampler: "priority",
}


@dataclass(frozen=True)
class SamplerPlan:
    """How the claim script runs a built-in: its Lua name, the batch size and the options."""

    kind: str
    batch_size: int
    options: tuple[tuple[str, str], ...]

    def args(self) -> tuple[Any, ...]:
        """``sampler, nopts, name, value, ...`` as ``lua/claim.lua`` takes them."""
        flat = [x for pair in self.options for x in pair]
        return (self.kind, len(self.options), *flat)


def _opt_int(config: dict[str, Any], key: str, default: int | None, minimum: int) -> int | None:
    """``config[key]`` (else ``default``) checked to be an integer >= ``minimum``; None stays None."""
    value = config.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SamplerError(f"sampling_config[{key!r}] must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _number_text(value: float) -> str:
    """A number as the script parses it (an integer without a decimal point)."""
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


def builtin_plan(sampler: BaseSampler, config: dict[str, Any], batch_size: int) -> SamplerPlan:
    """Validate ``sampling_config`` for a built-in and turn it into claim-script options.

    ``sampler`` is an instance of exactly one of the built-in classes
    (:func:`tq_redis.samplers.is_builtin`).

    Raises:
        SamplerError: a key has the wrong type or range, the batch size does not split into
            whole groups, or a required key (RankAware: ``dp_rank``, ``batch_index``) is missing.
    """
    kind = LUA_NAMES[type(sampler)]
    opts: dict[str, str] = {}
    n = 1
    if kind in ("grpo", "balance"):
        n = _opt_int(config, "n_samples_per_prompt", sampler.n_samples_per_prompt, 1)  # type: ignore[attr-defined]
    elif kind == "rank":
        n = _opt_int(config, "n_samples_per_prompt", 1, 1)
    if n and n > 1:
        if batch_size % n:
            raise SamplerError(
                f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n}): "
                f"{type(sampler).__name__} hands out whole groups only"
            )
        opts["n"] = str(n)
    max_tokens = _opt_int(config, "max_tokens", None, 1)
    if max_tokens is not None:
        if kind == "balance":
            raise SamplerError("max_tokens does not combine with SeqlenBalancedSampler (it fixes the batch size)")
        opts["max_tokens"] = str(max_tokens)
    version = config.get("min_policy_version")
    if version is not None:
        if isinstance(version, bool) or not isinstance(version, int | float):
            raise SamplerError(f"sampling_config['min_policy_version'] must be a number, got {version!r}")
        opts["min_version"] = _number_text(version)
    if config.get("drop_stale"):
        if version is None:
            raise SamplerError("drop_stale=True needs min_policy_version (which samples are stale)")
        opts["drop_stale"] = "1"
    if kind == "priority":
        for key in ("n_samples_per_prompt", "max_tokens", "min_policy_version"):
            if config.get(key) is not None:
                raise SamplerError(f"sampling_config[{key!r}] does not combine with PrioritizedSampler")
        opts["alpha"] = repr(check_alpha(config.get("alpha", sampler.alpha)))  # type: ignore[attr-defined]
        opts["seed"] = str(random.randrange(1, 2**31))  # a fresh random sequence per claim
    times = _opt_int(config, "max_times_sampled", 1, 1)
    if times is not None and times > 1:
        if kind in ("rank", "balance"):
            raise SamplerError(
                f"max_times_sampled does not combine with {type(sampler).__name__}: the ranks of a data-parallel "
                f"group share one stored batch, which a replayed sample would join again"
            )
        opts["times"] = str(times)
    if kind in ("rank", "balance"):
        if kind == "rank":
            missing = [k for k in ("dp_rank", "batch_index") if config.get(k) is None]
            if missing:
                raise SamplerError(
                    f"RankAwareSampler needs sampling_config keys {missing}: dp_rank names the "
                    f"data-parallel group, batch_index the step (ranks of a group share both)"
                )
            opts["dp_rank"] = str(_opt_int(config, "dp_rank", None, 0))
        else:
            dp_size = _opt_int(config, "dp_size", sampler.dp_size, 1)  # type: ignore[attr-defined]
            dp_rank = _opt_int(config, "dp_rank", 0, 0)
            assert dp_size is not None and dp_rank is not None
            if dp_rank >= dp_size:
                raise SamplerError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
            opts["dp_rank"], opts["dp_size"] = str(dp_rank), str(dp_size)
        opts["batch_index"] = _batch_index(config.get("batch_index", 0))
        ttl = config.get("cache_ttl_s", DEFAULT_CACHE_TTL_S)
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or ttl <= 0:
            raise SamplerError(f"sampling_config['cache_ttl_s'] must be > 0 seconds, got {ttl!r}")
        opts["ttl_ms"] = str(max(1, int(ttl * 1000)))
    return SamplerPlan(kind, batch_size, tuple(opts.items()))


def _batch_index(value: Any) -> str:
    """``batch_index`` as the script keys a stored choice by (an integer >= 0 or a plain name)."""
    if isinstance(value, bool) or not isinstance(value, int | str) or (isinstance(value, int) and value < 0):
        raise SamplerError(f"sampling_config['batch_index'] must be an integer >= 0 or a name, got {value!r}")
    text = str(value)
    if not text or any(c in text for c in "{}; ,\r\n"):
        raise SamplerError(f"sampling_config['batch_index'] {value!r} may not be empty or contain {{}}; , or spaces")
    return text
