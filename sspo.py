"""3SPO: State-Score-Supervised Policy Optimization (Han et al., 2026), single-file reference.

3SPO updates the policy after every step instead of after whole episodes. A global table counts,
for every state (the exact observation text, shared between tasks), the finished paths through it
and how many of them won. From these counts:
  * a state score S(s) in [0, 1] (Eq. 1): 1 for a state never seen to win, exp(-lambda_t p) for
    success rate p with lambda_t = alpha ln t growing with the number t of finished paths, and 0
    for a state that looks hopeless (xi failures or more and p <= zeta);
  * a step reward (Eq. 2) w novelty + (0.5 - w) (S(s_t) - S(s_t+1)) + 0.5 success, whose weight w
    moves from novelty to score drop as the state is visited more;
  * a number of actions to sample at a state, n = ceil(K_max S) (Eq. 3): 0 cuts the branch, 1 steps
    on without training, 2 or more form a group whose GRPO advantages train the policy at once
    (Eq. 4, PPO-clip with a KL to the start).
  Each task is explored by a ranked depth-first search (Algorithm 1): the sampled transitions are
  ranked by reward, the best is expanded next, the others wait on a frontier stack, and a branch
  that ends (won, lost, cut or at the step limit) backtracks to the newest waiting one. No critic,
  no reward model. --advantage grpo is the GRPO baseline on whole episodes: proxmo.py's, at its
  learning rate (PRESETS' "baseline" rows), the same run to the bit.

The paper's text lost its equations: Eqs. 1-3 follow the authors' code, Eq. 4 their launch scripts
(the specification the script was written from marks each); [reconstructed] marks ours.
Departures from the paper, or choices where it is silent (in full: docs/sspo.md, "Departures
from the paper, in full"):
  * Synchronous rounds over --tasks-per-iteration tasks (the GUI code): one policy update per
    round, every score read from the table as the round began.
  * A task stops at an empty frontier (the paper's only end), --max-paths (8) or
    --generations-per-task (8 x the step limit): GRPO's cost; one expansion may overshoot.
  * States keyed by the observation, shared across tasks (the code's; per-task keys:
    --no-share-states-across-tasks); a group is one expansion's; "Nothing happens." keeps the key.
  * lambda_t = alpha ln t with alpha 0.25 [reconstructed], not the paper's 50 (no groups at 50);
    --lambda-schedule gui: the GUI loop's schedule [reconstructed].
  * Counters change when a path finishes: +1 visit (+1 success) per distinct state; t = 1 + paths.
  * A win's next state scores 1 (spec §9.4); a step-limit state scores from the table; a gated
    child scores high and is cut at the next pop.
  * R_succ 10 (--success-reward 1: a 0/1 indicator); --step-invalid-penalty 0.1 in the reward;
    the GRPO baseline keeps proxmo.py's --invalid-action-penalty 0.01.
  * A child repeating its parent's or a sibling's state is trained on, not pushed.
  * Group advantages divide by the Bessel std (--no-use-std: centred only); no group of one.
  * --no-backtracking restarts from the task's first state when the branch ends [reconstructed].
  * --fixed-novelty-weight (w/o adaptive w; 0.25 a guess), --no-novelty-reward,
    --no-score-difference-reward, --uniform-rollouts (the gate still cuts): ablations.
  * LoRA, a larger learning rate, no entropy bonus; ppo_clip_loss keeps the harness's arg names.
  * The household snapshots each branch; ALFWorld replays a branch from a reset (slow).
  * Evaluation plays plain one-sample episodes (no table, no search), as the paper's.

Run:
    python sspo.py                          # tiny model, built-in household, CPU, minutes
    python sspo.py --advantage grpo         # the GRPO baseline on the same harness
    python sspo.py --env alfworld --model Qwen2.5-1.5B-Instruct --backend vllm   # the paper's
    accelerate launch --multi_gpu --num_processes 8 sspo.py --env alfworld ...    # data parallel

Sections: 1 state scores and step rewards, 2 the ranked backtracking search, 3 policy loss, 4
arguments, 5 rollouts, 6 behavior cloning, 7 evaluation, 8 training loop.
To read: sections 1-3 tell the method, 8 the loop (`main`: rollout -> reward -> advantage ->
update, then `policy_update`); 4 (the flags) and 5-7 (the harness, alike in every script) can wait.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, NamedTuple

import numpy as np

# Before torch loads OpenMP: waiting threads sleep, not spin (docs/performance.md), unless set.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from accelerate.utils import gather_object
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


# ---- 1. State scores and step rewards (pure functions) ------------------------------------------
@dataclass
class Counts:
    """A state's statistics: finished paths that went through it, and how many of them won."""
    n_total: int = 0
    n_success: int = 0

    @property
    def n_fail(self) -> int:
        return self.n_total - self.n_success


