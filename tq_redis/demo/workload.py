"""The work the demo's pipeline does: a tiny bigram policy, seeded prompts and responses, a
rule-based reward, group-normalised advantages, a GRPO update, and bounded CPU work that stands in
for the cost of real models.

Pure torch (jagged fields built by :func:`tq_redis.meta.jagged.jagged_from_rows`): no I/O, no client,
no state but constants. ``tq-redis demo`` runs it one stage per process, streaming through
tq-redis (:mod:`tq_redis.demo.stages`), and ``benchmarks/p5_pipeline.py`` runs the same work on
tq-redis and on the reference system, so the benchmark measures the demo's pipeline without
copying it. Every random draw comes from :func:`generator`, keyed by what it is
for (seed, step, sample, purpose), so any process can reproduce any sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tq_redis.meta.jagged import jagged_from_rows

__all__ = [
    "DIM",
    "PROMPTS_PER_PUT",
    "STAGE_COST",
    "VOCAB",
    "BigramLM",
    "Burn",
    "GRPOLearner",
    "generator",
    "group_advantages",
    "jagged",
    "policy_model",
    "prompt",
    "ref_log_probs",
    "reference_model",
    "response_length",
    "rewards",
    "warm_up",
]

VOCAB = 512
"""Token ids run from 0 to ``VOCAB - 1``."""
DIM = 64
"""Hidden size of the bigram policy and of the simulated work."""
PROMPTS_PER_PUT = 2
"""Prompts (groups of ``n_samples`` rows) a feeder inserts per ``put``."""
STAGE_COST: dict[str, float] = {"reward": 0.2, "ref": 0.35, "trainer": 0.5}
"""Simulated cost of a stage in decode-step units per token: rollout runs one real decode step per
token; these stages add that many units of :class:`Burn` on top of their real work."""


def generator(*key: int) -> torch.Generator:
    """A torch generator seeded from ``key``, e.g. ``(seed, step, sample, purpose)``: same key, same draws."""
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + int(part) + 1) % (2**62)
    return torch.Generator().manual_seed(seed)


def jagged(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Variable-length 1-D rows as one jagged nested tensor."""
    return jagged_from_rows(rows)


class Burn:
    """Bounded CPU work standing in for a model's compute (never a sleep)."""

    def __init__(self) -> None:
        self.w = torch.randn(DIM, DIM, generator=generator(7)) / DIM**0.5
        self.h = torch.randn(4, DIM, generator=generator(8))

    def run(self, units: float) -> None:
        """``int(units)`` small matmuls, each about one decode step of :class:`BigramLM`."""
        h = self.h
        for _ in range(int(units)):
            h = torch.tanh(h @ self.w)

    def charge(self, stage: str, tokens: int) -> None:
        """The simulated cost of ``stage`` handling ``tokens`` tokens (see :data:`STAGE_COST`)."""
        self.run(tokens * STAGE_COST[stage])


