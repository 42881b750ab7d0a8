"""iStar: implicit step rewards for multi-turn agent RL (Liu et al., 2025), single-file reference.

iStar learns a dense reward per step without step labels (Algorithm 1):
  * an implicit process reward model (PRM), a second causal LM started from the policy's start,
    gives step t the reward r_t = beta * sum over the reply's tokens of log pi_PRM - log pi_old
    (Eq. 1), pi_old being the policy that played the batch;
  * every iteration the PRM takes one trajectory-level DPO step (Eq. 2), after its r_t were read:
    in each group, every won trajectory is preferred to every lost one, pi_old the reference;
  * the policy's advantage is an episode term from the 0/1 outcomes plus alpha times a step term
    from the implicit step rewards, both with the same group baseline, RLOO (the paper's main
    results) or GRPO (Eqs. 3-5), and PPO-clip without KL optimises it (Eq. 6).
  No critic, no extra rollouts, no step labels.

Departures from the paper and its code (docs/istar.md, "Departures from the paper, in full"):
  * Both models are LoRA adapters on their own copies of the start (the code: two full models);
    r_t = 0 in iteration 1, old log-probs recomputed by the PRM's pass; both at temperature 1.
  * DPO score: the mean of the step rewards (--traj-agg mean, the code's; sum: Eq. 2), pairs over
    the batch; one AdamW step per iteration, clip 10; exact gradient computed in micro-batches.
  * Step rewards divided by the batch's max |r| + 1e-6 (--step-reward-scale max_abs; DPO: raw).
  * RLOO step baseline: the group's other steps; iStar's GRPO only centres (--use-std: z-score),
    --advantage grpo z-scores; a group of one keeps raw values, equal values give exactly 0.
  * Loss: token-level ratio, clip 0.2, token-mean; no entropy bonus, dual clip or KL
    (--entropy-coef, --clip-ratio-c, --kl-coef 0); the spec's GSPO-style ratio is not built.
  * Outcome r_o = 10 for a win, 0 for a loss (--success-reward, the code's); DPO positives: wins.
  * Invalid replies: --invalid-action-penalty off the advantage, not the spec's -0.1 inside r_o.
  * LoRA rates in the code's relation: the policy at half the baselines', the PRM at twice the
    policy's; weight decay 0; the baselines keep the old log-probs recorded at sampling.
  * Environments: the household and ALFWorld (30 / 50 steps), not WebShop, VisualSokoban, SOTOPIA.
  * Harness prompts, rollouts, BC (not ReAct); real models start from Instruct (--bc-epochs 0).
  * Not built: the PRIME baseline, the "merged" ablation, REINFORCE++ w/ iStar.

Run:
    python istar.py                         # tiny model, built-in household, CPU, minutes
    python istar.py --advantage rloo        # the baselines: plain RLOO or GRPO (no PRM)
    python istar.py --estimator grpo        # iStar on GRPO, centred (--use-std: Eqs. 3-4)
    python istar.py --env alfworld --model Qwen2.5-1.5B-Instruct --backend vllm   # the real run
    accelerate launch --multi_gpu --num_processes 8 istar.py --env alfworld ...  # data parallel

Sections: 1 iStar rewards and advantages, 2 implicit PRM, 3 policy loss, 4 arguments, 5 rollouts, 6
behavior cloning, 7 evaluation, 8 training loop.
To read: sections 1-3 tell the method, 8 the loop (`main`: rollout -> reward -> advantage ->
update, then `policy_update`); 4 (the flags) and 5-7 (the harness, alike in every script) can wait.
"""

from __future__ import annotations

import copy
import math
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Literal, NamedTuple

import numpy as np

# Before torch loads OpenMP: waiting threads sleep, not spin (docs/performance.md), unless set.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.nn.functional as F
from accelerate import PartialState
from torch import Tensor

import envs
from common import UsageError, config
from common.config import HarnessArgs
from common.dist import (mean_across_processes, minibatches, my_share, same_start,
                         sum_across_processes, whole_batch)
from common.envbatch import EnvBatch
from common.generation import Policy, episode_keys, make_vllm_engine
from common.model import (add_lora, length_sorted_chunks, load_lora, merge_lora,
                          next_token_losses, pad_rows, response_logprobs, scored_logprobs)
from common.progress import Progress
from common.run import Run, check_finite, rollout_stats, start_run, timer, timings
from envs.text import encode_prompt, expert_response, is_well_formed, parse_action


# ---- 1. iStar rewards and advantages (pure functions; advantages in float64, no grad) ----------
def _check_estimator(estimator: str) -> None:
    """ValueError unless estimator is grpo or rloo (no silent fallback)."""
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"estimator must be 'grpo' or 'rloo', not {estimator!r}")


def implicit_step_reward(prm_logps: Tensor, old_logps: Tensor, beta: float,
                         mask: Tensor | None = None) -> Tensor:
    """Eq. 1 for ONE step: (L,) token log-probs of its reply under the PRM and under the policy
    that sampled it -> 0-dim beta * sum of (prm - old) over the kept positions. mask (L,), bool or
    float, keeps positions where mask != 0; None keeps all. Masked positions are replaced by 0
    before the sum (never multiplied: -inf padding times 0 is NaN). Grad flows via prm_logps."""
    diff = prm_logps - old_logps
    if mask is not None:
        diff = torch.where(mask != 0, diff, torch.zeros_like(diff))
    return beta * diff.sum()


def implicit_step_rewards(prm_logps: list[list[Tensor]], old_logps: list[list[Tensor]],
                          beta: float) -> list[Tensor]:
    """Eq. 1 for a batch: prm_logps[i][t] and old_logps[i][t] are the unpadded (L,) token
    log-probs of step t of trajectory i -> per trajectory a (T_i,) tensor of step rewards. The
    autograd graph through prm_logps is kept."""
    out = []
    for prm_steps, old_steps in zip(prm_logps, old_logps, strict=True):
        rewards = [implicit_step_reward(p, o, beta)
                   for p, o in zip(prm_steps, old_steps, strict=True)]
        out.append(torch.stack(rewards) if rewards else torch.zeros(0))
    return out


def trajectory_scores(step_rewards: list[Tensor], traj_agg: str = "mean") -> list[Tensor]:
    """DPO score S_i of each trajectory from its (T_i,) step rewards: their mean (the code) or sum
    (the literal Eq. 2) as a 0-dim tensor, with grad if they have it; an empty trajectory
    scores 0."""
    if traj_agg not in ("mean", "sum"):
        raise ValueError(f"traj_agg must be 'mean' or 'sum', not {traj_agg!r}")
    if traj_agg == "mean":
        return [r.sum() / max(len(r), 1) for r in step_rewards]
    return [r.sum() for r in step_rewards]


def group_members(group_ids: list) -> list[list[int]]:
    """The indices of each group's members, in input order; groups in order of first appearance."""
    members: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return list(members.values())