def annealing_lambda(t: int, alpha: float = 50.0, schedule: str = "log",
                     horizon: float = 10_000.0, base: float = 1.0) -> float:
    """lambda_t of Eq. 1, t = 1 + the finished paths so far (t >= 1). "log": alpha ln t, the
    authors' ALFWorld code (lambda_1 = 0). "gui": base (1 - exp(-t / horizon)), their GUI loop's,
    with t in finished paths, not search rounds [reconstructed: docs/sspo.md]; alpha is unused."""
    if t < 1:
        raise ValueError(f"t counts 1 + the finished paths and must be >= 1, got {t}")
    if schedule == "gui":
        return base * (1.0 - math.exp(-t / horizon))
    if schedule != "log":
        raise ValueError(f"schedule must be 'log' or 'gui', not {schedule!r}")
    return alpha * math.log(t)


def state_score(c: Counts, t: int, alpha: float = 50.0, xi: int = 10, zeta: float = 0.1,
                eps: float = 1e-6, *, schedule: str = "log", horizon: float = 10_000.0,
                lambda_base: float = 1.0) -> float:
    """Eq. 1: S = gate * exp(-lambda_t p), p = N_suc / (N_tot + eps), gate open when
    N_fail < xi or p > zeta (strict, on the eps-smoothed p: 2 wins in 20 closes it). An unvisited
    state scores 1.0, a closed gate exactly 0.0. lambda_t: annealing_lambda(t, alpha, schedule,
    horizon, lambda_base)."""
    if c.n_total == 0:
        return 1.0
    p = c.n_success / (c.n_total + eps)
    if not (c.n_fail < xi or p > zeta):
        return 0.0
    return math.exp(-annealing_lambda(t, alpha, schedule, horizon, lambda_base) * p)


def rollout_count(score: float, k_max: int = 8) -> int:
    """Eq. 3: n = ceil(K_max S); 0 cuts the branch, 1 steps on untrained, >= 2 trains a group."""
    return int(math.ceil(k_max * score))


def novelty_weight(n_total: int, k: float = 0.1) -> float:
    """w(N) = 0.5 exp(-k N) (Eq. 2), N = finished paths through the source state."""
    return 0.5 * math.exp(-k * n_total)


def step_reward(score_t: float, score_next: float, n_total_t: int, changed: bool, success: bool,
                valid: bool = True, k: float = 0.1, invalid_penalty: float = 0.1, *,
                novelty: bool = True, score_difference: bool = True,
                fixed_weight: float | None = None, success_reward: float = 1.0) -> float:
    """Eq. 2: w R_novel + (0.5 - w)(S(s_t) - S(s_t+1)) + 0.5 R_succ, minus invalid_penalty for a
    malformed reply. R_succ = success_reward on a won step, else 0. w = novelty_weight(n_total_t,
    k), or fixed_weight. novelty=False and score_difference=False drop their terms (the paper's
    ablations; their weights stay)."""
    w = novelty_weight(n_total_t, k) if fixed_weight is None else fixed_weight
    reward = 0.5 * success_reward * float(success)
    if novelty:
        reward += w * float(changed)
    if score_difference:
        reward += (0.5 - w) * (score_t - score_next)
    if not valid:
        reward -= invalid_penalty
    return reward


def next_state_scores(stats: dict[str, Counts], next_keys: list[str], t: int,
                      alpha: float = 50.0, xi: int = 10, zeta: float = 0.1, eps: float = 1e-6,
                      terminals: list[bool] | None = None, **schedule) -> list[float]:
    """S(s_t+1) of each transition (Eq. 2): 1.0 for a terminal one (None: none is), else
    state_score of its key's counts (a missing key is unvisited; `stats` is only read).
    schedule: schedule, horizon, lambda_base of state_score."""
    terminals = terminals or [False] * len(next_keys)
    return [1.0 if terminal else state_score(stats.get(key, Counts()), t, alpha, xi, zeta, eps,
                                             **schedule)
            for key, terminal in zip(next_keys, terminals, strict=True)]


