"""``tq_redis.demo.workload``, the work shared by ``tq-redis demo`` and the P5 benchmark: seeded
draws reproduce in any process, sizes stay in their bounds, and the GRPO pieces compute what the
pipeline's checks rely on (one log-prob per response token, normalised group advantages, an
update that moves the policy)."""

from __future__ import annotations

import torch

from tq_redis.demo import workload as wl


def test_same_key_same_prompt_and_response_other_key_other_prompt():
    a = wl.prompt(0, step=1, prompt_id=2, prompt_len=(8, 48))
    assert torch.equal(a, wl.prompt(0, step=1, prompt_id=2, prompt_len=(8, 48)))
    assert not torch.equal(a, wl.prompt(0, step=1, prompt_id=3, prompt_len=(8, 48)))
    policy = wl.policy_model(0)
    first = policy.generate(int(a[-1]), 12, wl.generator(0, 1, 2, 1))
    again = policy.generate(int(a[-1]), 12, wl.generator(0, 1, 2, 1))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_sizes_stay_in_their_bounds_and_responses_skew_short():
    prompts = [wl.prompt(7, 0, pid, (8, 48)) for pid in range(200)]
    assert all(8 <= len(p) <= 48 for p in prompts)
    assert all(0 <= int(p.min()) and int(p.max()) < wl.VOCAB for p in prompts)
    lengths = [wl.response_length(wl.generator(7, k), (16, 320)) for k in range(400)]
    assert all(16 <= n <= 320 for n in lengths)
    assert sorted(lengths)[len(lengths) // 2] < (16 + 320) / 2  # many short, a long tail


def test_ref_log_probs_give_one_value_per_response_token():
    policy, ref = wl.policy_model(0), wl.reference_model(0)
    prompts = [wl.prompt(0, 0, pid, (4, 8)) for pid in range(3)]
    lengths = (5, 1, 9)
    responses = [policy.generate(int(p[-1]), n, wl.generator(k))[0] for k, (p, n) in enumerate(zip(prompts, lengths))]
    rows = wl.ref_log_probs(ref, prompts, responses)
    assert [len(r) for r in rows] == list(lengths)
    assert all(bool((r <= 0).all()) for r in rows)


def test_group_advantages_are_normalised_and_rewards_score_each_response():
    responses = [torch.tensor([1, 2, 3]), torch.tensor([500, 501]), torch.tensor([4, 400, 5, 6]), torch.tensor([9])]
    rewards = wl.rewards(responses)
    assert rewards.shape == (4,) and rewards[0] > rewards[1]
    adv = wl.group_advantages(rewards)
    assert abs(float(adv.mean())) < 1e-5 and abs(float(adv.std(correction=0)) - 1) < 1e-3


def test_grpo_update_moves_the_policy():
    learner = wl.GRPOLearner(0)
    ref = wl.reference_model(0)
    prompts = [wl.prompt(0, 0, pid, (4, 8)) for pid in range(4)]
    policy = wl.policy_model(0)
    generated = [policy.generate(int(p[-1]), 6, wl.generator(pid)) for pid, p in enumerate(prompts)]
    responses, old = [g[0] for g in generated], torch.cat([g[1] for g in generated])
    before = learner.policy.head.detach().clone()
    loss = learner.update(prompts, responses, old, torch.cat(wl.ref_log_probs(ref, prompts, responses)),
                          wl.group_advantages(wl.rewards(responses)))
    assert torch.isfinite(torch.tensor(loss))
    assert not torch.equal(before, learner.policy.head.detach())
