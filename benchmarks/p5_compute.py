"""How P5's stages spend their compute: on this machine's CPU, or as known device time.

* ``cpu`` (the default): the stages' model work runs on the CPU -- rollout decodes token by token,
  the other stages add :class:`tq_redis.demo.workload.Burn` units per token. Every worker process
  shares the machine's cores with the data system, so on a machine with fewer cores than workers
  the data plane's CPU comes straight out of the compute's.
* ``device``: as on GPU ranks, a batch holds its worker's accelerator for a known time --
  ``--device-us-per-token`` times the stage's per-token cost (rollout 1, the others
  :data:`~tq_redis.demo.workload.STAGE_COST`) times the batch's tokens -- while the host CPU stays
  free; the worker waits for it as a host thread waits on a device synchronisation. The outputs
  are still real: rollout draws each response's tokens in one call and scores them with the
  policy in one pass, and reward, ref and trainer do their real (small) work within that time.
  The critical path then runs over the workers (one device each), not over the cores, and the
  wall time above it is the data system's latency and the workers' host-side glue.

The compute of a batch is what :meth:`Compute.batch` logs: its CPU seconds (``cpu``), or its
device seconds, the known time or the real work's wall time when that took longer (``device``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from tq_redis.demo import workload as wl

MODES = ("cpu", "device")
DEFAULT_DEVICE_US_PER_TOKEN = 50.0
"""About one decode step of the demo's policy on one core here, so both modes carry the same work."""
ROLLOUT_COST = 1.0
"""Rollout's device cost per token, in decode steps (the other stages': ``STAGE_COST``)."""


class Compute:
    """One worker's way of computing: ``mode`` is ``"cpu"`` or ``"device"``."""

    def __init__(self, mode: str, device_us_per_token: float = DEFAULT_DEVICE_US_PER_TOKEN) -> None:
        if mode not in MODES:
            raise ValueError(f"compute mode must be one of {MODES}, got {mode!r}")
        if device_us_per_token <= 0:
            raise ValueError(f"device time per token must be positive, got {device_us_per_token}")
        self.mode = mode
        self.s_per_token = device_us_per_token * 1e-6
        self.burn = wl.Burn() if mode == "cpu" else None
        self.late_s = 0.0  # device mode: how much later than asked the waits ended (the OS's wake-up)

    @property
    def cores_are_shared(self) -> bool:
        """Whether the compute competes with everything else for the machine's cores."""
        return self.mode == "cpu"

    def device_seconds(self, stage: str, tokens: int) -> float:
        """The known device time of ``stage`` handling ``tokens`` tokens (``device`` mode)."""
        cost = ROLLOUT_COST if stage == "rollout" else wl.STAGE_COST[stage]
        return tokens * cost * self.s_per_token

    @contextlib.contextmanager
    def batch(self, stage: str, tokens: int, log: list[float]) -> Iterator[None]:
        """Compute one batch of ``stage`` over ``tokens`` tokens around the block (the stage's
        real work); appends the batch's compute seconds to ``log``.

        ``cpu``: the block's CPU time (``thread_time``: a worker descheduled by the others is not
        charged for the wait), after the stage's burn units (none for rollout, whose block is the
        decode itself). ``device``: waits until the batch's device time has passed since the block
        started, and logs that time.
        """
        if self.mode == "cpu":
            t0 = time.thread_time()
            yield
            if stage != "rollout":
                self.burn.charge(stage, tokens)  # type: ignore[union-attr]
            log.append(time.thread_time() - t0)
            return
        t0 = time.perf_counter()
        yield
        spent = time.perf_counter() - t0
        busy = self.device_seconds(stage, tokens)
        if spent < busy:
            _wait_until(t0 + busy)
            self.late_s += time.perf_counter() - t0 - busy
        log.append(max(busy, spent))

    def generate(
        self, policy: wl.BigramLM, prompt: torch.Tensor, length: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rollout of one row: ``(tokens, their log-probs)``. ``cpu``: the policy's decode, one step
        per token. ``device``: the tokens drawn in one call and scored in one pass (the decode's
        cost is the device time)."""
        if self.mode == "cpu":
            return policy.generate(int(prompt[-1]), length, gen)
        tokens = torch.randint(0, wl.VOCAB, (length,), generator=gen)
        with torch.no_grad():
            logps = policy.token_log_probs([prompt], [tokens])
        return tokens, logps


SPIN_TAIL_S = 0.0005
"""The last part of a device wait that is spun rather than slept (see :func:`_wait_until`)."""


def _wait_until(deadline: float) -> None:
    """Wait for ``deadline`` (a ``perf_counter`` time) as a host thread waits on a device
    synchronisation: sleep through most of it, spin through the last :data:`SPIN_TAIL_S`.

    CUDA's default synchronisation spins while the host has a core to spare; a plain sleep would
    add the OS's wake-up latency (0.3-0.5 ms a batch on this loaded 2-core machine) to every
    batch, which is not the data system's. The spin is kept short because here the cores are shared.
    """
    remaining = deadline - time.perf_counter()
    if remaining > SPIN_TAIL_S:
        time.sleep(remaining - SPIN_TAIL_S)
    while time.perf_counter() < deadline:
        pass