def transition_rewards(stats: dict[str, Counts], key_t: str, next_keys: list[str],
                       successes: list[bool], valids: list[bool], t: int, alpha: float = 50.0,
                       xi: int = 10, zeta: float = 0.1, eps: float = 1e-6, k: float = 0.1,
                       invalid_penalty: float = 0.1, terminals: list[bool] | None = None, *,
                       schedule: str = "log", horizon: float = 10_000.0,
                       lambda_base: float = 1.0, **terms) -> list[float]:
    """The step rewards of the n transitions sampled at state key_t, every score read from
    `stats` (only read: a missing key is an unvisited state). Child i: step_reward(S(key_t),
    S_next_i, N_tot(key_t), next_keys[i] != key_t, successes[i], valids[i]), S_next_i from
    next_state_scores. schedule, horizon, lambda_base: Eq. 1's lambda_t (annealing_lambda).
    terms: novelty, score_difference, fixed_weight, success_reward of step_reward."""
    lam = {"schedule": schedule, "horizon": horizon, "lambda_base": lambda_base}
    source = stats.get(key_t, Counts())
    score_t = state_score(source, t, alpha, xi, zeta, eps, **lam)
    scores_next = next_state_scores(stats, next_keys, t, alpha, xi, zeta, eps, terminals, **lam)
    return [step_reward(score_t, score_next, source.n_total, key != key_t, success, valid, k,
                        invalid_penalty, **terms)
            for key, success, valid, score_next in zip(next_keys, successes, valids, scores_next,
                                                       strict=True)]


def group_advantages(rewards: list[float] | Tensor, eps: float = 1e-6,
                     use_std: bool = True) -> Tensor:
    """(n,) step rewards of one state's group -> (n,) float64 advantages (Eq. 4):
    (r - mean) / (std + eps) with the Bessel std, or r - mean without use_std. Empty in, empty
    out; one reward, or all equal, gives exact zeros."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.numel() == 0 or r.max() == r.min():
        return torch.zeros_like(r)
    centred = r - r.mean()
    return centred / (r.std() + eps) if use_std else centred


def rank_children(rewards: list[float]) -> list[int]:
    """Indices of the transitions, best reward first; ties keep the lower index first."""
    return sorted(range(len(rewards)), key=lambda i: -rewards[i])


def update_counters(stats: dict[str, Counts], path_keys: list[str], success: bool) -> None:
    """A finished path: each distinct key on it gets one more visit, and one more success if it
    won (missing entries are created)."""
    for key in dict.fromkeys(path_keys):
        counts = stats.setdefault(key, Counts())
        counts.n_total += 1
        counts.n_success += int(success)


def state_key(task_id: str, obs_text: str, share_across_tasks: bool = False) -> str:
    """sha1 of task_id + newline + observation (or of the observation alone)."""
    text = obs_text if share_across_tasks else f"{task_id}\n{obs_text}"
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def grpo_advantages(outcomes: Tensor, eps: float = 1e-6, use_std: bool = True) -> Tensor:
    """(N,) -> (N,) the GRPO baseline's episode advantage, proxmo.py's group_zscore: all equal
    (N == 1 included) gives exact zeros, else (R - mean) / (population std + eps), or R - mean
    without use_std. The same value is used for every step of an episode."""
    outcomes = outcomes.to(torch.float64)
    if outcomes.numel() == 0 or outcomes.max() == outcomes.min():
        return torch.zeros_like(outcomes)
    centred = outcomes - outcomes.mean()
    return centred / (outcomes.std(unbiased=False) + eps) if use_std else centred


def summarize(traj: dict) -> dict:
    """What advantages and logged stats read of a trajectory: no token ids, cheap to gather."""
    steps = [{k: s[k] for k in ("state", "valid", "well_formed")} for s in traj["steps"]]
    return {**{k: traj[k] for k in ("task_type", "group", "won", "rewards")}, "steps": steps}


def compute_advantages(args: Args, summaries: list[dict]) -> list[Tensor]:
    """The GRPO baseline's per-step advantages (T_i,) of every trajectory of a batch, then
    --invalid-action-penalty subtracted from each malformed reply's (proxmo.py's rule)."""
    outcomes = [float(t["won"]) for t in summaries]
    members: dict = defaultdict(list)
    for i, t in enumerate(summaries):
        members[t["group"]].append(i)
    advantages = [torch.empty(0)] * len(summaries)
    for idx in members.values():
        group_outcomes = torch.tensor([outcomes[i] for i in idx], dtype=torch.float64)
        episode = grpo_advantages(group_outcomes, use_std=args.use_std)
        for k, i in enumerate(idx):
            advantages[i] = episode[k].expand(len(summaries[i]["steps"]))
    malformed = [torch.tensor([not s["well_formed"] for s in t["steps"]], dtype=torch.float64)
                 for t in summaries]
    return [a - args.invalid_action_penalty * m for a, m in zip(advantages, malformed)]


# ---- 2. The ranked backtracking search (Algorithm 1) --------------------------------------------
NOTHING_HAPPENS = "Nothing happens."  # both environments' answer to a command that changed nothing


@dataclass
class StateTable:
    """Algorithm 1's global statistics, kept across tasks, iterations and checkpoints."""
    counts: dict[str, Counts] = field(default_factory=dict)  # state key -> Counts
    t: int = 1  # 1 + the finished paths so far (Eq. 1's t)