def preference_pairs(outcomes: list[float], group_ids: list,
                     pos_threshold: float = 0.0) -> list[tuple[int, int]]:
    """Eq. 2's pairs: (positive, negative) index pairs, every combination inside each group.
    Positive: outcome > pos_threshold, negative: the others. Groups in order of first
    appearance, then positives, then negatives, in input order."""
    pairs = []
    for idx in group_members(group_ids):
        positives = [i for i in idx if outcomes[i] > pos_threshold]
        negatives = [i for i in idx if outcomes[i] <= pos_threshold]
        pairs += [(p, n) for p in positives for n in negatives]
    return pairs


def trajectory_dpo_loss(step_rewards: list[Tensor], outcomes: list[float], group_ids: list,
                        pos_threshold: float = 0.0, traj_agg: str = "mean") -> tuple[Tensor, int]:
    """Eq. 2, trajectory-level DPO with the sampling policy as reference: the mean over the
    preference_pairs of -logsigmoid(S_pos - S_neg), S_i the trajectory_scores of step_rewards[i]
    (T_i,), with grad, un-rescaled. Returns (loss, n_pairs); (tensor(0.), 0) without any pair."""
    scores = trajectory_scores(step_rewards, traj_agg)
    pairs = preference_pairs(outcomes, group_ids, pos_threshold)
    margins = [scores[p] - scores[n] for p, n in pairs]
    if not margins:
        return torch.tensor(0.0), 0
    return -F.logsigmoid(torch.stack(margins)).mean(), len(margins)


def dpo_pair_accuracy(step_rewards: list[Tensor], outcomes: list[float], group_ids: list,
                      pos_threshold: float = 0.0, traj_agg: str = "mean") -> tuple[float, int]:
    """The PRM's pairwise accuracy on trajectory_dpo_loss's pairs (the code's dpo_acc_before, when
    the rewards are the PRM's before its DPO step, though not computed alike: docs/istar.md): the
    share of the batch's (positive, negative) pairs with S_pos > S_neg, S as the loss scores it;
    a tie counts 1/2, so a PRM that scores every r_t 0 (the first iteration) gets 0.5, as chance.
    step_rewards[i] (T_i,). Returns (accuracy, n_pairs); (nan, 0) without any pair."""
    scores = [float(s) for s in trajectory_scores(step_rewards, traj_agg)]
    pairs = preference_pairs(outcomes, group_ids, pos_threshold)
    if not pairs:
        return float("nan"), 0
    right = 0.0
    for p, n in pairs:
        if scores[p] > scores[n]:
            right += 1.0
        elif scores[p] == scores[n]:
            right += 0.5
    return right / len(pairs), len(pairs)


def scale_step_rewards_max_abs(step_rewards: list[Tensor], eps: float = 1e-6) -> list[Tensor]:
    """The code's batch rescaling: every r / (max |r| + eps), the max over all steps of all
    trajectories. A batch without any step is returned unchanged."""
    if sum(len(r) for r in step_rewards) == 0:
        return step_rewards
    largest = torch.cat([r.abs().flatten() for r in step_rewards]).max()
    return [r / (largest + eps) for r in step_rewards]


def group_normalize(values: Tensor, eps: float = 1e-6, use_std: bool = True) -> Tensor:
    """GRPO baseline over a 1-D set (N,) -> (N,): (v - mean) / (std + eps), Bessel std; v - mean
    without use_std. n == 0: empty; n == 1: the value unchanged (baseline 0, scale 1, as veRL);
    all values equal (max == min): exact zeros."""
    values = values.detach().to(torch.float64)
    if values.numel() <= 1:
        return values.clone()
    if values.max() == values.min():
        return torch.zeros_like(values)
    centred = values - values.mean()
    return centred / (values.std() + eps) if use_std else centred


def leave_one_out(values: Tensor) -> Tensor:
    """RLOO baseline over a 1-D set (N,) -> (N,): v_i - (sum - v_i) / (N - 1). n == 0: empty;
    n == 1: unchanged; all values equal: exact zeros (the value in exact arithmetic)."""
    values = values.detach().to(torch.float64)
    n = values.numel()
    if n <= 1:
        return values.clone()
    if values.max() == values.min():
        return torch.zeros_like(values)
    return values - (values.sum() - values) / (n - 1)


def episode_advantages(outcomes: Tensor, estimator: str = "grpo", eps: float = 1e-6,
                       use_std: bool = True) -> Tensor:
    """(N,) outcomes of one group -> (N,) A^E: Eq. 3 (grpo) or leave-one-out (rloo; eps and
    use_std ignored)."""
    _check_estimator(estimator)
    if estimator == "grpo":
        return group_normalize(outcomes, eps, use_std)
    return leave_one_out(outcomes)


def step_advantages(step_rewards: list[Tensor], estimator: str = "grpo", eps: float = 1e-6,
                    use_std: bool = True) -> list[Tensor]:
    """Eq. 4 on one group: the step rewards of all its trajectories form ONE set (trajectory
    order, then step order), normalised with group_normalize (grpo) or leave_one_out over the
    M - 1 other steps (rloo), then split back into (T_i,) tensors."""
    _check_estimator(estimator)
    if not step_rewards:
        return []
    flat = torch.cat([r.detach().to(torch.float64) for r in step_rewards])
    flat = group_normalize(flat, eps, use_std) if estimator == "grpo" else leave_one_out(flat)
    return list(torch.split(flat, [len(r) for r in step_rewards]))


def istar_group_advantages(outcomes: Tensor, step_rewards: list[Tensor], alpha: float = 1.0,
                           estimator: str = "grpo", eps: float = 1e-6,
                           use_std: bool = True) -> list[Tensor]:
    """Eq. 5 on one group of N trajectories: A[i][t] = A^E[i] + alpha * A^S[i][t].
    outcomes (N,); step_rewards[i] (T_i,) -> N tensors (T_i,)."""
    episode = episode_advantages(outcomes, estimator, eps, use_std)
    step = step_advantages(step_rewards, estimator, eps, use_std)
    return [episode[i] + alpha * step[i] for i in range(len(step_rewards))]


def istar_batch_advantages(outcomes: list[float], step_rewards: list[Tensor], group_ids: list,
                           alpha: float = 1.0, estimator: str = "grpo", eps: float = 1e-6,
                           use_std: bool = True, step_reward_scale: str = "none") -> list[Tensor]:
    """A whole batch: step_reward_scale "max_abs" first rescales the step rewards over the batch
    (scale_step_rewards_max_abs with its own eps 1e-6; `eps` is only the normalisation's), then
    istar_group_advantages per group. Output aligned with the input trajectory order."""
    _check_estimator(estimator)
    if step_reward_scale not in ("none", "max_abs"):
        raise ValueError(f"step_reward_scale must be 'none' or 'max_abs', not "
                         f"{step_reward_scale!r}")
    step_rewards = [r.detach().to(torch.float64) for r in step_rewards]
    if step_reward_scale == "max_abs":
        step_rewards = scale_step_rewards_max_abs(step_rewards)
    out: list[Tensor] = [torch.empty(0)] * len(step_rewards)
    for idx in group_members(group_ids):
        group_outcomes = torch.tensor([outcomes[i] for i in idx], dtype=torch.float64)
        advs = istar_group_advantages(group_outcomes, [step_rewards[i] for i in idx], alpha,
                                      estimator, eps, use_std)
        for i, a in zip(idx, advs):
            out[i] = a
    return out


