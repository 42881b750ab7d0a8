"""ProxMO: Proximity-based Multi-turn Optimization (Fang et al., 2026), single-file reference.

ProxMO is GiGPO with two changes to the advantage:
  * episode level (PSC, the Polarized Signal Controller, Eqs. 5-7): the GRPO z-score of each
    trajectory's 0/1 outcome is scaled by a weight w(R, p) that depends on the group's success rate
    p - rare successes are pushed up a little, failures in easy groups are penalised a little less;
  * step level (PSA, Proximity-based Soft Aggregation, Eqs. 8-11): every step's baseline is a
    softmax(similarity / tau)-weighted mean of the discounted returns of all steps of its task
    group, the similarity being TF-IDF cosine between the observation texts; step advantage =
    own return - soft baseline. The env's reward is 1 on the winning step, 0 on every other step.
  A = modulated episode advantage + omega * step advantage (Eq. 12), minus --invalid-action-penalty
  on a step whose reply is malformed (ours: the paper has no such term), optimised with PPO-clip
  and a KL penalty to the reference policy (Eq. 13). No critic, no learned reward model.

Run:
    python proxmo.py                        # tiny model, built-in household, minutes on a CPU
    python proxmo.py --advantage grpo       # the GRPO baseline on the same harness
    python proxmo.py --env alfworld --model Qwen2.5-1.5B-Instruct --backend vllm   # the paper's
    accelerate launch --multi_gpu --num_processes 8 proxmo.py --env alfworld ...  # data parallel

Sections: 1 ProxMO advantages, 2 GRPO/GiGPO baselines and the oracle, 3 policy loss, 4 arguments,
5 rollouts, 6 behavior cloning, 7 evaluation, 8 training loop.
To read: sections 1-3 tell the method, 8 the loop (`main`: rollout -> reward -> advantage ->
update, then `policy_update`); 4 (the flags) and 5-7 (the harness, alike in every script) can wait.
"""

from __future__ import annotations

import math
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Literal, NamedTuple

import numpy as np

# Before torch loads OpenMP: waiting threads sleep, not spin (docs/performance.md), unless set.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from torch import Tensor

import envs
from common import config
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


# ---- 1. ProxMO advantages (pure functions, float64, no grad) ------------------------------------
TOKEN_RE = re.compile(r"(?u)\b\w\w+\b")


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """(T,) -> (T,), Eq. 8: R_t = r_t + gamma * R_{t+1}, R_T = r_T."""
    out = torch.zeros(len(rewards), dtype=torch.float64)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def tfidf_vectors(texts: list[str], max_features: int = 1024) -> Tensor:
    """(M, V) TF-IDF rows, L2-normalised; a text with no token keeps an all-zero row (Eq. 9).

    scikit-learn's TfidfVectorizer(max_features=max_features) written out: lowercase, tokens =
    runs of 2+ word characters, tf = raw count, idf = ln((1 + n) / (1 + df)) + 1, the
    `max_features` terms with the largest total count. Equal to it to 1e-15 (scikit-learn 1.9.1,
    1,344 household observations) wherever the vocabulary fits max_features; at a cut, count ties
    go alphabetically here, by an unstable sort there."""
    docs = [Counter(TOKEN_RE.findall(t.lower())) for t in texts]
    totals = Counter(w for d in docs for w in d.elements())  # how often w occurs in all texts
    df = Counter(w for d in docs for w in d)  # how many texts hold w
    terms = sorted(sorted(totals), key=lambda w: -totals[w])[:max_features]
    column = {w: j for j, w in enumerate(sorted(terms))}
    idf = torch.tensor([math.log((1 + len(texts)) / (1 + df[w])) + 1 for w in column],
                       dtype=torch.float64)
    vectors = torch.zeros(len(texts), len(column), dtype=torch.float64)
    for i, d in enumerate(docs):
        for w, count in d.items():
            if w in column:
                vectors[i, column[w]] = count
    vectors *= idf
    norms = vectors.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, vectors / norms.clamp(min=1e-300), vectors)


def cosine_similarity(vectors: Tensor) -> Tensor:
    """(M, V) unit (or zero) rows -> (M, M) cosine similarities (Eq. 9)."""
    return vectors @ vectors.T


