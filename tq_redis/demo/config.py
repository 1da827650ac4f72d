"""What every process of a ``tq-redis demo`` run shares: its options (:class:`DemoConfig`), the
stage names and worker roles, the partition of each step, the :class:`Span` record the workers
report, and :class:`DemoFailed`.

Kept apart from :mod:`tq_redis.demo.main` so that the worker processes (:mod:`tq_redis.demo.stages`),
the main process (:mod:`tq_redis.demo.pipeline`) and the report (:mod:`tq_redis.demo.report`) all
import one definition without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STAGES", "STAGE_LABELS", "DemoConfig", "DemoFailed", "Span", "partition", "roles"]

#: pipeline stages in order; each span and progress bar belongs to one of them
STAGES: tuple[str, ...] = ("feeder", "rollout", "reward", "ref", "trainer")

STAGE_LABELS: dict[str, str] = {
    "feeder": "prompt feeder",
    "rollout": "rollout",
    "reward": "reward",
    "ref": "ref log-prob",
    "trainer": "trainer",
}
"""How progress lines, the summary and the timeline name each stage."""


class DemoFailed(RuntimeError):
    """The demo did not complete: a worker failed or died, it timed out, or its output was wrong."""


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and options of one demo run (the command-line options, see :func:`tq_redis.demo.main.build_parser`)."""

    steps: int = 3
    batch: int = 16
    n_samples: int = 4
    workers: int = 2
    store: str = "dram"
    redis_url: str | None = None
    namespace: str = "tq"
    out: str = "tq-demo-out"
    max_tokens: int = 2048
    micro_batch: int = 32
    max_lag: int = 1
    prompt_len: tuple[int, int] = (8, 48)
    response_len: tuple[int, int] = (16, 320)
    seed: int = 0
    timeout_s: float = 300.0
    progress: str = "auto"
    fail_stage: str | None = None

    @property
    def samples_per_step(self) -> int:
        """Rows per partition: prompts times samples per prompt."""
        return self.batch * self.n_samples

    @property
    def samples(self) -> int:
        """Rows over the whole run."""
        return self.steps * self.samples_per_step

    def validate(self) -> None:
        """Raise ``ValueError`` for sizes the pipeline cannot run with."""
        for name in ("steps", "batch", "n_samples", "workers", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {self.max_lag}")
        if self.store not in ("dram", "redis"):
            raise ValueError(f"store must be 'dram' or 'redis', got {self.store!r}")
        if self.progress not in ("auto", "rich", "plain", "none"):
            raise ValueError(f"progress must be auto, rich, plain or none, got {self.progress!r}")
        if self.fail_stage is not None and self.fail_stage not in STAGES:
            raise ValueError(f"fail_stage must be one of {STAGES}, got {self.fail_stage!r}")
        for name in ("prompt_len", "response_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        longest = self.prompt_len[1] + self.response_len[1]
        if self.max_tokens and self.max_tokens < longest:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) must fit the longest sample ({longest} tokens: "
                f"prompt {self.prompt_len[1]} + response {self.response_len[1]}), or no batch could hold it"
            )


def partition(step: int) -> str:
    """The partition that holds training step ``step``."""
    return f"step_{step}"


def roles(cfg: DemoConfig) -> list[tuple[str, int]]:
    """Every worker process of a run as ``(stage, worker)``, in stage order (one lane each in the timeline)."""
    return [("feeder", 0)] + [("rollout", i) for i in range(cfg.workers)] + [("reward", 0), ("ref", 0), ("trainer", 0)]


@dataclass(frozen=True)
class Span:
    """One stage working on one micro-batch: claim returned -> results stored."""

    stage: str
    worker: int
    step: int
    start: float
    end: float
    n: int
    tokens: int
    bytes_in: int
    bytes_out: int
    cpu_s: float

    @property
    def duration(self) -> float:
        """Seconds the micro-batch took (wall clock)."""
        return self.end - self.start