def step_term_shares(step_terms: list[Tensor], advantages: list[Tensor], won: list[bool],
                     group_ids: list) -> dict[str, float]:
    """How much of the advantage the step term carries, by kind of group: uniform (every
    trajectory of the group won, or every one lost; a group of one too) and mixed.

    step_terms[i], advantages[i]: (T_i,) of trajectory i, alpha * A^S and the advantage the
    update uses (A^E + alpha * A^S minus the invalid-action penalty); won[i], group_ids[i].
    step_share_<kind> = sum over the kind's steps of |alpha * A^S| / sum of |A| (sums over
    steps, not a mean of per-step ratios; how to read it: docs/istar.md). abs_share_uniform = the
    uniform groups' share of the batch's sum |A|. NaN where a denominator is 0 (no steps of that
    kind, or every A = 0)."""
    step_sum = {"uniform": 0.0, "mixed": 0.0}
    abs_sum = {"uniform": 0.0, "mixed": 0.0}
    for idx in group_members(group_ids):
        kind = "uniform" if len({bool(won[i]) for i in idx}) == 1 else "mixed"
        for i in idx:
            step_sum[kind] += float(step_terms[i].abs().sum())
            abs_sum[kind] += float(advantages[i].abs().sum())

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else float("nan")

    return {"step_share_uniform": ratio(step_sum["uniform"], abs_sum["uniform"]),
            "step_share_mixed": ratio(step_sum["mixed"], abs_sum["mixed"]),
            "abs_share_uniform": ratio(abs_sum["uniform"], abs_sum["uniform"] + abs_sum["mixed"])}


def istar_step_terms(args: Args, trajectories: list[dict]) -> list[Tensor]:
    """alpha * A^S (T_i,) of every trajectory of an iStar batch: the step part of
    compute_advantages' advantages, as istar_batch_advantages computes it (its rescaling and
    estimator) with every outcome 0, whose episode term is exactly 0."""
    step_rewards = [torch.tensor(t["step_rewards"], dtype=torch.float64) for t in trajectories]
    return istar_batch_advantages([0.0] * len(trajectories), step_rewards,
                                  [t["group"] for t in trajectories], args.step_weight,
                                  args.estimator, use_std=args.use_std,
                                  step_reward_scale=args.step_reward_scale)


def summarize(traj: dict) -> dict:
    """What advantages and logged stats read of a trajectory: no token ids, cheap to gather."""
    steps = [{k: s[k] for k in ("state", "valid", "well_formed")} for s in traj["steps"]]
    # step_rewards: iStar's training rollouts only (not the baselines', not evaluation's)
    kept = ("task_type", "group", "won", "rewards", "step_rewards")
    return {**{k: traj[k] for k in kept if k in traj}, "steps": steps}


def compute_advantages(args: Args, summaries: list[dict]) -> list[Tensor]:
    """Per-step advantages (T_i,) of every trajectory of a batch: iStar's, or with --advantage
    rloo / grpo the episode term alone (no step rewards). Then the one penalty rule of every
    estimator: --invalid-action-penalty is subtracted from the final advantage of each malformed
    reply, after every normalisation and baseline, so that it moves that step's advantage by
    exactly the penalty and nothing else."""
    outcomes = [args.success_reward * float(t["won"]) for t in summaries]
    groups = [t["group"] for t in summaries]
    if args.advantage == "istar":
        step_rewards = [torch.tensor(t["step_rewards"], dtype=torch.float64) for t in summaries]
        advantages = istar_batch_advantages(outcomes, step_rewards, groups, args.step_weight,
                                            args.estimator, use_std=args.use_std,
                                            step_reward_scale=args.step_reward_scale)
    else:  # the baseline's episode advantage, the same for every step of a trajectory
        no_steps = [torch.zeros(len(t["steps"]), dtype=torch.float64) for t in summaries]
        advantages = istar_batch_advantages(outcomes, no_steps, groups, 0.0, args.advantage,
                                            use_std=args.use_std)
    malformed = [torch.tensor([not s["well_formed"] for s in t["steps"]], dtype=torch.float64)
                 for t in summaries]
    return [a - args.invalid_action_penalty * m for a, m in zip(advantages, malformed)]


# ---- 2. Implicit PRM: step rewards (Eq. 1) and its DPO step (Eq. 2) -----------------------------
def implicit_prm(args: Args, run: Run, start_model) -> tuple:
    """(the implicit PRM, its AdamW); (None, None) for the baselines. The PRM is a copy of the
    policy's start with a LoRA adapter of its own, initialised from its own random draws (so that
    the policy's init and rollouts match the baselines'), or on --resume the adapter the run
    saved (checkpoint/prm/). No weight decay, as the code."""
    if args.advantage != "istar":
        return None, None
    prm = copy.deepcopy(start_model)
    if args.resume:
        path = os.path.join(run.checkpoint, "prm")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise UsageError(f"--resume {args.resume}: no checkpoint/prm/ (the PRM's adapter) "
                             "in it")
        prm = load_lora(prm, path)
    else:
        with torch.random.fork_rng():
            torch.manual_seed(args.seed + 1)
            prm = add_lora(prm, args.lora_r, args.lora_alpha, args.lora_dropout,
                           args.lora_target_modules)
    params = [p for p in prm.parameters() if p.requires_grad]
    return prm, torch.optim.AdamW(params, lr=args.prm_learning_rate, weight_decay=0.0)


class ScoredStep(NamedTuple):
    """One step of a batch as the PRM and the policy update read it."""
    prompt: list[int]  # token ids
    response: list[int]  # token ids
    old_logprobs: list[float] | None  # the rollout policy's, per response token


def score_responses(model, tokenizer, samples: list, micro_batch_size: int,
                    temperature: float) -> list[Tensor]:
    """Per-token log-probs (L_k,) of each sample's response (ScoredSteps: their .prompt and
    .response token ids), no grad, under softmax(logits / temperature). The policy's old
    log-probs and the PRM's come from this one function on the same micro-batches: while the
    two models are equal, so are their numbers, bit for bit, and every r_t is exactly 0."""
    model.eval()
    logp = scored_logprobs(model, [s.prompt for s in samples], [s.response for s in samples],
                           tokenizer.pad_token_id, micro_batch_size, temperature)
    return [row.cpu() for row in logp]


def step_rewards_per_trajectory(trajs: list[dict], prm_logp: list[Tensor],
                                old_logp: list[Tensor], beta: float) -> list[list[float]]:
    """Eq. 1 for every step of `trajs`; prm_logp and old_logp hold one (L,) tensor per step, in
    trajectory order, then step order."""
    assert len(prm_logp) == len(old_logp) == sum(len(tr["steps"]) for tr in trajs)
    prm_steps, old_steps, k = [], [], 0
    for tr in trajs:
        n = len(tr["steps"])
        prm_steps.append(prm_logp[k:k + n])
        old_steps.append(old_logp[k:k + n])
        k += n
    return [r.tolist() for r in implicit_step_rewards(prm_steps, old_steps, beta)]