def group_zscore(values: Tensor, eps: float = 1e-6, use_std: bool = True) -> Tensor:
    """(N,) -> (N,). All equal (N == 1 included) -> exact zeros; else (v - mean) / (sigma + eps)
    with the population std (Eq. 5), or v - mean when use_std is False."""
    values = values.to(torch.float64)
    if values.numel() == 0 or values.max() == values.min():
        return torch.zeros_like(values)
    centred = values - values.mean()
    return centred / (values.std(unbiased=False) + eps) if use_std else centred


def psc_weights(success: Tensor, p: float, alpha: float = 4.0, beta: float = 0.1) -> Tensor:
    """(N,) bool -> (N,) Eq. 6: w = 1 + beta * f, f(success) = sigmoid((1-p)^alpha) - 0.5,
    f(failure) = sigmoid(-(p^alpha)) - 0.5 (powers, not products); |w - 1| <= 0.231 * beta."""
    p = float(p)
    w_success = 1.0 + beta * (1.0 / (1.0 + math.exp(-((1.0 - p) ** alpha))) - 0.5)
    w_failure = 1.0 + beta * (1.0 / (1.0 + math.exp(p ** alpha)) - 0.5)
    return torch.where(success.bool(), torch.tensor(w_success, dtype=torch.float64),
                       torch.tensor(w_failure, dtype=torch.float64))


def proxmo_episode_advantages(outcomes: Tensor, alpha: float = 4.0, beta: float = 0.1,
                              eps: float = 1e-6, use_std: bool = True) -> Tensor:
    """(N,) outcomes of one group -> (N,) modulated episode advantages, Eq. 7: z-score * w(R, p),
    success = outcome > 0.5, p = success rate. beta = 0 gives plain GRPO."""
    success = outcomes > 0.5
    p = success.to(torch.float64).mean().item()
    return group_zscore(outcomes, eps, use_std) * psc_weights(success, p, alpha, beta)


def proximity_baselines(returns: Tensor, sim: Tensor,
                        temperature: float = 0.1) -> tuple[Tensor, Tensor]:
    """returns (M,) and sim (M, M) of the steps of ONE group -> (weights (M, M), baselines (M,)):
    weights = row-softmax(sim / temperature) (Eq. 10), baselines = weights @ returns (Eq. 11).
    `temperature` is Eq. 10's tau (--proximity-temperature), not the sampling temperature. A
    step's own return is in its baseline with the largest weight (its similarity to itself is 1,
    unless its text has no word of the vocabulary: then every weight is equal), so a step unlike
    every other of its group gets an advantage near 0. TF-IDF reads words of 2+ characters:
    "drawer 1" and "drawer 2" look alike."""
    logits = sim.to(torch.float64) / temperature
    weights = torch.softmax(logits - logits.max(dim=1, keepdim=True).values, dim=1)
    return weights, weights @ returns.to(torch.float64)


def proxmo_step_advantages(returns: list[Tensor], sim: Tensor,
                           temperature: float = 0.1) -> list[Tensor]:
    """Eq. 11 on one group: returns[i] (T_i,) of trajectory i; sim (M, M) over the flattened steps
    (trajectory-major, M = sum T_i) -> A^S = R - B, split back into one (T_i,) per trajectory."""
    flat = torch.cat([r.to(torch.float64) for r in returns])
    _, baselines = proximity_baselines(flat, sim, temperature)
    return list(torch.split(flat - baselines, [len(r) for r in returns]))


def proxmo_group_advantages(outcomes: Tensor, step_rewards: list[Tensor], sim: Tensor, *,
                            alpha: float = 4.0, beta: float = 0.1, temperature: float = 0.1,
                            gamma: float = 0.95, omega: float = 1.0, eps: float = 1e-6,
                            use_std: bool = True) -> list[Tensor]:
    """Eq. 12 on one group of N trajectories: A[i][t] = A~E[i] + omega * A^S[i][t]; outcomes (N,)
    in {0, 1}, step_rewards[i] (T_i,), sim (M, M) over the group's flattened steps -> N (T_i,)."""
    returns = [discounted_returns(r, gamma) for r in step_rewards]
    episode = proxmo_episode_advantages(outcomes, alpha, beta, eps, use_std)
    step = proxmo_step_advantages(returns, sim, temperature)
    return [episode[i] + omega * step[i] for i in range(len(step_rewards))]