def score_schedule(args: Args) -> dict:
    """Eq. 1's lambda_t settings, as state_score and transition_rewards take them."""
    return {"schedule": args.lambda_schedule, "horizon": args.lambda_horizon,
            "lambda_base": args.lambda_base}


def score_of(args: Args, table: StateTable, key: str) -> float:
    return state_score(table.counts.get(key, Counts()), table.t, args.score_alpha,
                       args.fail_threshold, args.success_threshold, **score_schedule(args))


def new_search(args: Args, task) -> dict:
    """A task's search: its game, the frontier stack holding the first state, and the budgets
    used. A node is a state to expand: the game's snapshot there, its observation and admissible
    actions, the (obs, action) history that led to it, and the keys of the states on its path."""
    game = envs.make_game(args.env, task, args.max_episode_steps)
    obs = game.reset()
    root = {"snapshot": game.snapshot(), "obs": obs, "admissible": game.admissible_actions(),
            "history": [], "keys": [state_key(str(task), obs, args.share_states_across_tasks)]}
    return {"task": task, "game": game, "root": root, "frontier": [root], "paths": 0,
            "generations": 0}


def search_active(args: Args, search: dict) -> bool:
    """Budget left and a state to expand (without backtracking, the first state again)."""
    budget = args.generations_per_task or 8 * args.max_episode_steps
    within = search["paths"] < args.max_paths and search["generations"] < budget
    return within and (bool(search["frontier"]) or not args.backtracking)


def search_round(args: Args, tokenizer, policy: Policy, searches: list[dict],
                 table: StateTable) -> tuple[list[tuple], list[tuple], list[dict]]:
    """One synchronous round of Algorithm 1 over the active searches. Each pops its newest node
    and gets n = ceil(K_max S) actions (Eq. 3), sampled for all searches in one call. Each action
    is played from a restored copy of the node's state and rewarded from the table as it is
    (Eq. 2). The children are ranked; terminal ones finish paths. The others are pushed, worst
    first, so the best is expanded next; a state already pushed by this node, or the node's own,
    is not pushed twice.

    Returns (samples, finished, records): a StepSample for each action of every group of n >= 2
    (Eq. 4's advantages); finished paths (search index, path keys, won, steps played, or None for
    a path the search cut) in order, for update_counters after the round; one record per popped
    node, for the log. The table is only read."""
    finished, records, expansions = [], [], []
    with timer("prompts"):  # choosing the nodes and their prompts
        for index, search in enumerate(searches):
            if not search_active(args, search):
                continue
            if not search["frontier"]:  # --no-backtracking: a new path from the first state
                search["frontier"].append(search["root"])
            node = search["frontier"].pop()
            score = score_of(args, table, node["keys"][-1])
            n = rollout_count(score, args.max_rollouts)  # Eq. 3
            if args.uniform_rollouts and n > 0:
                n = args.max_rollouts
            visits = table.counts.get(node["keys"][-1], Counts()).n_total
            records.append({"score": score, "rollouts": n, "depth": len(node["history"]),
                            "visited": visits > 0})
            if n == 0:  # the score reached zero: this path ends here, lost, cut (no game end)
                finished.append((index, node["keys"], False, None))
                continue
            prompt = encode_prompt(args, tokenizer, search["game"].task_description,
                                   node["history"], node["obs"], node["admissible"],
                                   len(node["history"]) + 1)
            expansions.append((index, node, n, prompt, records[-1]))
            search["generations"] += n
    if not expansions:
        return [], finished, records
    prompts = [prompt for _, _, n, prompt, _ in expansions for _ in range(n)]
    with timer("generation"):
        responses, logprobs = policy.generate(prompts, args.rollout_temperature)
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    samples, first = [], 0
    for index, node, n, prompt, record in expansions:
        search, rows = searches[index], range(first, first + n)
        first += n
        key, game = node["keys"][-1], search["game"]
        children = []
        with timer("env"):
            for row in rows:
                parsed = parse_action(texts[row])
                # No <action> tag: the env gets the reply's tail, which is never admissible.
                command = parsed if parsed is not None else texts[row][-30:]
                game.restore(node["snapshot"])
                obs, _, done, info = game.step(command)
                child_key = key if obs == NOTHING_HAPPENS else state_key(
                    str(search["task"]), obs, args.share_states_across_tasks)
                children.append({"obs": obs, "command": command, "key": child_key, "done": done,
                                 "won": bool(info["won"]), "valid": bool(info["valid"]),
                                 "well_formed": is_well_formed(texts[row], args.reasoning),
                                 "snapshot": None if done else game.snapshot(),
                                 "admissible": None if done else game.admissible_actions()})
        child_keys, wins = [c["key"] for c in children], [c["won"] for c in children]
        well_formed = [c["well_formed"] for c in children]
        rewards = transition_rewards(  # Eq. 2, every score from the round's table
            table.counts, key, child_keys, wins, well_formed, table.t, args.score_alpha,
            args.fail_threshold, args.success_threshold, k=args.novelty_decay,
            invalid_penalty=args.step_invalid_penalty, terminals=wins, **score_schedule(args),
            novelty=args.novelty_reward, score_difference=args.score_difference_reward,
            fixed_weight=args.fixed_novelty_weight, success_reward=args.success_reward)
        order = rank_children(rewards)
        pushed, seen_keys = [], {key}
        for i in order:
            child = children[i]
            if child["done"]:  # won, or lost at the step limit: a finished path
                finished.append((index, node["keys"], child["won"], len(node["history"]) + 1))
            elif child["key"] not in seen_keys:
                seen_keys.add(child["key"])
                pushed.append(child)
        # A node whose children all end or repeat ends its branch: no finished path, no count.
        if not args.backtracking:  # the best child goes on, if it can; no other ever does
            pushed = pushed[:1] if pushed and pushed[0] is children[order[0]] else []
        for child in reversed(pushed):  # ascending rank: the best ends on top of the stack
            search["frontier"].append({
                "snapshot": child["snapshot"], "obs": child["obs"],
                "admissible": child["admissible"],
                "history": node["history"] + [(node["obs"], child["command"])],
                "keys": node["keys"] + [child["key"]]})
        if n >= 2:  # a group of one proceeds without training
            advantages = group_advantages(rewards, use_std=args.use_std)  # Eq. 4
            samples += [StepSample(prompt, responses[row], float(a), logprobs[row])
                        for row, a in zip(rows, advantages)]
        # For score_difference_stats: Eq. 2's term (0.5 - w)(S(s_t) - S(s_t+1)) of each child.
        scores_next = next_state_scores(table.counts, child_keys, table.t, args.score_alpha,
                                        args.fail_threshold, args.success_threshold,
                                        terminals=wins, **score_schedule(args))
        w = (novelty_weight(table.counts.get(key, Counts()).n_total, args.novelty_decay)
             if args.fixed_novelty_weight is None else args.fixed_novelty_weight)
        terms = ((0.5 - w) * (record["score"] - np.array(scores_next))
                 if args.score_difference_reward else np.zeros(len(children)))
        record.update(rewards=rewards, valid=[c["valid"] for c in children],
                      well_formed=well_formed, w=w, hopeless=[s == 0.0 for s in scores_next],
                      score_difference_varies=bool(terms.max() > terms.min()),
                      score_difference_spread=float(np.abs(terms - terms.mean()).sum()),
                      reward_spread=float(np.abs(np.array(rewards) - np.mean(rewards)).sum()))
    return samples, finished, records