def score_rollouts(args: Args, model, prm, tokenizer, trajs: list[dict]) -> list[ScoredStep]:
    """Algorithm 1 (3, 4): each step of `trajs`, in order, as a ScoredStep; with the PRM, also
    each trajectory's "step_rewards" (Eq. 1) from the PRM before its DPO step, the old log-probs
    scored as the PRM's are (score_responses). The baselines (prm None) keep the log-probs
    recorded at sampling."""
    steps = [s for tr in trajs for s in tr["steps"]]
    if prm is None:
        return [ScoredStep(s["prompt"], s["response_ids"], s["logprobs"]) for s in steps]
    replies = [ScoredStep(s["prompt"], s["response_ids"], None) for s in steps]
    with timer("old_logprobs"):
        old_logp = score_responses(model, tokenizer, replies, args.micro_batch_size,
                                   args.rollout_temperature)
    with timer("prm_logprobs"):
        prm_logp = score_responses(prm, tokenizer, replies, args.micro_batch_size,
                                   args.rollout_temperature)
    step_rewards = step_rewards_per_trajectory(trajs, prm_logp, old_logp, args.beta)
    for tr, rewards in zip(trajs, step_rewards, strict=True):
        tr["step_rewards"] = rewards
    return [step._replace(old_logprobs=lp.tolist()) for step, lp in zip(replies, old_logp)]


def prm_update(args: Args, prm, tokenizer, optimizer, batch: list[dict], samples: list[ScoredStep],
               mine: slice, iteration: int) -> dict:
    """One DPO step of the PRM on the batch's preference pairs (Eq. 2).

    batch: every process's summarized trajectories with their "step_rewards" (raw, from the PRM
    before this step); batch[mine]: this process's trajectories (whole_batch); samples: their
    steps, in trajectory order, then step order.
    The gradient is exactly that of the batch's DPO loss, taken in micro-batches: dLoss/dr_t from
    the scored rewards first, then sum_t dLoss/dr_t * r_t(phi) backpropagated through the PRM.
    Steps of trajectories in no pair have dLoss/dr_t = 0 and are skipped."""
    rewards = [torch.tensor(t["step_rewards"], dtype=torch.float64, requires_grad=True)
               for t in batch]
    outcomes, groups = [float(t["won"]) for t in batch], [t["group"] for t in batch]
    loss, n_pairs = trajectory_dpo_loss(rewards, outcomes, groups, traj_agg=args.traj_agg)
    if n_pairs == 0:  # every group all won or all lost: nothing to prefer, no step
        return {"prm/pairs": 0}
    # Both on a batch the PRM has not trained on, before its step: log 2 and 0.5 = no preference.
    accuracy, _ = dpo_pair_accuracy([r.detach() for r in rewards], outcomes, groups,
                                    traj_agg=args.traj_agg)
    stats = {"prm/dpo_loss": loss.item(), "prm/pair_accuracy_before": accuracy,
             "prm/pairs": n_pairs}
    loss.backward()
    # dLoss/dr_t per step of this process; a trajectory in no pair got no gradient: 0.
    coefficients = [c for r in rewards[mine] for c in (r.grad if r.grad is not None
                                                       else torch.zeros(len(r))).tolist()]
    assert len(coefficients) == len(samples), "samples must be the steps of batch[mine]"
    trained = [k for k, c in enumerate(coefficients) if c != 0]
    lengths = [len(s.prompt) + len(s.response) for s in samples]
    params = [p for p in prm.parameters() if p.requires_grad]
    device = next(prm.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    prm.eval()  # the gradient of the very function that scored the rewards (no dropout)
    for idx in length_sorted_chunks(trained, lengths, args.micro_batch_size):
        logp, mask, _ = response_logprobs(prm, [samples[k].prompt for k in idx],
                                          [samples[k].response for k in idx],
                                          tokenizer.pad_token_id,
                                          temperature=args.rollout_temperature)
        old = pad_rows([torch.as_tensor(samples[k].old_logprobs) for k in idx],
                       logp.shape[1]).to(device)
        step_rewards = torch.stack([implicit_step_reward(logp[j], old[j], args.beta, mask[j])
                                    for j in range(len(idx))])  # Eq. 1, with grad
        weights = torch.tensor([coefficients[k] for k in idx], dtype=step_rewards.dtype,
                               device=device)
        (weights * step_rewards).sum().backward()
    sum_across_processes(params, 0.0)  # data parallel: one loss everywhere, the gradients add up
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.prm_max_grad_norm).item()
    check_finite(f"iteration {iteration}, PRM step", loss=loss.item(), grad_norm=grad_norm)
    optimizer.step()
    stats["prm/grad_norm"] = grad_norm
    if PartialState().num_processes == 1:  # this process's count: the batch's with one process
        stats["prm/trained_steps"] = len(trained)
    return stats


# ---- 3. Policy loss (Eq. 6) ---------------------------------------------------------------------
def policy_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """(B, L) -> (B, L) pi / pi_old per token; 1 where masked (masked before the exp, as k3_kl)."""
    return torch.exp(torch.where(mask.bool(), logp - old_logp, torch.zeros_like(logp)))


def k3_kl(ref_logp: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """(B, L) -> (B, L) k3 estimate of KL(pi || ref) per token, exp(d) - d - 1 with d = ref - logp
    ("low_var_kl", clamped to [-10, 10]); 0 at masked positions, where d is zeroed before the exp:
    inf there would give a NaN gradient even behind a zero mask."""
    log_ratio = torch.where(mask.bool(), ref_logp - logp, torch.zeros_like(logp))
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor, advantages: Tensor,
                  mask: Tensor, clip_eps: float = 0.2, kl_coef: float = 0.0,
                  entropy: Tensor | None = None, entropy_coef: float = 0.0,
                  clip_ratio_c: float | None = None) -> Tensor:
    """Token-level clipped surrogate (Eq. 6) + k3 KL (off: kl_coef 0) - entropy bonus, token-mean.

    logp, old_logp, ref_logp, mask (and entropy): (B, L); advantages: (B,) one value per step,
    used for every token of its response, or (B, L). Values at masked positions never matter.
    clip_ratio_c: dual clip, the loss of a token with A < 0 is at most -c * A."""
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = policy_ratio(logp, old_logp, mask)
    pg_loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    if clip_ratio_c is not None:
        bounded = torch.min(pg_loss, -clip_ratio_c * advantages)
        pg_loss = torch.where(advantages < 0, bounded, pg_loss)
    per_token = pg_loss + kl_coef * k3_kl(ref_logp, logp, mask)
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