def proxmo_batch_advantages(outcomes: list[float], step_rewards: list[Tensor],
                            states: list[list[str]], group_ids: list, max_features: int = 1024,
                            **hp) -> list[Tensor]:
    """A whole batch: TF-IDF is fitted once on ALL anchor texts of the batch (as released);
    similarities and baselines stay inside each group. Output aligned with the input order.
    hp: alpha, beta, temperature, gamma, omega, eps, use_std of proxmo_group_advantages."""
    vectors = tfidf_vectors([s for traj in states for s in traj], max_features)
    offsets = np.cumsum([0] + [len(s) for s in states])
    members: dict = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    out: list[Tensor] = [torch.empty(0)] * len(states)
    for idx in members.values():
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in idx])
        sim = cosine_similarity(vectors[rows])
        group_outcomes = torch.tensor([outcomes[i] for i in idx], dtype=torch.float64)
        advs = proxmo_group_advantages(group_outcomes, [step_rewards[i] for i in idx], sim, **hp)
        for i, a in zip(idx, advs):
            out[i] = a
    return out


# ---- 2. Baselines: GRPO (ProxMO at --psc-beta 0 --step-weight 0), GiGPO; the oracle; dispatch --
# GiGPO z-scores returns within exact-match anchor groups; PSA (section 1) softens them, no std.
def grpo_advantages(outcomes: Tensor, eps: float = 1e-6, use_std: bool = True) -> Tensor:
    """(N,) -> (N,) GRPO episode advantage (Eq. 5); the same value is used for every step."""
    return group_zscore(outcomes, eps, use_std)


def gigpo_step_advantages(returns: list[Tensor], states: list[list[str]], eps: float = 1e-6,
                          use_std: bool = True) -> list[Tensor]:
    """GiGPO step advantages of one group: anchor groups = steps whose state strings are exactly
    equal (any time index, any trajectory); group_zscore of the returns inside each anchor group
    (a singleton gets 0). returns[i], states[i] have length T_i; output (T_i,) per trajectory."""
    flat_returns = torch.cat([r.to(torch.float64) for r in returns])
    anchors: dict[str, list[int]] = defaultdict(list)
    for k, state in enumerate(s for traj in states for s in traj):
        anchors[state].append(k)
    out = torch.zeros_like(flat_returns)
    for rows in anchors.values():
        out[rows] = group_zscore(flat_returns[rows], eps, use_std)
    return list(torch.split(out, [len(r) for r in returns]))


def gigpo_group_advantages(outcomes: Tensor, step_rewards: list[Tensor], states: list[list[str]],
                           gamma: float = 0.95, omega: float = 1.0, eps: float = 1e-6,
                           use_std: bool = True) -> list[Tensor]:
    """GiGPO (its Eq. 8): A[i][t] = grpo_advantages[i] + omega * gigpo_step_advantages[i][t]."""
    returns = [discounted_returns(r, gamma) for r in step_rewards]
    episode = grpo_advantages(outcomes, eps, use_std)
    step = gigpo_step_advantages(returns, states, eps, use_std)
    return [episode[i] + omega * step[i] for i in range(len(step_rewards))]


# The oracle: the env's progress (distance to a win: the household's expert, ALFWorld's shortest
# plan) as step credit, the ceiling of step credit (docs/learning.md); the placebo shuffles it.
ORACLES = ("oracle", "oracle-step", "placebo")


def oracle_step_advantages(progress: list[Tensor], eps: float = 1e-6) -> list[Tensor]:
    """progress[i] (T_i,) of every trajectory of a batch -> (T_i,) per trajectory: the progress
    z-scored over all the batch's steps (group_zscore: population std; all equal -> zeros). A
    step's progress: +1 (or more) for a step closer to a win, 0 for a detour, < 0 for a step to
    undo; centred, a step without progress costs while the batch's mean progress is above 0."""
    flat = torch.cat([p.to(torch.float64) for p in progress])
    return list(torch.split(group_zscore(flat, eps), [len(p) for p in progress]))


def placebo_step_advantages(progress: list[Tensor], permutation: Tensor,
                            eps: float = 1e-6) -> list[Tensor]:
    """progress[i] (T_i,) of every trajectory of a batch, permutation (M,) of the M = sum T_i
    flattened steps -> (T_i,) per trajectory: oracle_step_advantages' values, step k getting the
    value of step permutation[k] (trajectory-major order)."""
    flat = torch.cat(oracle_step_advantages(progress, eps))
    return list(torch.split(flat[permutation], [len(p) for p in progress]))


