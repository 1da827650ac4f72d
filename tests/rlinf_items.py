"""Item classes shaped like RLinf's channel items (dataclasses holding tensors, lists, dicts and
each other, a NamedTuple), at module level so every test process imports them by path."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch


@dataclasses.dataclass
class Rollout:
    """A rollout result as RLinf's workers pass it: tensors plus plain values."""

    prompt_ids: torch.Tensor
    rewards: list[float]
    info: dict[str, Any]
    group: int = 0
    post_init_runs: int = dataclasses.field(default=0, compare=False)

    def __post_init__(self) -> None:
        self.post_init_runs += 1  # the decoder builds items as pickle does: this never runs again


@dataclasses.dataclass(frozen=True, slots=True)
class Tag:
    """A frozen, slotted dataclass."""

    name: str
    version: int


class Step(NamedTuple):
    """A NamedTuple holding a dataclass."""

    index: int
    rollout: Rollout
    tag: Tag | None = None


@dataclasses.dataclass
class Unlisted:
    """A dataclass no allow-list names."""

    x: int