# ---- 4. Arguments -------------------------------------------------------------------------------
@dataclass
class Args(HarnessArgs):
    """iStar (and the RLOO / GRPO baselines) for multi-turn LLM agents."""

    exp_name: str = "istar"  # runs/<exp-name>__<env>__<advantage>__<seed>__<time>
    seed: int = 1  # seeds python, numpy, torch and the evaluations' own generator
    # household (built in) or alfworld (needs $ALFWORLD_DATA; docs/environments.md)
    env: Literal["household", "alfworld"] = "household"
    # local dir, hub id or Qwen name; tiny, tiny-weak, tiny-alfworld (ALFWorld), tiny-scratch (BC)
    model: str = "tiny"
    # rollout generation: transformers generate, its continuous batching, or vLLM (GPU)
    backend: Literal["hf", "hf-cb", "vllm"] = "hf"

    # Advantage estimator and implicit PRM

    # istar (Eqs. 1-6 on the --estimator baseline), or the plain rloo / grpo baselines
    advantage: Literal["istar", "rloo", "grpo"] = "istar"
    # iStar's group baseline: rloo (leave-one-out, main results) or grpo (Eqs. 3-4)
    estimator: Literal["rloo", "grpo"] = "rloo"
    step_weight: float = 1.0  # alpha, weight of the step advantage (Eq. 5); 0: --estimator alone
    beta: float = 0.05  # beta, scale of the implicit step reward (Eq. 1) and DPO logits (Eq. 2)
    traj_agg: Literal["mean", "sum"] = "mean"  # DPO trajectory score: mean r_t (code), sum (Eq. 2)
    # r_t in the advantage: max_abs divides by the batch's max |r| + 1e-6 (the code's); none: raw
    step_reward_scale: Literal["max_abs", "none"] = "max_abs"
    success_reward: float = 10.0  # outcome r_o of a won episode (a lost one gets 0; the code's 10)
    use_std: bool = False  # GRPO divides by the group std (the paper); off: the mean (the code)
    prm_learning_rate: float = 5e-4  # PRM's AdamW learning rate (LoRA), one DPO step per iteration
    prm_max_grad_norm: float = 10.0  # gradient-norm clip of the PRM's step (the code's 10)
    invalid_action_penalty: float = 0.01  # off a malformed reply's advantage (e.g. no <action>)

    # RL
    iterations: int = 8  # training iterations; 0 = behavior cloning and the start evaluation
    tasks_per_iteration: int = 4  # training tasks per iteration, each played --group-size times
    group_size: int = 8  # N trajectories per task (a group); 1: no baseline and no DPO pair
    max_episode_steps: int = 30  # step limit of a game
    learning_rate: float = 2.5e-4  # AdamW learning rate of the policy's LoRA weights
    weight_decay: float = 0.0  # AdamW weight decay of the RL update
    clip_eps: float = 0.2  # PPO clip range epsilon of the ratio (Eq. 6)
    clip_ratio_c: float | None = None  # dual clip c > 1: for A < 0 the loss is at most -c * A
    kl_coef: float = 0.0  # k3 KL penalty to the reference; 0, as the paper: no reference pass
    entropy_coef: float = 0.0  # weight of the entropy bonus
    ppo_epochs: int = 1  # passes over an iteration's step samples
    minibatch_size: int = 256  # step samples per optimizer step
    micro_batch_size: int = 16  # step samples per forward pass
    max_grad_norm: float = 1.0  # gradient-norm clip of every optimizer step
    rollout_temperature: float = 1.0  # sampling temperature of training rollouts (PPO scores so)
    max_new_tokens: int = 12  # response length limit
    history_length: int = 1  # past (observation, action) pairs shown in the prompt
    reasoning: bool = False  # ask for <think> reasoning before the action

    # LoRA
    lora_r: int = 16  # LoRA rank of the RL adapter (and of BC without --bc-full-params)
    lora_alpha: int = 32  # LoRA alpha (the update is scaled by alpha / r)
    lora_dropout: float = 0.0  # dropout on the LoRA input
    lora_target_modules: str = "all-linear"  # comma-separated module names, or all-linear

    # Behavior cloning on expert trajectories (the paper starts RL from an Instruct model instead)
    bc_epochs: int = 0  # epochs of behavior cloning on expert demonstrations; 0 skips it
    bc_full_params: bool = True  # train every weight during BC instead of a LoRA adapter
    bc_num_tasks: int = 400  # training tasks the expert plays for BC demonstrations
    bc_noise: float = 0.2  # share of demonstration steps that execute a mistake (label: expert's)
    bc_prompt_loss_weight: float = 1.0  # weight of the prompt tokens' next-token loss in BC
    bc_learning_rate: float = 2e-3  # AdamW learning rate of behavior cloning
    bc_batch_size: int = 8  # demonstration steps per BC update

    # Evaluation
    eval_splits: tuple[str, ...] = ("test",)  # splits to evaluate on, the first is the headline
    eval_every: int = 8  # iterations between evaluations, besides iteration 0 and the last
    eval_num_tasks: int = 200  # first tasks of each split to evaluate; 0 = the whole split
    eval_draws: int = 1  # episodes per evaluated task (keyed draws 0, 1, ...); success: their mean
    eval_temperature: float = 0.4  # sampling temperature of evaluation (the papers'; 0: greedy)
    eval_top_p: float = 1.0  # nucleus sampling of evaluation (1: off; training never truncates)
    save_every: int = 2  # iterations between checkpoints (the last iteration is always saved)


# The defaults above are the tiny models' (--model tiny, tiny-weak). --model picks one row of
# PRESETS on top of them: tiny-scratch and tiny-alfworld their own, any other model "real" (a
# "baseline" row, where a script has one, follows for another --advantage). The harness's own
# fields (device, max_prompt_tokens, ...) are HarnessArgs', in common/config.py.
PRESETS = {
    "tiny-scratch": dict(bc_epochs=3),
    "tiny-alfworld": dict(max_episode_steps=50, eval_splits=("valid_unseen",), eval_num_tasks=0),
    "real": dict(iterations=200, tasks_per_iteration=16, max_episode_steps=50, learning_rate=5e-6,
                 prm_learning_rate=1e-5, minibatch_size=64, micro_batch_size=8,
                 gradient_checkpointing=True, max_new_tokens=512, history_length=2,
                 reasoning=True, bc_epochs=0, bc_full_params=False, bc_prompt_loss_weight=0.0,
                 bc_learning_rate=1e-4, bc_batch_size=16, eval_every=5, eval_num_tasks=0),
    # --advantage rloo / grpo by --model (tiny-scratch: "tiny"): twice iStar's policy rate, as the
    # code (docs/istar.md; --step-weight 0 keeps iStar's); plain GRPO divides by the std (veRL's).
    "tiny baseline": dict(learning_rate=5e-4, use_std=True),
    "real baseline": dict(learning_rate=1e-5, use_std=True),
}
RANGES = {  # the method's flags; common/config.py's RANGES: the harness's
    "step_weight": ">= 0", "beta": "> 0", "success_reward": "> 0", "prm_learning_rate": "> 0",
    "prm_max_grad_norm": "> 0", "invalid_action_penalty": ">= 0",
}