def summarize(traj: dict) -> dict:
    """What advantages and logs read of a trajectory, cheap to gather: "group" (its task's index in
    the batch), "won", "rewards", "task_type", per step "state" (the raw observation acted on,
    s_t: not the prompt), "valid" (admissible) and "well_formed"; and "progress", the oracles'
    labels (T_i ints), where the rollout's games made them (rollout's `progress`)."""
    steps = [{k: s[k] for k in ("state", "valid", "well_formed")} for s in traj["steps"]]
    summary = {k: traj[k] for k in ("task_type", "group", "won", "rewards")}
    progress = [s.get("progress") for s in traj["steps"]]
    if None not in progress:
        summary["progress"] = progress
    return {**summary, "steps": steps}


def compute_advantages(args: Args, summaries: list[dict],
                       generator: torch.Generator | None = None) -> list[Tensor]:
    """Per-step advantages (T_i,) of every trajectory of a batch with the chosen estimator; then
    every estimator's one penalty rule: --invalid-action-penalty comes off the advantage of each
    malformed reply (not well_formed: no <action> tag, say), not of an inadmissible action.

    proxmo: section 1 (TF-IDF on the whole batch; similarities and baselines within each task
    group). grpo, gigpo: per task group (section 2). oracle, placebo: GRPO's episode term + omega
    * the oracle's step values (the env's progress, z-scored over the batch; the placebo shuffles
    them with `generator`, alike on every process); oracle-step: the step values alone."""
    outcomes = [float(t["won"]) for t in summaries]
    rewards = [torch.tensor(t["rewards"], dtype=torch.float64) for t in summaries]
    states = [[s["state"] for s in t["steps"]] for t in summaries]
    groups = [t["group"] for t in summaries]
    if args.advantage in ORACLES:
        labels = [torch.tensor(t["progress"], dtype=torch.float64) for t in summaries]
        if args.advantage == "placebo":
            permutation = torch.randperm(sum(len(p) for p in labels), generator=generator)
            oracle_values = placebo_step_advantages(labels, permutation)
        else:
            oracle_values = oracle_step_advantages(labels)
    if args.advantage == "proxmo":
        advantages = proxmo_batch_advantages(
            outcomes, rewards, states, groups, max_features=args.tfidf_max_features,
            alpha=args.psc_alpha, beta=args.psc_beta, temperature=args.proximity_temperature,
            gamma=args.gamma, omega=args.step_weight, use_std=args.use_std)
    elif args.advantage == "oracle-step":
        advantages = oracle_values
    else:  # grpo, gigpo and the oracle's episode term: one task group at a time
        advantages = [torch.empty(0)] * len(summaries)
        for group in dict.fromkeys(groups):  # each task group, in order of first appearance
            idx = [i for i, g in enumerate(groups) if g == group]  # its trajectories
            group_outcomes = torch.tensor([outcomes[i] for i in idx], dtype=torch.float64)
            if args.advantage == "gigpo":
                advs = gigpo_group_advantages(group_outcomes, [rewards[i] for i in idx],
                                              [states[i] for i in idx], gamma=args.gamma,
                                              omega=args.step_weight, use_std=args.use_std)
            else:  # grpo, and the oracle's episode term
                episode = grpo_advantages(group_outcomes, use_std=args.use_std)
                advs = [episode[k].expand(len(rewards[i])) for k, i in enumerate(idx)]
            for i, a in zip(idx, advs):
                advantages[i] = a
        if args.advantage in ("oracle", "placebo"):
            advantages = [a + args.step_weight * v for a, v in zip(advantages, oracle_values)]
    malformed = [torch.tensor([not s["well_formed"] for s in t["steps"]], dtype=torch.float64)
                 for t in summaries]
    return [a - args.invalid_action_penalty * m for a, m in zip(advantages, malformed)]