class BigramLM:
    """A tiny policy: next-token log-probs from the previous token only (embedding -> tanh -> head)."""

    def __init__(self, seed: int, trainable: bool = False) -> None:
        g = generator(seed, 1)
        self.emb = (torch.randn(VOCAB, DIM, generator=g) / DIM**0.5).requires_grad_(trainable)
        self.head = (torch.randn(DIM, VOCAB, generator=g) / DIM**0.5).requires_grad_(trainable)

    def parameters(self) -> list[torch.Tensor]:
        """The trainable tensors, for an optimizer."""
        return [self.emb, self.head]

    def generate(self, last_token: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``length`` tokens after ``last_token``, one decode step each: (tokens, their log-probs)."""
        tok = last_token
        tokens, logps = [], []
        with torch.no_grad():
            for _ in range(length):
                logp = torch.log_softmax(torch.tanh(self.emb[tok]) @ self.head, dim=-1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                tokens.append(tok)
                logps.append(float(logp[tok]))
        return torch.tensor(tokens, dtype=torch.int64), torch.tensor(logps, dtype=torch.float32)

    def token_log_probs(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> torch.Tensor:
        """Log-probs of every response token given its predecessor, all rows in one pass (flat)."""
        prev = torch.cat([torch.cat([p[-1:], r[:-1]]) for p, r in zip(prompts, responses)])
        nxt = torch.cat(list(responses))
        logp = torch.log_softmax(torch.tanh(self.emb[prev]) @ self.head, dim=-1)
        return logp.gather(1, nxt.unsqueeze(1)).squeeze(1)


def policy_model(seed: int, trainable: bool = False) -> BigramLM:
    """The policy of run ``seed``: rollout samples from it, the trainer updates a trainable twin."""
    return BigramLM(seed + 1, trainable=trainable)


def reference_model(seed: int) -> BigramLM:
    """The frozen reference policy of run ``seed`` (the KL anchor)."""
    return BigramLM(seed)


def prompt(seed: int, step: int, prompt_id: int, prompt_len: tuple[int, int]) -> torch.Tensor:
    """Prompt ``prompt_id`` of training step ``step``: uniform random tokens, ``prompt_len`` = (min, max) long."""
    g = generator(seed, step, prompt_id, 0)
    length = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
    return torch.randint(0, VOCAB, (length,), generator=g)


def response_length(gen: torch.Generator, response_len: tuple[int, int]) -> int:
    """A response length in ``response_len`` = (min, max) drawn from ``gen``: many short, a long tail."""
    lo, hi = response_len
    u = float(torch.rand((), generator=gen))
    return lo + int((hi - lo) * u * u)


def rewards(responses: Sequence[torch.Tensor]) -> torch.Tensor:
    """A rule-based "verifier": per response, the share of low token ids minus a small length penalty."""
    return torch.stack([(r < VOCAB // 4).float().mean() - 1e-4 * len(r) for r in responses])


def group_advantages(group_rewards: torch.Tensor) -> torch.Tensor:
    """GRPO advantages of one group (one prompt's responses): rewards normalised to mean 0, std 1."""
    return (group_rewards - group_rewards.mean()) / (group_rewards.std(correction=0) + 1e-6)


def ref_log_probs(
    ref: BigramLM, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The reference policy's log-prob of every response token, one tensor per response."""
    with torch.no_grad():
        flat = ref.token_log_probs(prompts, responses)
    return list(flat.split([len(r) for r in responses]))


class GRPOLearner:
    """The trainer's side: a trainable copy of the policy and its GRPO update (SGD)."""

    def __init__(self, seed: int, lr: float = 1e-2) -> None:
        self.policy = policy_model(seed, trainable=True)
        self.opt = torch.optim.SGD(self.policy.parameters(), lr=lr)

    def update(
        self,
        prompts: Sequence[torch.Tensor],
        responses: Sequence[torch.Tensor],
        old_log_prob: torch.Tensor,
        ref_log_prob: torch.Tensor,
        advantages: torch.Tensor,
    ) -> float:
        """One GRPO step on a micro-batch: the clipped importance-weighted advantage plus a KL penalty
        to the reference. ``old_log_prob`` and ``ref_log_prob`` are flat over the micro-batch's
        response tokens; ``advantages`` has one value per response. Returns the loss."""
        adv = torch.repeat_interleave(advantages, torch.tensor([len(r) for r in responses]))
        logp = self.policy.token_log_probs(prompts, responses)
        ratio = torch.exp(logp - old_log_prob)
        pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        kl = torch.exp(ref_log_prob - logp) - (ref_log_prob - logp) - 1
        loss = (pg + 0.01 * kl).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def warm_up() -> None:
    """Pay the first-call costs (lazy imports, kernel set-up) of every piece, before a clock starts."""
    BigramLM(0).generate(1, 2, generator(0))
    Burn().run(2)
    jagged([torch.arange(2), torch.arange(3)]).unbind()