# ---- 5. Rollouts --------------------------------------------------------------------------------
def rollout(args: Args, tokenizer, policy: Policy | None, tasks: list, group_ids: list,
            temperature: float, top_p: float = 1.0, expert_rng: random.Random | None = None,
            desc: str | None = None, keys: list[tuple] | None = None,
            progress: bool = False) -> list[dict]:
    """Play one game per task in lock-step until all finish (desc: EnvBatch's progress line).
    keys: one per game, where it stands (e.g. seed, "train", iteration, group, episode); step s of
    game i draws its tokens by (*keys[i], s) (--sampler keyed), whatever else the batch holds.
    progress: the games label every step with the env's oracle (envs.ProgressGame).

    With expert_rng given (and policy None), the env's expert acts instead of the policy
    (behavior-cloning data): each step records the expert's action as "label", but with
    probability args.bc_noise a mistake is executed instead (envs.noisy_expert).

    Each trajectory is a dict: "task" (its text), "task_type", "group" (its group_ids entry),
    "won", "rewards" [r_t], and "steps", one dict per step:
        "prompt", "response_ids": token ids; "logprobs": of the response tokens as sampled (at a
            temperature > 0 without top-p, as every training rollout; else None);
        "state": the observation (GiGPO's and ProxMO's anchor text); "admissible": the actions
            the prompt listed; "action": the command executed; "next_state": what it got;
        "valid": the action was admissible (the env's word); "parsed": the reply had an
            <action> tag; "well_formed": is_well_formed (also <think> with --reasoning, no
            Chinese); "label": the expert's action (behavior cloning), else None; "progress":
            the oracle's label of the step (with `progress`), else None."""
    games = [envs.make_game(args.env, t, args.max_episode_steps, expert=expert_rng is not None,
                            workers=args.env_workers, progress=progress) for t in tasks]
    env_batch = EnvBatch(games, desc, args.max_episode_steps)
    env_batch.reset()
    trajs = [{"task": g.task_description, "task_type": g.task_type, "group": gid, "won": False,
              "rewards": [], "steps": []} for g, gid in zip(games, group_ids)]
    histories = [[] for _ in games]  # each game's (observation, action) pairs so far
    while env_batch.active():
        active = env_batch.active()
        states = {i: env_batch.observations[i] for i in active}
        with timer("prompts"):
            admissible = [games[i].admissible_actions() for i in active]
            prompts = [encode_prompt(args, tokenizer, games[i].task_description, histories[i],
                                     states[i], admissible[k], len(trajs[i]["steps"]) + 1)
                       for k, i in enumerate(active)]
        with timer("generation"):
            if expert_rng is not None:
                responses = logprobs = [None] * len(active)
                demos = [envs.noisy_expert(games[i], histories[i], args.bc_noise, expert_rng)
                         for i in active]
                labels = [label for label, _ in demos]  # None: BC skips the step
                commands = [command for _, command in demos]
                well_formed = has_action = [True] * len(active)
            else:
                step_keys = None
                if keys is not None:  # each step's key: its game's and the step's index
                    step_keys = [(*keys[i], len(trajs[i]["steps"])) for i in active]
                responses, logprobs = policy.generate(prompts, temperature, top_p, step_keys)
                logprobs = logprobs or [None] * len(active)
                texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
                parsed = [parse_action(t) for t in texts]
                # No <action> tag: the env gets the reply's tail, which is never admissible.
                commands = [p if p is not None else t[-30:] for p, t in zip(parsed, texts)]
                labels = [None] * len(active)
                has_action = [p is not None for p in parsed]
                well_formed = [is_well_formed(t, args.reasoning) for t in texts]
        with timer("env"):
            results = env_batch.step(dict(zip(active, commands)))
        for k, i in enumerate(active):
            obs, reward, done, info = results[i]
            tr = trajs[i]
            tr["steps"].append({"prompt": prompts[k], "response_ids": responses[k],
                                "logprobs": logprobs[k], "state": states[i],
                                "admissible": admissible[k], "action": commands[k],
                                "next_state": obs, "valid": bool(info["valid"]),
                                "parsed": has_action[k], "well_formed": well_formed[k],
                                "label": labels[k], "progress": info.get("progress")})
            tr["rewards"].append(reward)
            histories[i].append((states[i], commands[k]))
            tr["won"] = bool(info["won"])
    return trajs


# ---- 6. Behavior cloning on expert trajectories -------------------------------------------------
def bc_loss(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
            prompt_weight: float = 0.0) -> tuple[Tensor, Tensor]:
    """(loss, response_loss): mean cross-entropy of the response tokens, plus prompt_weight times
    the mean next-token cross-entropy of the prompt tokens ("train on inputs": it teaches a
    randomly initialised model to copy from its context, which the actions need; prompt_weight
    0, for a pretrained model: only the response logits are computed)."""
    if prompt_weight == 0:
        logp, mask, _ = response_logprobs(model, prompts, responses, pad_id)
        response_loss = -(logp * mask).sum() / mask.sum()
        return response_loss, response_loss
    response_loss, prompt_loss = next_token_losses(model, prompts, responses, pad_id)
    return response_loss + prompt_weight * prompt_loss, response_loss