# ---- 3. Policy loss (Eq. 13) --------------------------------------------------------------------
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
                  mask: Tensor, clip_eps: float = 0.2, kl_coef: float = 0.01,
                  entropy: Tensor | None = None, entropy_coef: float = 0.0,
                  clip_ratio_c: float | None = None) -> Tensor:
    """Token-level clipped surrogate (Eq. 13) + k3 KL to the reference - entropy bonus, token-mean.

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
    """ProxMO (and the GRPO / GiGPO baselines) for multi-turn LLM agents."""

    exp_name: str = "proxmo"  # runs/<exp-name>__<env>__<advantage>__<seed>__<time>
    seed: int = 1  # seeds python, numpy, torch and the evaluations' own generator
    # household (built in) or alfworld (needs $ALFWORLD_DATA; docs/environments.md)
    env: Literal["household", "alfworld"] = "household"
    # local dir, hub id or Qwen name; tiny, tiny-weak, tiny-alfworld (ALFWorld), tiny-scratch (BC)
    model: str = "tiny"
    # rollout generation: transformers generate, its continuous batching, or vLLM (GPU)
    backend: Literal["hf", "hf-cb", "vllm"] = "hf"

    # Advantage estimator: proxmo (Eqs. 5-12), the baselines grpo and gigpo, or the oracle
    # (section 2): GRPO + omega * the env's progress per step; oracle-step: progress only;
    # placebo: the oracle's values shuffled across the batch's steps
    advantage: Literal["proxmo", "grpo", "gigpo", "oracle", "oracle-step", "placebo"] = "proxmo"
    psc_alpha: float = 4.0  # alpha, steepness of the success-rate modulation (Eq. 6)
    psc_beta: float = 0.1  # beta, strength of that modulation (Eq. 6); 0: GRPO's episode term
    proximity_temperature: float = 0.1  # tau of the softmax over TF-IDF similarities (Eq. 10)
    gamma: float = 0.95  # discount of step returns (Eq. 8)
    step_weight: float = 1.0  # omega, weight of the step term (Eq. 12); 0 and --psc-beta 0: GRPO
    use_std: bool = True  # divide episode (and GiGPO anchor) advantages by the std; off: mean only
    tfidf_max_features: int = 1024  # vocabulary size of the TF-IDF over observations (Eq. 9)
    invalid_action_penalty: float = 0.01  # off a malformed reply's advantage (e.g. no <action>)

    # RL
    iterations: int = 8  # training iterations; 0 = behavior cloning and the start evaluation
    tasks_per_iteration: int = 4  # training tasks per iteration, each played --group-size times
    group_size: int = 8  # N trajectories per task (a group); 1 makes every episode advantage 0
    max_episode_steps: int = 30  # step limit of a game
    learning_rate: float = 5e-4  # AdamW learning rate of the LoRA weights
    weight_decay: float = 0.0  # AdamW weight decay of the RL update
    clip_eps: float = 0.2  # PPO clip range epsilon of the ratio (Eq. 13)
    clip_ratio_c: float | None = None  # dual clip c > 1: for A < 0 the loss is at most -c * A
    kl_coef: float = 0.01  # k3 KL penalty to the reference (the start: adapter off); 0: none
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
    "real": dict(iterations=150, tasks_per_iteration=16, max_episode_steps=50, learning_rate=1e-5,
                 micro_batch_size=8, gradient_checkpointing=True, max_new_tokens=512,
                 history_length=2, reasoning=True, bc_epochs=0, bc_full_params=False,
                 bc_prompt_loss_weight=0.0, bc_learning_rate=1e-4, bc_batch_size=16, eval_every=5,
                 eval_num_tasks=0),
}
RANGES = {  # the method's flags; common/config.py's RANGES: the harness's
    "psc_alpha": ">= 0", "psc_beta": ">= 0", "proximity_temperature": "> 0", "gamma": "in (0, 1]",
    "step_weight": ">= 0", "tfidf_max_features": ">= 1", "invalid_action_penalty": ">= 0",
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
    old_logprobs: list[float]  # of the response tokens, recorded when they were sampled


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


# The command line (common/config.py): value checks, --model/--env/--advantage presets, parsing.
def validate_args(args: Args) -> list[str]:
    return config.errors(args, RANGES)


def preset_args(model: str = "tiny", env: str = "household", advantage: str | None = None) -> Args:
    return config.preset_args(Args, PRESETS, model, env, advantage)


def parse_args(argv: list[str]) -> Args:
    return config.parse_args(Args, PRESETS, argv)


def main(args: Args) -> dict:
    run, train_tasks, eval_tasks = start_run(args, __file__, validate_args(args))
    if args.group_size == 1:
        print("warning: --group-size 1: every episode advantage is 0 (a group of one has no "
              "baseline); only a step term (proxmo, gigpo, the oracles) remains", file=sys.stderr)

    # Model: the start (--model, or cloned from the expert first), then RL's LoRA adapter.
    model, tokenizer = run.load_model()
    run.open()  # only now: a run stopped by bad flags or missing data leaves nothing

    if args.bc_epochs > 0 and not args.resume:
        model = clone_start(args, run, model, tokenizer, train_tasks)
    start_path = run.keep_base(model, tokenizer)  # the start's directory or hub id
    if args.resume:
        model = load_lora(model, run.checkpoint)
    else:
        model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout,
                         args.lora_target_modules)
    model.print_trainable_parameters()
    same_start(list(model.parameters()), args.seed)  # process 0's weights; one process: nothing

    engine = make_vllm_engine(start_path, args) if args.backend == "vllm" else None
    policy = Policy(args, model, tokenizer, engine)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.learning_rate, weight_decay=args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    task_rng = random.Random(args.seed)
    start_iteration = run.restore(optimizer=optimizer, generator=generator, task_rng=task_rng)

    progress = Progress(args.iterations, "rl", initial=start_iteration, interval=0)
    evaluate_splits = partial(evaluate, args, policy)  # (split, tasks) -> its stats

    if start_iteration == 0:
        policy.sync(run.path)  # vLLM reads the adapter from disk; hf: nothing to do
        run.evaluate(0, eval_tasks, evaluate_splits)
    for iteration in range(start_iteration + 1, args.iterations + 1):
        t0 = time.time()
        timings()  # the clocks restart: evaluations and set-up are not the iteration's
        policy.sync(run.path)  # vLLM reads the adapter from disk; hf: nothing to do
        # (1) each task N times, a group (id: its index in the batch); this process's groups only;
        # (2) lock-step rollouts; (3) 0/1 outcomes: "won", and r_t = 1 on the winning step.
        batch_tasks = task_rng.sample(train_tasks, args.tasks_per_iteration)
        tasks, groups = my_share(batch_tasks, args.group_size)
        # The oracles' games label every step as it is played (envs.ProgressGame).
        trajs = rollout(args, tokenizer, policy, tasks, groups, args.rollout_temperature,
                        keys=episode_keys((args.seed, "train", iteration), groups),
                        progress=args.advantage in ORACLES)
        rollout_seconds = time.time() - t0
        # (4) one advantage per step, over the whole batch (TF-IDF too); each process keeps its own
        with timer("advantages"):
            # summaries: every process's (one process: trajs'); mine: where trajs' lie among them
            summaries, mine = whole_batch([summarize(t) for t in trajs])
            batch_advantages = compute_advantages(args, summaries, generator)
            advantages = batch_advantages[mine]
        samples = [StepSample(s["prompt"], s["response_ids"], float(a), s["logprobs"])
                   for tr, adv in zip(trajs, advantages) for s, a in zip(tr["steps"], adv)]
        # (5, 6) reference log-probs and the clipped policy-gradient update.
        policy.sleep()  # --vllm-sleep: the engine's memory to the update
        with timer("update"):  # less the reference pass, timed as ref_logprobs
            stats = policy_update(args, model, tokenizer, optimizer, samples, generator, iteration)
        batch_tokens, _ = whole_batch([len(s.response) for s in samples])  # every process's
        stats.update(rollout_stats(summaries, batch_advantages))  # rollout/success, ...
        stats.update({"rollout/tokens_per_second": sum(batch_tokens) / max(rollout_seconds, 1e-9),
                      "time/rollout_seconds": rollout_seconds,
                      "time/iteration_seconds": time.time() - t0})
        stats.update(timings())  # the main process's timer("x") blocks as time/x_seconds
        stats.update(policy.stats())  # vLLM: its log-probs' gap to the trainer's
        run.log(stats, iteration)
        progress.update(1, success=stats["rollout/success"], grounding=stats["rollout/grounding"],
                        kl=stats.get("train/kl_ref", float("nan")),
                        rollout_s=round(rollout_seconds),
                        update_s=round(stats["time/update_seconds"]),
                        iter_s=round(stats["time/iteration_seconds"]))
        if iteration % args.eval_every == 0 or iteration == args.iterations:
            policy.sync(run.path)
            run.evaluate(iteration, eval_tasks, evaluate_splits)
        if iteration % args.save_every == 0 or iteration == args.iterations:
            run.save(model, start_path, iteration, optimizer=optimizer,
                     generator=generator, task_rng=task_rng)
    progress.close()
    summary = run.finish()  # summary.json first: closing a backend cannot cost it
    policy.close()
    return summary


if __name__ == "__main__":
    config.run_command_line(main, parse_args)  # a bad flag: exit status 2; a NaN loss: 1
