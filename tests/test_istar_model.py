"""istar.py's model-side pieces on the shipped tiny model: a PRM equal to the policy scores
every step 0 exactly, and the PRM's micro-batched DPO step has the gradient of the whole
batch's loss."""

import copy

import torch

import envs
from common.model import add_lora, load_model_and_tokenizer, response_logprobs
from istar import (Args, Policy, ScoredStep, implicit_step_rewards, prm_update, rollout,
                   score_responses, step_rewards_per_trajectory, summarize, trajectory_dpo_loss)


def tiny_batch(n_groups=2, group_size=3, steps=5):
    args = Args(max_episode_steps=steps, micro_batch_size=4, prm_max_grad_norm=1e9)
    model, tokenizer = load_model_and_tokenizer("tiny")
    torch.manual_seed(0)
    prm = add_lora(copy.deepcopy(model), 4, 8, 0.0, "all-linear")
    policy = add_lora(model, 4, 8, 0.0, "all-linear")
    tasks = envs.list_tasks("household", "train")[:n_groups]
    groups = [g for g in range(n_groups) for _ in range(group_size)]
    trajs = rollout(args, tokenizer, Policy(args, policy, tokenizer), [tasks[g] for g in groups],
                    groups, temperature=1.0)
    return args, policy, prm, tokenizer, trajs


def test_a_prm_equal_to_the_policy_gives_exact_zero_rewards():
    args, policy, prm, tokenizer, trajs = tiny_batch()
    steps = [ScoredStep(s["prompt"], s["response_ids"], None)
             for tr in trajs for s in tr["steps"]]
    old = score_responses(policy, tokenizer, steps, 4, 1.0)
    mine = score_responses(prm, tokenizer, steps, 4, 1.0)
    rewards = step_rewards_per_trajectory(trajs, mine, old, 0.05)
    assert [len(r) for r in rewards] == [len(t["steps"]) for t in trajs]
    assert all(r == 0.0 for traj in rewards for r in traj)
    # the scores are the plain forward pass's, whatever the micro-batching
    lp, mask, _ = response_logprobs(policy, [steps[0][0]], [steps[0][1]], tokenizer.pad_token_id)
    assert torch.allclose(old[0], lp[0, :len(steps[0][1])], atol=1e-5)


def test_prm_step_follows_the_gradient_of_the_whole_batch_loss():
    args, policy, prm, tokenizer, trajs = tiny_batch()
    with torch.no_grad():  # move the PRM off the policy, so that rewards and gradients vary
        for name, p in prm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    for k, tr in enumerate(trajs):  # wins and losses in every group, whatever was played
        tr["won"] = k % 3 == 0
    steps = [ScoredStep(s["prompt"], s["response_ids"], None)
             for tr in trajs for s in tr["steps"]]
    old = score_responses(policy, tokenizer, steps, 4, 1.0)
    for tr, r in zip(trajs, step_rewards_per_trajectory(
            trajs, score_responses(prm, tokenizer, steps, 4, 1.0), old, args.beta)):
        tr["step_rewards"] = r
    batch = [summarize(t) for t in trajs]
    params = [p for p in prm.parameters() if p.requires_grad]

    # reference: one graph through every step, autograd of the DPO loss itself
    logp, mask, _ = response_logprobs(prm, [s[0] for s in steps], [s[1] for s in steps],
                                      tokenizer.pad_token_id)
    prm_steps, old_steps, k = [], [], 0
    for tr in trajs:
        n = len(tr["steps"])
        prm_steps.append([logp[j, :len(steps[j][1])] for j in range(k, k + n)])
        old_steps.append(old[k:k + n])
        k += n
    rewards = implicit_step_rewards(prm_steps, old_steps, args.beta)
    loss, pairs = trajectory_dpo_loss(rewards, [float(t["won"]) for t in trajs],
                                      [t["group"] for t in trajs])
    assert pairs == 4
    expected = torch.autograd.grad(loss, params)

    optimizer = torch.optim.SGD(params, lr=1.0)
    before = [p.detach().clone() for p in params]
    stats = prm_update(args, prm, tokenizer, optimizer, batch,
                       [step._replace(old_logprobs=lp) for step, lp in zip(steps, old)],
                       slice(0, len(trajs)), 1)
    assert stats["prm/pairs"] == 4
    assert abs(stats["prm/dpo_loss"] - loss.item()) < 1e-6
    for b, p, g in zip(before, params, expected):  # SGD with lr 1: the step is -gradient
        assert torch.allclose(b - p.detach(), g, atol=1e-7, rtol=1e-4)
    assert sum(g.abs().sum() for g in expected) > 0