def behavior_cloning(args: Args, model, tokenizer, train_tasks: list) -> dict:
    """SFT on the env expert's trajectories: cross-entropy on the response tokens (plus, with
    --bc-prompt-loss-weight, on the prompt tokens; see bc_loss). Trains the parameters of `model`
    that require grad (a LoRA adapter, or all of them) in place."""
    t0 = time.time()
    rng = random.Random(args.seed + 1)
    tasks = rng.sample(train_tasks, min(args.bc_num_tasks, len(train_tasks)))
    demos = rollout(args, tokenizer, None, tasks, list(range(len(tasks))), 0.0, expert_rng=rng,
                    desc=f"expert demonstrations ({len(tasks)} tasks)")
    samples = []
    for s in [s for tr in demos for s in tr["steps"] if s["label"] is not None]:
        reply = tokenizer(expert_response(s["label"], args.reasoning), add_special_tokens=False)
        samples.append((s["prompt"], reply.input_ids + [tokenizer.eos_token_id]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.bc_learning_rate, weight_decay=0.0)
    window = 16 * args.bc_batch_size  # a multiple of the batch size: ceil(n / size) batches
    total_steps = args.bc_epochs * math.ceil(len(samples) / args.bc_batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / max(total_steps, 1))
    print(f"behavior cloning: {len(demos)} expert trajectories, {len(samples)} steps, "
          f"{args.bc_epochs} epochs, {total_steps} updates")
    model.train()
    progress = Progress(total_steps, "bc")
    loss_value = float("nan")
    lengths = [len(p) + len(r) for p, r in samples]
    for _ in range(args.bc_epochs):
        # Batches of similar length (less padding), visited in random order; members drawn from a
        # random window of 16 batches so that each batch still mixes tasks.
        order = list(range(len(samples)))
        rng.shuffle(order)
        batches = [b for w in range(0, len(order), window)
                   for b in length_sorted_chunks(order[w:w + window], lengths, args.bc_batch_size)]
        rng.shuffle(batches)
        for batch in batches:
            chunk = [samples[i] for i in batch]
            loss, response_loss = bc_loss(model, [c[0] for c in chunk], [c[1] for c in chunk],
                                          tokenizer.pad_token_id, args.bc_prompt_loss_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            check_finite(f"behavior cloning, update {progress.count + 1}", loss=loss.item(),
                         grad_norm=grad_norm.item())
            optimizer.step()
            scheduler.step()
            loss_value = response_loss.item()
            progress.update(1, loss=loss_value)
    progress.close()
    return {"bc/loss": loss_value, "bc/steps": len(samples), "bc/seconds": time.time() - t0,
            "bc/demo_success": float(np.mean([t["won"] for t in demos]))}


def clone_start(args: Args, run: Run, model, tokenizer, train_tasks: list):
    """The start RL begins from, cloned from the expert: every weight trained, or a LoRA adapter
    merged in after (--no-bc-full-params); frozen, its stats logged at iteration 0."""
    if not args.bc_full_params:
        model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout,
                         args.lora_target_modules)
    stats = behavior_cloning(args, model, tokenizer, train_tasks)
    if not args.bc_full_params:
        model = merge_lora(model)
    model.requires_grad_(False)
    print(f"behavior cloning done in {stats['bc/seconds']:.0f}s "
          f"(final loss {stats['bc/loss']:.3f})")
    run.log(stats, 0)
    return model


# ---- 7. Evaluation ------------------------------------------------------------------------------
def evaluate(args: Args, policy: Policy, split: str, tasks: list) -> dict:
    """Success rate overall and per task type, and grounding accuracy: the share of admissible
    actions over all steps, and its mean over trajectories (SPA's definition). With several
    processes each plays its share of the tasks; the stats are of all."""
    games, ids = my_share(tasks, args.eval_draws)  # data parallel: this process's; one: all
    # Each task --eval-draws times. Keyed: episode d of game i draws by (seed, "eval", split, i,
    # d), so every evaluation of a seed, at any iteration and in any run, draws alike.
    keys = episode_keys((args.seed, "eval", split), ids)
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        trajs = rollout(args, policy.tokenizer, policy, games, ids, args.eval_temperature,
                        args.eval_top_p, desc=f"eval {split} (steps)", keys=keys)
    trajs, _ = whole_batch([summarize(t) for t in trajs])  # every process's; one: these
    steps = [s for t in trajs for s in t["steps"]]
    stats = {f"eval_{split}/success": float(np.mean([t["won"] for t in trajs])),
             f"eval_{split}/grounding": float(np.mean([s["valid"] for s in steps])),
             f"eval_{split}/grounding_per_trajectory": float(np.mean(
                 [np.mean([s["valid"] for s in t["steps"]]) for t in trajs])),
             f"eval_{split}/episode_length": float(np.mean([len(t["steps"]) for t in trajs])),
             f"eval_{split}/tasks": len({t["group"] for t in trajs})}
    for task_type in sorted({t["task_type"] for t in trajs}):
        wins = [t["won"] for t in trajs if t["task_type"] == task_type]
        stats[f"eval_{split}/success_{envs.SHORT_TYPE_NAMES[task_type]}"] = float(np.mean(wins))
    # Per episode, by its task's index in the split: [index, won 0/1, steps] (kept, not logged).
    stats[f"eval_{split}/outcomes"] = sorted([t["group"], int(t["won"]), len(t["steps"])]
                                             for t in trajs)
    return stats


# ---- 8. Training loop ---------------------------------------------------------------------------
# Data parallel (common/dist.py): each process plays whole groups and sums its gradients with
# the others'; `python <script>.py` is one process, and nothing communicates.
class StepSample(NamedTuple):
    """One step of the batch as the PPO update reads it."""
    prompt: list[int]  # token ids
    response: list[int]  # token ids
    advantage: float
    old_logprobs: list[float]  # of the response tokens (score_rollouts: recorded or scored)


def policy_update(args: Args, model, tokenizer, optimizer, samples: list[StepSample],
                  generator: torch.Generator, iteration: int) -> dict:
    """PPO over the step samples: reference log-probs first (none without a KL term; the old
    ones come with the samples), then `ppo_epochs` passes of shuffled mini-batches. Data parallel:
    `samples` is this process's share of the batch, in process order; the mini-batches are drawn
    as one process would draw them, and the update is the sum of every process's gradients."""
    pad, mb = tokenizer.pad_token_id, args.micro_batch_size
    temperature = args.rollout_temperature  # the sampling policy: softmax(logits / temperature)
    device = next(model.parameters()).device
    prompts = [s.prompt for s in samples]
    responses = [s.response for s in samples]
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    model.eval()  # no dropout in the reference pass
    old_logp = [torch.tensor(s.old_logprobs) for s in samples]  # as sampled: no scoring pass
    with timer("ref_logprobs"):
        ref_logp = old_logp  # without a KL term it only fills the unused argument
        if args.kl_coef > 0:
            with model.disable_adapter():  # the reference: the start
                ref_logp = scored_logprobs(model, prompts, responses, pad, mb, temperature)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    stats = defaultdict(list)
    response_lengths = [len(r) for r in responses]
    # ppo_epochs fresh shuffles, each cut into mini-batches of --minibatch-size (the last may be
    # smaller), one optimizer step each. A MiniBatch: .mine, this process's members (indices into
    # `samples`); .size, .tokens: its samples and response tokens, all processes; .epoch, .start.
    for mini in minibatches(response_lengths, args.minibatch_size, args.ppo_epochs, generator):
        optimizer.zero_grad(set_to_none=True)
        minibatch_loss = 0.0
        # This process's members (mini.mine) in micro-batches, any order: the gradient is a sum.
        for idx in length_sorted_chunks(mini.mine, lengths, mb):
            # Each (micro-batch, R): R its longest response; mask 1 on response tokens.
            logp, mask, entropy = response_logprobs(
                model, [prompts[i] for i in idx], [responses[i] for i in idx], pad,
                with_entropy=args.entropy_coef > 0, temperature=temperature)
            old = pad_rows([old_logp[i] for i in idx], logp.shape[1]).to(device)
            ref = pad_rows([ref_logp[i] for i in idx], logp.shape[1]).to(device)
            adv = torch.tensor([samples[i].advantage for i in idx], dtype=torch.float32,
                               device=device)
            loss = ppo_clip_loss(logp, old, ref, adv, mask, args.clip_eps, args.kl_coef,
                                 entropy, args.entropy_coef, args.clip_ratio_c)
            # This micro-batch's part of the mini-batch's token-mean: its loss (a mean over its
            # tokens) weighted by its share of the mini-batch's tokens; the parts add up.
            share = loss * mask.sum() / mini.tokens
            share.backward()
            minibatch_loss += share.item()
            with torch.no_grad():
                ratio = policy_ratio(logp, old, mask)
                clipped = ((ratio - 1).abs() > args.clip_eps).float()
                stats["clip_fraction"].append(((clipped * mask).sum() / mask.sum()).item())
                if args.kl_coef > 0:  # else `ref` is the rollout policy, not the reference
                    kl = (k3_kl(ref, logp, mask) * mask).sum() / mask.sum()
                    stats["kl_ref"].append(kl.item())
        # Data parallel: every process's gradients (and loss) summed; one process: unchanged.
        minibatch_loss = sum_across_processes(params, minibatch_loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        check_finite(f"iteration {iteration}, PPO epoch {mini.epoch + 1}, mini-batch at "
                     f"{mini.start}", loss=minibatch_loss, grad_norm=grad_norm)
        stats["loss"].append(minibatch_loss)
        stats["grad_norm"].append(grad_norm)
        optimizer.step()
    return {f"train/{k}": v for k, v in mean_across_processes(stats).items()}


def batch_stats(args: Args, batch: list[dict], advantages: list[Tensor]) -> dict:
    """What the log shows of an iteration's batch (every process's summaries, with their
    advantages); with iStar, also its step rewards and the step term's shares of |A|."""
    stats = rollout_stats(batch, advantages)
    if args.advantage == "istar":
        rewards = [r for tr in batch for r in tr["step_rewards"]]
        stats.update({"prm/step_reward_mean": float(np.mean(rewards)),
                      "prm/step_reward_abs_max": float(np.max(np.abs(rewards)))})
        shares = step_term_shares(istar_step_terms(args, batch), advantages,
                                  [t["won"] for t in batch], [t["group"] for t in batch])
        stats.update({f"credit/{k}": v for k, v in shares.items() if not math.isnan(v)})
    return stats


# The command line (common/config.py): value checks, --model/--env/--advantage presets, parsing.
def validate_args(args: Args) -> list[str]:
    return config.errors(args, RANGES)


def preset_args(model: str = "tiny", env: str = "household", advantage: str | None = None) -> Args:
    return config.preset_args(Args, PRESETS, model, env, advantage)


def parse_args(argv: list[str]) -> Args:
    return config.parse_args(Args, PRESETS, argv)


def main(args: Args) -> dict:
    method = f"istar-{args.estimator}" if args.advantage == "istar" else args.advantage
    run, train_tasks, eval_tasks = start_run(args, __file__, validate_args(args), method)
    if args.group_size == 1:
        print("warning: --group-size 1: no baseline (an episode advantage is its raw outcome) "
              "and no DPO pair (the PRM never learns)", file=sys.stderr)

    # Model: the start (--model, or cloned from the expert first), then RL's LoRA adapter.
    model, tokenizer = run.load_model()
    run.open()  # only now: a run stopped by bad flags or missing data leaves nothing

    if args.bc_epochs > 0 and not args.resume:
        model = clone_start(args, run, model, tokenizer, train_tasks)
    start_path = run.keep_base(model, tokenizer)  # the start's directory or hub id
    prm, prm_optimizer = implicit_prm(args, run, model)  # a copy, before the policy's adapter
    if args.resume:
        model = load_lora(model, run.checkpoint)
    else:
        model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout,
                         args.lora_target_modules)
    model.print_trainable_parameters()
    prm_weights = list(prm.parameters()) if prm is not None else []
    same_start([*model.parameters(), *prm_weights], args.seed)  # process 0's weights

    engine = make_vllm_engine(start_path, args) if args.backend == "vllm" else None
    policy = Policy(args, model, tokenizer, engine)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.learning_rate, weight_decay=args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    task_rng = random.Random(args.seed)
    start_iteration = run.restore(optimizer=optimizer, prm_optimizer=prm_optimizer,
                                  generator=generator, task_rng=task_rng)

    progress = Progress(args.iterations, "rl", initial=start_iteration, interval=0)
    evaluate_splits = partial(evaluate, args, policy)  # (split, tasks) -> its stats

    if start_iteration == 0:
        policy.sync(run.path)  # vLLM reads the adapter from disk; hf: nothing to do
        run.evaluate(0, eval_tasks, evaluate_splits)
    for iteration in range(start_iteration + 1, args.iterations + 1):
        t0 = time.time()
        timings()  # the clocks restart: evaluations and set-up are not the iteration's
        # Algorithm 1. (1) B tasks x N copies, lock-step rollouts of pi_old, (2) outcomes.
        batch_tasks = task_rng.sample(train_tasks, args.tasks_per_iteration)
        policy.sync(run.path)
        # Each task N times, a group (id: its index in the batch); this process's groups only.
        tasks, groups = my_share(batch_tasks, args.group_size)
        trajs = rollout(args, tokenizer, policy, tasks, groups, args.rollout_temperature,
                        keys=episode_keys((args.seed, "train", iteration), groups))
        rollout_seconds = time.time() - t0
        # (3, 4) Eq. 1: old log-probs and step rewards, from the PRM before its DPO step.
        scored = score_rollouts(args, model, prm, tokenizer, trajs)
        # (6, 7) advantages over the whole batch (r_t over its max |r|); each process keeps its own
        with timer("advantages"):
            # batch: every process's (one process: trajs'); mine: where trajs' lie among them
            batch, mine = whole_batch([summarize(t) for t in trajs])
            batch_advantages = compute_advantages(args, batch)
            advantages = batch_advantages[mine]
        prm_stats = {}
        if prm is not None:  # (5) Eq. 2: the PRM's DPO step on the won-lost pairs, after (4)
            with timer("prm_update"):
                prm_stats = prm_update(args, prm, tokenizer, prm_optimizer, batch, scored, mine,
                                       iteration)
        samples = [StepSample(s.prompt, s.response, float(a), s.old_logprobs)  # this process's
                   for s, a in zip(scored, [a for adv in advantages for a in adv])]
        # (8, 9) the clipped policy-gradient update (Eq. 6); the next rollouts are pi_old's.
        policy.sleep()  # --vllm-sleep: the engine's memory to the update
        with timer("update"):  # less the reference pass, timed as ref_logprobs
            stats = policy_update(args, model, tokenizer, optimizer, samples, generator, iteration)
        batch_tokens, _ = whole_batch([len(s.response) for s in samples])  # every process's
        stats.update({**prm_stats, **batch_stats(args, batch, batch_advantages),
                      "rollout/tokens_per_second": sum(batch_tokens) / max(rollout_seconds, 1e-9),
                      "time/rollout_seconds": rollout_seconds,
                      "time/iteration_seconds": time.time() - t0})
        stats.update(timings())  # where the time went: each timer("x") above as time/x_seconds
        stats.update(policy.stats())  # vLLM: its log-probs' gap to the trainer's
        run.log(stats, iteration)
        prm_shown = {}  # the PRM's step (nan: no won-lost pair, no step); baselines have none
        if prm is not None:
            prm_shown = {"dpo": stats.get("prm/dpo_loss", float("nan")),
                         "pair_acc": stats.get("prm/pair_accuracy_before", float("nan"))}
        progress.update(1, success=stats["rollout/success"], grounding=stats["rollout/grounding"],
                        **prm_shown, rollout_s=round(rollout_seconds),
                        update_s=round(stats["time/update_seconds"]),
                        iter_s=round(stats["time/iteration_seconds"]))
        if iteration % args.eval_every == 0 or iteration == args.iterations:
            policy.sync(run.path)
            run.evaluate(iteration, eval_tasks, evaluate_splits)
        if iteration % args.save_every == 0 or iteration == args.iterations:
            run.save(model, start_path, iteration, adapters={"prm": prm},
                     optimizer=optimizer, prm_optimizer=prm_optimizer, generator=generator,
                     task_rng=task_rng)
    progress.close()
    summary = run.finish()  # summary.json first: closing a backend cannot cost it
    policy.close()
    return summary


if __name__ == "__main__":
    config.run_command_line(main, parse_args)  # a bad flag: exit status 2; a NaN loss: 1