# ---- 3. Policy loss (Eq. 4) ---------------------------------------------------------------------
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
    """Token-level clipped surrogate (Eq. 4) + k3 KL to the reference - entropy bonus, token-mean.

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
    """3SPO (and the GRPO baseline) for multi-turn LLM agents."""

    exp_name: str = "sspo"  # runs/<exp-name>__<env>__<advantage>__<seed>__<time>
    seed: int = 1  # seeds python, numpy, torch and the evaluations' own generator
    # household (built in) or alfworld (needs $ALFWORLD_DATA; docs/environments.md)
    env: Literal["household", "alfworld"] = "household"
    # local dir, hub id or Qwen name; tiny, tiny-weak, tiny-alfworld (ALFWorld), tiny-scratch (BC)
    model: str = "tiny"
    # rollout generation: transformers generate, its continuous batching, or vLLM (GPU)
    backend: Literal["hf", "hf-cb", "vllm"] = "hf"

    # Estimator: sspo, 3SPO's ranked DFS with an update after every round (Eqs. 1-4), or the
    # GRPO baseline on whole episodes (proxmo.py's)
    advantage: Literal["sspo", "grpo"] = "sspo"
    # Eq. 1's lambda_t: log, alpha ln t (ALFWorld code), or gui (GUI loop) [reconstructed]
    lambda_schedule: Literal["log", "gui"] = "log"
    score_alpha: float = 0.25  # lambda_t = alpha ln t (Eq. 1; alpha chosen on valid, docs/sspo.md)
    lambda_horizon: float = 10_000.0  # gui: horizon in finished paths (the GUI loop's T / alpha)
    lambda_base: float = 1.0  # gui: lambda_t's limit (the GUI loop's)
    success_reward: float = 10.0  # R_succ of a won step (Eq. 2; the authors' code pays 10)
    fail_threshold: int = 10  # xi: a state failed on >= xi paths at success rate <= zeta scores 0
    success_threshold: float = 0.1  # zeta: a success rate above it keeps the gate open (Eq. 1)
    novelty_decay: float = 0.1  # k of the novelty weight w = 0.5 exp(-k N) (Eq. 2)
    max_rollouts: int = 8  # K_max: actions sampled at a state of score 1 (Eq. 3)
    # sspo: subtracted from a malformed reply's step reward before normalising
    step_invalid_penalty: float = 0.1
    max_paths: int = 8  # sspo: a task's search stops after this many finished paths
    generations_per_task: int | None = None  # sspo: a search's action budget (None: 8 x max steps)
    share_states_across_tasks: bool = True  # states keyed by observation, not per task (the code)
    use_std: bool = True  # divide group advantages by the group std (Bessel); off: the mean only
    invalid_action_penalty: float = 0.01  # grpo: subtracted from a malformed reply's advantage
    # The paper's ablations (Table 2).
    novelty_reward: bool = True  # the novelty term of Eq. 2 (off: the w/o R_novel ablation)
    score_difference_reward: bool = True  # the score-difference term of Eq. 2 (off: w/o R_score)
    fixed_novelty_weight: float | None = None  # a fixed w in [0, 0.5], not w(N) (w/o adaptive w)
    uniform_rollouts: bool = False  # K_max actions at open states, not Eq. 3's n (w/o adaptive n)
    backtracking: bool = True  # off: keep only the best child; dead ends restart (w/o backtrack)

    # RL
    iterations: int = 8  # training iterations; 0 = behavior cloning and the start evaluation
    tasks_per_iteration: int = 4  # training tasks per iteration, searched (sspo) or played N times
    group_size: int = 8  # grpo: N trajectories per task (a group); 1 makes every advantage 0
    max_episode_steps: int = 30  # step limit of a game
    learning_rate: float = 5e-6  # AdamW learning rate of the LoRA weights
    weight_decay: float = 0.0  # AdamW weight decay of the RL update
    clip_eps: float = 0.2  # PPO clip range epsilon of the ratio (Eq. 4)
    clip_ratio_c: float | None = None  # dual clip c > 1: for A < 0 the loss is at most -c * A
    kl_coef: float = 0.01  # k3 KL penalty to the reference (the start: adapter off); 0: none
    entropy_coef: float = 0.0  # weight of the entropy bonus
    ppo_epochs: int = 1  # passes over an iteration's step samples
    minibatch_size: int = 256  # step samples per optimizer step (sspo: a round's groups)
    micro_batch_size: int = 16  # step samples per forward pass
    max_grad_norm: float = 1.0  # gradient-norm clip of every optimizer step
    rollout_temperature: float = 1.0  # sampling temperature of rollouts and the search, and of PPO
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
    # --advantage grpo, by --model (tiny and tiny-scratch: "tiny"): proxmo.py's learning rates
    "tiny baseline": dict(learning_rate=5e-4),
    "real baseline": dict(learning_rate=1e-5),
}
RANGES = {  # the method's flags; common/config.py's RANGES: the harness's
    "score_alpha": ">= 0", "lambda_horizon": "> 0", "lambda_base": ">= 0",
    "success_reward": ">= 0", "fail_threshold": ">= 0", "success_threshold": "in [0, 1]",
    "novelty_decay": ">= 0", "max_rollouts": ">= 1", "step_invalid_penalty": ">= 0",
    "max_paths": ">= 1", "generations_per_task": ">= 1", "fixed_novelty_weight": "in [0, 0.5]",
    "invalid_action_penalty": ">= 0",
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


def grpo_iteration(args: Args, tokenizer, policy: Policy, model, optimizer, batch_tasks: list,
                   iteration: int, generator: torch.Generator) -> dict:
    """One iteration of the GRPO baseline on the batch's tasks: (1) each task x N, (2) lock-step
    rollouts, (3) 0/1 outcomes, (4) GRPO advantages over the whole batch (each process keeps its
    trajectories'), (5, 6) reference log-probs and the clipped policy-gradient update. Returns
    the iteration's logged stats."""
    t0 = time.time()
    # Each task N times, a group (id: its index in the batch); this process's groups only.
    tasks, groups = my_share(batch_tasks, args.group_size)
    trajs = rollout(args, tokenizer, policy, tasks, groups, args.rollout_temperature,
                    keys=episode_keys((args.seed, "train", iteration), groups))
    rollout_seconds = time.time() - t0
    with timer("advantages"):
        # batch: every process's (one process: trajs'); mine: where trajs' lie among them
        batch, mine = whole_batch([summarize(t) for t in trajs])
        batch_advantages = compute_advantages(args, batch)
        advantages = batch_advantages[mine]
    samples = [StepSample(s["prompt"], s["response_ids"], float(a), s["logprobs"])
               for tr, adv in zip(trajs, advantages) for s, a in zip(tr["steps"], adv)]
    policy.sleep()  # --vllm-sleep: the engine's memory to the update
    with timer("update"):  # less the reference pass, timed as ref_logprobs
        stats = policy_update(args, model, tokenizer, optimizer, samples, generator, iteration)
    batch_tokens, _ = whole_batch([len(s.response) for s in samples])  # every process's
    stats.update(rollout_stats(batch, batch_advantages))
    stats.update({"rollout/tokens_per_second": sum(batch_tokens) / max(rollout_seconds, 1e-9),
                  "time/rollout_seconds": rollout_seconds})
    return stats


def score_difference_stats(trained: list[dict], hopeless: list[bool]) -> dict:
    """Whether Eq. 2's score difference ranks anything, from search_round's records of the
    trained groups (n >= 2): the share whose score-difference term varies, the term's share of
    the rewards' spread about their group means (sums over all of them), their mean novelty
    weight w; and the share of children sent to a hopeless state (S = 0). A figure without any
    group or child to measure is left out."""
    stats = {}
    if trained:
        stats["sspo/score_difference_varies"] = float(np.mean(
            [r["score_difference_varies"] for r in trained]))
        stats["sspo/trained_w"] = float(np.mean([r["w"] for r in trained]))
        spread = sum(r["reward_spread"] for r in trained)
        if spread > 0:
            stats["sspo/score_difference_share"] = sum(
                r["score_difference_spread"] for r in trained) / spread
    if hopeless:
        stats["sspo/hopeless_children"] = float(np.mean(hopeless))
    return stats


def search_and_learn(args: Args, tokenizer, policy: Policy, model, optimizer, tasks: list,
                     table: StateTable, iteration: int, run_path: str,
                     generator: torch.Generator) -> dict:
    """One 3SPO iteration, returning its logged stats: the searches of this process's tasks, in
    rounds until every search of every process has stopped. After each round: one policy update on
    the round's groups of all processes (Eq. 4, post-step), then the round's finished paths of all
    processes go into the counters in process order, so that every process keeps the same table."""
    began = time.perf_counter()
    searches = [new_search(args, task) for task in tasks]
    tracked_before = len(table.counts)
    records, finished_all, update_stats = [], [], defaultdict(list)
    rounds, update_seconds = 0, 0.0
    while any(gather_object([any(search_active(args, s) for s in searches)])):
        samples, finished, round_records = search_round(args, tokenizer, policy, searches, table)
        rounds += 1
        if sum(gather_object([len(samples)])):
            policy.sleep()  # --vllm-sleep: the engine's memory to the update
            updating = time.perf_counter()
            with timer("update"):  # less the reference pass, timed as ref_logprobs
                stats = policy_update(args, model, tokenizer, optimizer, samples, generator,
                                      iteration)
            update_seconds += time.perf_counter() - updating
            policy.sync(run_path)  # vLLM samples the next round with the updated adapter
            for name, value in stats.items():
                update_stats[name].append(value)
        for index, _, _, _ in finished:
            searches[index]["paths"] += 1
        for _, keys, won, steps in gather_object(finished):  # Eq. 1's counts and t
            update_counters(table.counts, keys, won)
            table.t += 1
            finished_all.append((won, steps))
        records += gather_object(round_records)
    expanded = [r for r in records if r["rollouts"] > 0]
    trained = [r for r in records if r["rollouts"] >= 2]
    children = [c for r in expanded for c in zip(r["rewards"], r["valid"], r["well_formed"])]
    hopeless = [h for r in expanded for h in r["hopeless"]]
    visited = [r["visited"] for r in expanded]  # unvisited: w = 0.5, no score difference (Eq. 2)
    wins = [won for won, _ in finished_all]
    lengths = [steps for _, steps in finished_all if steps is not None]  # the game ended them
    scores = [score_of(args, table, key) for key in table.counts]
    out = {name: float(np.mean(v)) for name, v in update_stats.items()}  # over the updates
    out.update(score_difference_stats(trained, hopeless))
    out.update({
        "rollout/success": float(np.mean(wins)) if wins else 0.0,
        "rollout/episode_length": float(np.mean(lengths)) if lengths else 0.0,
        "rollout/grounding": float(np.mean([c[1] for c in children])) if children else 0.0,
        "rollout/well_formed": float(np.mean([c[2] for c in children])) if children else 0.0,
        "rollout/step_samples": len(children),
        "time/rollout_seconds": time.perf_counter() - began - update_seconds,
        "sspo/rounds": rounds,
        "sspo/updates": len(update_stats.get("train/loss", [])),
        "sspo/paths": len(finished_all),
        "sspo/t": table.t,
        "sspo/states_tracked": len(table.counts),
        "sspo/new_states": len(table.counts) - tracked_before,
        "sspo/mean_score": float(np.mean(scores)) if scores else 1.0,
        "sspo/expanded_score": float(np.mean([r["score"] for r in records])),
        "sspo/rollouts_per_step": float(np.mean([r["rollouts"] for r in records])),
        "sspo/truncated_share": float(np.mean([r["rollouts"] == 0 for r in records])),
        "sspo/untrained_share": float(np.mean([r["rollouts"] == 1 for r in records])),
        "sspo/depth": float(np.mean([r["depth"] for r in records])),
        "sspo/visited_share": float(np.mean(visited)) if visited else 0.0,
        "sspo/reward_mean": float(np.mean([c[0] for c in children])) if children else 0.0})
    return out


# The command line (common/config.py): value checks, --model/--env/--advantage presets, parsing.
def validate_args(args: Args) -> list[str]:
    return config.errors(args, RANGES)


def preset_args(model: str = "tiny", env: str = "household", advantage: str | None = None) -> Args:
    return config.preset_args(Args, PRESETS, model, env, advantage)


def parse_args(argv: list[str]) -> Args:
    # A run from before R_succ 10 paid 1.
    return config.parse_args(Args, PRESETS, argv, old_defaults={"success_reward": 1.0})


def main(args: Args) -> dict:
    run, train_tasks, eval_tasks = start_run(args, __file__, validate_args(args))
    if args.group_size == 1 and args.advantage == "grpo":
        print("warning: --group-size 1: every advantage is 0 (a group of one has no baseline)",
              file=sys.stderr)

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
    table = StateTable()
    start_iteration = run.restore(optimizer=optimizer, generator=generator, task_rng=task_rng)
    if run.state is not None:
        table = StateTable({key: Counts(*c) for key, c in run.state["table"]["counts"].items()},
                           run.state["table"]["t"])

    progress = Progress(args.iterations, "rl", initial=start_iteration, interval=0)
    evaluate_splits = partial(evaluate, args, policy)  # (split, tasks) -> its stats

    if start_iteration == 0:
        policy.sync(run.path)  # vLLM reads the adapter from disk; hf: nothing to do
        run.evaluate(0, eval_tasks, evaluate_splits)
    for iteration in range(start_iteration + 1, args.iterations + 1):
        t0 = time.time()
        timings()  # the clocks restart: evaluations and set-up are not the iteration's
        batch_tasks = task_rng.sample(train_tasks, args.tasks_per_iteration)
        policy.sync(run.path)
        if args.advantage == "sspo":
            # (1) a ranked search over each task, round by round, (2) a policy update after every
            # round (Eq. 4), (3) the round's finished paths into the counters (Eq. 1).
            my_tasks, _ = my_share(batch_tasks)  # data parallel: this process's; one: all
            stats = search_and_learn(args, tokenizer, policy, model, optimizer, my_tasks, table,
                                     iteration, run.path, generator)
        else:  # the GRPO baseline: B tasks x N copies, one update
            stats = grpo_iteration(args, tokenizer, policy, model, optimizer, batch_tasks,
                                   iteration, generator)
        stats["time/iteration_seconds"] = time.time() - t0
        # Where the iteration's time went: prompts, generation, env, advantages, and the policy
        # update's ref_logprobs and update; the main process's times.
        stats.update(timings())  # each timer("x") above as time/x_seconds
        stats.update(policy.stats())  # vLLM: its log-probs' gap to the trainer's
        run.log(stats, iteration)
        progress.update(1, success=stats["rollout/success"], grounding=stats["rollout/grounding"],
                        kl=stats.get("train/kl_ref", float("nan")),
                        rollout_s=round(stats["time/rollout_seconds"]),
                        update_s=round(stats.get("time/update_seconds", 0)),
                        iter_s=round(stats["time/iteration_seconds"]))
        if iteration % args.eval_every == 0 or iteration == args.iterations:
            policy.sync(run.path)
            run.evaluate(iteration, eval_tasks, evaluate_splits)
        if iteration % args.save_every == 0 or iteration == args.iterations:
            counts = {key: (c.n_total, c.n_success) for key, c in table.counts.items()}
            run.save(model, start_path, iteration, optimizer=optimizer,
                     generator=generator, task_rng=task_rng,
                     table={"counts": counts, "t": table.t})
    progress.close()
    summary = run.finish()  # summary.json first: closing a backend cannot cost it
    policy.close()
    return summary


if __name__ == "__main__":
    config.run_command_line(main, parse_args)  # a bad flag: exit status 2; a NaN loss: 1
