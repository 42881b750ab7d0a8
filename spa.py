"""SPA: Stepwise Progress Attribution (Wang et al., 2025), single-file reference.

SPA turns the sparse outcome of an episode into a dense reward per step:
  * a progress estimator (PE), the behavior-cloned model with a LoRA adapter and a scalar head,
    reads a whole trajectory and gives each action a contribution c_t (Eq. 5); it is trained on
    the start policy's own exploration rollouts so that a trajectory's contributions sum to its
    outcome (Eqs. 6-7), then frozen;
  * the step reward is r_t = alpha * c_t + beta * g_t (Eq. 8), g_t = 1 when the action could be
    executed (grounding), and PPO with a critic (a value head on the policy) and GAE optimises
    it (Eqs. 9-10), here over the exploration rollouts themselves, one pass, as the released
    code does. The outcome itself enters the reward only through the c_t.

Departures from the paper and its code (docs/spa.md, "Departures from the paper, in full"):
  * PE: start weights, a fresh LoRA and Linear(H, 1) on the final-norm state (the code: full
    fine-tuning, a head on the logits); --pe-head mlp: the paper's MLP; scores only the replies.
  * PE training: AdamW, constant rate, no decay or warm-up, clip 1.0 (the code: lr 3e-6, warm-up,
    decay 0.01); --pe-heldout tenth held out; rollouts over --pe-max-tokens read up to the limit.
  * RL data: --rl-data explore (default, the code's), one pass over the exploration rollouts;
    --rl-data online: fresh rollouts; --advantage ppo: the same rollouts, the sparse outcome.
  * Grounding as a cost, beta * (g_t - 1): Eq. 8 less a constant per step, explore mode too (Eq. 8
    pays for length); --grounding-form eq8 is Eq. 8 as written.
  * Critic: zero-initialised value head on the policy, LoRA shared, own --value-learning-rate.
  * KL to the reference in the step reward, fixed 0.01 as HISR's (the code adapts --kl-coef 0.3).
  * One advantage per reply, whitened over the batch (population variance; the code: over tokens).
  * g_t = 1 unless no <action> tag or "Nothing happens."; eval also logs the per-trajectory mean.
  * Batch: the harness's, --minibatch-size steps, clip 1.0 (the code: 8 trajectories, one step
    per epoch, no clip); real preset: 50-step limit (the code's ALFWorld: 40).
  * Harness prompts, rollouts, BC (not ReAct); eval at 0.4 (the paper: --eval-temperature 0).
  * --model tiny ships cloned (--bc-epochs 0); real models clone first (--bc-epochs 3, LoRA).
  * Not built: micro-batching or checkpointing in PE training (lower --pe-batch-size).

Run:
    python spa.py                           # tiny model, built-in household, CPU, minutes
    python spa.py --advantage ppo           # the baseline: PPO on the sparse outcome, same data
    python spa.py --rl-data online          # RL on fresh rollouts of the current policy
    python spa.py --grounding-weight 0      # the paper's ablation without grounding
    python spa.py --progress-weight 0       # the paper's ablation without stepwise progress
    python spa.py --env alfworld --model Qwen2.5-1.5B-Instruct --backend vllm   # the real run

Sections: 1 SPA rewards and advantages, 2 progress estimator, 3 policy and value loss, 4 arguments,
5 rollouts, 6 behavior cloning, 7 evaluation, 8 training loop.
To read: sections 1-3 tell the method, 8 the loop (`main`: rollout -> reward -> advantage ->
update, then `policy_update`); 4 (the flags) and 5-7 (the harness, alike in every script) can wait.
"""

from __future__ import annotations

import copy
import math
import os
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Literal, NamedTuple

import numpy as np

# Before torch loads OpenMP: waiting threads sleep, not spin (docs/performance.md), unless set.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from accelerate.utils import gather_object
from torch import Tensor

import envs
from common import UsageError, config, error_line
from common.config import HarnessArgs
from common.dist import (mean_across_processes, minibatches, my_share, same_start,
                         sum_across_processes, whole_batch)
from common.envbatch import EnvBatch
from common.generation import Policy, episode_keys, make_vllm_engine
from common.model import (add_lora, length_sorted_chunks, load_lora, merge_lora,
                          next_token_losses, pad_prompt_response, pad_rows, response_logprobs)
from common.progress import Progress
from common.run import (Run, check_finite, rollout_stats, save_part, seal_errors, start_run,
                        timer, timings)
from envs.text import (PROMPT_INTRO, encode_prompt, expert_response, is_well_formed,
                       parse_action)


# ---- 1. SPA rewards and advantages (pure functions; only the PE's loss carries a gradient) -----
def action_end_positions(assistant_mask: list[int]) -> list[int]:
    """Index of the last 1 of each run of 1s: the token closing a reply, where the PE reads c_t
    (Eq. 5). [0,0,1,1,0,0,1,1,1,0] -> [3, 8]; a final run counts too; [] and all zeros -> []."""
    n = len(assistant_mask)
    return [j for j in range(n) if assistant_mask[j] and (j + 1 == n or not assistant_mask[j + 1])]


def progress_estimator_loss(step_scores: list[Tensor], final_rewards: Tensor) -> Tensor:
    """Eq. 7: mean over trajectories of (R^ - R)^2, R^ = the sum of the trajectory's contributions
    (Eq. 6). step_scores[i]: (n_i,) c_t of trajectory i; final_rewards: (B,) outcomes (0/1 here,
    any real number works). A scalar with the gradient of the scores. ValueError for an empty
    trajectory or B mismatch."""
    if len(step_scores) != len(final_rewards):
        raise ValueError(f"{len(step_scores)} trajectories but {len(final_rewards)} rewards")
    if any(s.numel() == 0 for s in step_scores):
        raise ValueError("a trajectory without steps has no contributions to sum")
    predicted = torch.stack([s.sum() for s in step_scores])  # Eq. 6
    return ((predicted - final_rewards.to(predicted)) ** 2).mean()  # Eq. 7


def grounding_flag(observation: str, parsed_ok: bool, env_name: str) -> int:
    """g_t of Eq. 8: 0 when the reply did not parse or the environment answered "Nothing
    happens." (it could not execute the action), else 1. env_name must be one of this project's
    environments (household, alfworld); ValueError otherwise, checked first."""
    if env_name not in envs.ENV_NAMES:
        raise ValueError(f"grounding_flag: unknown environment {env_name!r}; "
                         f"one of {', '.join(envs.ENV_NAMES)}")
    return int(parsed_ok and observation.strip() != "Nothing happens.")


def fused_rewards(contribs: list[float], grounded: list[float], alpha: float = 1.0,
                  beta: float = 0.5, step_kl: list[float] | None = None,
                  kl_coef: float = 0.0) -> list[float]:
    """Eq. 8 for one trajectory: r_t = alpha * c_t + beta * g_t, minus kl_coef * step_kl_t when
    step_kl is given (the KL to the reference, summed over the step's tokens). alpha is
    --progress-weight, beta --grounding-weight; `grounded` holds the grounding term g_t per step
    as grounding_terms gives it (g - 1 with the default cost form, g as Eq. 8 writes it with
    eq8). (n,) lists in, (n,) list out; [] -> []. ValueError when the lengths differ."""
    if len(grounded) != len(contribs):
        raise ValueError(f"{len(contribs)} contributions but {len(grounded)} grounding terms")
    if step_kl is not None and len(step_kl) != len(contribs):
        raise ValueError(f"{len(contribs)} contributions but {len(step_kl)} step KLs")
    rewards = [alpha * float(c) + beta * float(g) for c, g in zip(contribs, grounded)]
    if step_kl is not None:
        rewards = [r - kl_coef * float(kl) for r, kl in zip(rewards, step_kl)]
    return rewards


# GAE, whitening and the grounding terms: the same text in spa.py and hisr.py (test_spa_rewards.py)
def grounding_terms(grounded: Tensor, form: str = "cost") -> Tensor:
    """(m,) grounding flags g (1: the action could be executed, 0: not) -> (m,) float64 terms
    before their weight (SPA's beta, HISR's alpha): "eq8" g as written in Eq. 8, "cost" g - 1
    (0 for a grounded step, -1 for another: a grounded step earns nothing, so a longer episode
    earns no more). [1, 0, 1] -> eq8 [1, 0, 1], cost [0, -1, 0]; lists are read as tensors."""
    if form not in ("cost", "eq8"):
        raise ValueError(f"form must be cost or eq8, got {form!r}")
    grounded = torch.as_tensor(grounded, dtype=torch.float64)
    return grounded - 1 if form == "cost" else grounded


def gae(rewards: Tensor, values: Tensor, gamma: float = 0.99, lam: float = 0.95,
        last_value: float = 0.0) -> tuple[Tensor, Tensor]:
    """GAE over one trajectory, the delta of the PPO loss (SPA's Eq. 10, HISR's Eq. 9): delta_k =
    r_k + gamma V_{k+1} - V_k, A_k = delta_k + gamma lam A_{k+1}, V_m = last_value (0 here:
    success and the step limit alike end the episode). (m,) rewards and values (lists are read
    as tensors) -> (advantages, returns = A + V, the critic's targets), (m,) float64 each;
    empty -> empty; ValueError when the lengths differ."""
    if len(rewards) != len(values):
        raise ValueError(f"{len(rewards)} rewards but {len(values)} values")
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    values = torch.as_tensor(values, dtype=torch.float64)
    advantages = torch.zeros_like(rewards)
    next_value, running = float(last_value), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        delta = rewards[k] + gamma * next_value - values[k]
        running = delta + gamma * lam * running
        advantages[k] = running
        next_value = values[k]
    return advantages, advantages + values


def whiten(x: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(population variance + eps) over all of x, float64 (a list is read as a
    tensor); one value -> 0; empty -> empty."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.numel() == 0:
        return x
    return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + eps)


def whiten_pooled(advantages: list[Tensor]) -> list[Tensor]:
    """Every trajectory's (m_i,) advantages whitened pooled over the batch and split back in
    order, float64; an empty trajectory stays empty and out of the statistics; [] -> []."""
    if not advantages:
        return advantages
    return list(whiten(torch.cat(advantages)).split([len(a) for a in advantages]))


def spa_advantages(batch: list[dict], alpha: float = 1.0, beta: float = 0.5, gamma: float = 0.99,
                   lam: float = 0.95, normalize: bool = True,
                   kl_coef: float = 0.0) -> tuple[list[list[float]], list[list[float]]]:
    """The whole batch: fused_rewards (Eq. 8) then gae per trajectory; whiten_pooled if normalize.

    batch[i] = {"contribs": (n_i,), "grounded": (n_i,), "values": (n_i,), optional "step_kl"
    (n_i,)}; other keys are ignored. step_kl is used only when kl_coef > 0 (an entry without it
    gets no KL term). Returns (advantages, un-whitened returns) per trajectory, lists of floats;
    an empty trajectory gives [] and stays out of the whitening; [] gives ([], [])."""
    advantages, returns = [], []
    for traj in batch:
        step_kl = traj.get("step_kl") if kl_coef > 0 else None
        rewards = fused_rewards(traj["contribs"], traj["grounded"], alpha, beta, step_kl,
                                kl_coef)
        adv, ret = gae(rewards, traj["values"], gamma, lam)
        advantages.append(adv)
        returns.append(ret)
    if normalize:
        advantages = whiten_pooled(advantages)
    return [a.tolist() for a in advantages], [r.tolist() for r in returns]


def summarize(traj: dict) -> dict:
    """What advantages and logged stats read of a trajectory: no token ids, cheap to gather."""
    keys = ("state", "next_state", "valid", "well_formed", "parsed", "contrib", "value", "step_kl")
    steps = [{k: s[k] for k in keys if k in s} for s in traj["steps"]]
    return {**{k: traj[k] for k in ("task_type", "group", "won", "rewards")}, "steps": steps}


def compute_advantages(args: Args, summaries: list[dict]) -> tuple[list, list]:
    """(advantages, returns) per step of every trajectory of a batch (summaries with "contrib",
    "value" and "step_kl" per step): SPA's fused reward with the --grounding-form term, or with
    --advantage ppo the sparse outcome in place of the contributions and no grounding term."""
    batch = []
    for t in summaries:
        steps = t["steps"]
        if args.advantage == "spa":
            contribs = [s["contrib"] for s in steps]
            flags = [grounding_flag(s["next_state"], s["parsed"], args.env) for s in steps]
            grounding = grounding_terms(flags, args.grounding_form)  # g - 1, or g (eq8)
        else:
            contribs, grounding = list(t["rewards"]), [0] * len(steps)
        batch.append({"contribs": contribs, "grounded": grounding,
                      "values": [s["value"] for s in steps],
                      "step_kl": [s["step_kl"] for s in steps]})
    progress_weight, grounding_weight = args.progress_weight, args.grounding_weight
    if args.advantage == "ppo":
        progress_weight, grounding_weight = 1.0, 0.0
    return spa_advantages(batch, progress_weight, grounding_weight, args.gamma, args.gae_lambda,
                          args.normalize_advantages, args.kl_coef)


# ---- 2. Progress estimator (Eqs. 5-7) -----------------------------------------------------------
def final_hidden_states(model, input_ids: Tensor, attention_mask: Tensor,
                        position_ids: Tensor | None = None) -> Tensor:
    """(B, L) -> (B, L, H): the last layer's hidden states after the final norm (what the LM head
    reads), LoRA included, for a plain or a PEFT causal LM."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = inner.base_model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def make_head(hidden_size: int, kind: str, device) -> torch.nn.Module:
    """Scalar head in float32: Linear(H, 1), or Linear(H, H)-ReLU-Linear(H, 1). The output layer
    starts at zero, so a new head predicts 0 (with V = 0 a value head's first GAE advantages are
    the rewards discounted by gamma * lambda: rewards 0, 0, 1 at gamma 0.99, lambda 0.95 give
    0.885, 0.941, 1)."""
    layers = [torch.nn.Linear(hidden_size, hidden_size), torch.nn.ReLU()] if kind == "mlp" else []
    layers.append(torch.nn.Linear(hidden_size, 1))
    torch.nn.init.zeros_(layers[-1].weight)
    torch.nn.init.zeros_(layers[-1].bias)
    return torch.nn.Sequential(*layers).to(device=device, dtype=torch.float32)


def trajectory_messages(traj: dict, tokenizer) -> list[dict]:
    """What the PE reads of a trajectory, as a chat: the task and first observation, then every
    reply a_t and the observation o_t it got; the trailing observation is dropped."""
    steps = traj["steps"]
    messages = [{"role": "user",
                 "content": PROMPT_INTRO.format(task=traj["task"]) + "\n" + steps[0]["state"]}]
    for t, step in enumerate(steps):
        reply = tokenizer.decode(step["response_ids"], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        if t + 1 < len(steps):
            messages.append({"role": "user", "content": steps[t + 1]["state"]})
    return messages


def encode_trajectory(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(token ids of the chat, assistant mask): 1 on each reply's tokens and on the token that
    closes it (<|im_end|>), the read position of action_end_positions."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in encoded.offset_mapping]
    mask = [0] * len(starts)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:k], tokenize=False,
                                             add_generation_prompt=True)
        begin, end = len(head), len(head) + len(message["content"])
        if not text.startswith(head) or text[begin:end] != message["content"]:
            raise UsageError("this tokenizer's chat template rewrites the agent's replies; the "
                             "progress estimator needs them verbatim")
        closing = next((j for j, s in enumerate(starts) if s >= end), None)
        if closing is None:
            raise UsageError("this tokenizer's chat template does not close the agent's last "
                             "reply with a token; the progress estimator reads it there")
        for j in range(len(starts)):
            if begin <= starts[j] < end or j == closing:
                mask[j] = 1
    return encoded.input_ids, mask


def progress_forward(pe, head, sequences: list[tuple[list[int], list[int]]],
                     pad_id: int) -> list[Tensor]:
    """c_t = head(h_t) (Eq. 5) for each (ids, assistant mask): h_t is the final hidden state at
    the token closing reply t (causal attention: it sees the task and the history up to reply
    t, not what follows). Returns (n_i,) tensors, differentiable when grad is enabled."""
    device = next(head.parameters()).device
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, (ids, _) in enumerate(sequences):  # right padding: positions 0.. of every row
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
    hidden = final_hidden_states(pe, input_ids.to(device), attention.to(device))
    return [head(hidden[i, action_end_positions(mask)].float()).squeeze(-1)
            for i, (_, mask) in enumerate(sequences)]


EXPLORE_FILE = "explore_rollouts.pt"  # in the run directory: what --rl-data explore trains on


def explore(args: Args, policy: Policy, tasks: list) -> list[dict]:
    """D_explore: the start policy plays every task --explore-rollouts times at
    --explore-temperature, in chunks of one RL batch's size (games in lock-step)."""
    copies = [t for t in tasks for _ in range(args.explore_rollouts)]
    groups = [g for g in range(len(tasks)) for _ in range(args.explore_rollouts)]
    chunk = args.tasks_per_iteration * args.group_size
    progress = Progress(len(copies), "explore")
    trajs: list[dict] = []
    for start in range(0, len(copies), chunk):
        trajs += rollout(args, policy.tokenizer, policy, copies[start:start + chunk],
                         groups[start:start + chunk], args.explore_temperature)
        progress.update(len(copies[start:start + chunk]),
                        success=float(np.mean([t["won"] for t in trajs])))
    progress.close()
    return trajs


def exploration_tasks(args: Args, run: Run, train_tasks: list) -> list:
    """The training tasks the start policy explores (--explore-num-tasks, 0: all; seed + 2), for
    the PE and for --rl-data explore, SPA and PPO alike; [] if none or on --resume. UsageError when
    --rl-data explore has fewer batches than --iterations, or resumes without its EXPLORE_FILE."""
    if args.resume and args.rl_data == "explore" and not os.path.isfile(run.file(EXPLORE_FILE)):
        raise UsageError(f"--resume {args.resume}: no {EXPLORE_FILE} in it (the exploration "
                         "rollouts --rl-data explore trains on)")
    n = min(args.explore_num_tasks or len(train_tasks), len(train_tasks))
    batch_size = args.tasks_per_iteration * args.group_size
    batches = n * args.explore_rollouts // batch_size
    if args.rl_data == "explore" and args.iterations > batches:
        raise UsageError(f"--rl-data explore: {n} tasks x {args.explore_rollouts} rollouts make "
                         f"{batches} batches of {batch_size}, fewer than --iterations "
                         f"{args.iterations}")
    explores = args.rl_data == "explore" or (args.advantage == "spa"
                                             and args.progress_model is None)
    if not explores or args.resume:
        return []
    if not train_tasks:  # --iterations 0 without a train split (common/run.py's start_run)
        raise UsageError(f"SPA explores training tasks to train its progress estimator, and "
                         f"--env {args.env} has no {envs.TRAIN_SPLIT[args.env]} split here; "
                         "give --progress-model <a run>/progress_model, or make the split")
    return random.Random(args.seed + 2).sample(train_tasks, n)


def exploration(args: Args, run: Run, policy: Policy, tasks: list) -> list[dict]:
    """D_explore: played now by the start policy (its new adapter is zero) and, with --rl-data
    explore, saved in the run for a resume; on the resume of such a run, read back."""
    path = run.file(EXPLORE_FILE)
    if args.rl_data == "explore" and args.resume:
        damaged = seal_errors(path)
        try:
            if not damaged:
                return torch.load(path, weights_only=True)
        except Exception as e:  # truncated, or not a torch file
            damaged = [f"{EXPLORE_FILE} cannot be read ({error_line(e)})"]
        raise UsageError(f"--resume {args.resume}: {'; '.join(damaged)}; the rollouts it trains "
                         "on are not as saved, so the run cannot go on")
    if not tasks:
        return []
    policy.sync(run.path)
    trajs = explore(args, policy, tasks)
    if args.rl_data == "explore":  # what a resume trains on
        save_part(path, partial(torch.save, trajs))
    return trajs


def train_progress_estimator(args: Args, pe, head, tokenizer, trajs: list[dict],
                             rng: random.Random) -> dict:
    """Eq. 7 over the exploration rollouts, --pe-epochs epochs of batches of --pe-batch-size
    trajectories; a held-out share (--pe-heldout) reports the fit beside a constant predictor's.
    Trains the PE's LoRA adapter and head in place, then freezes them."""
    encoded = [encode_trajectory(tokenizer, trajectory_messages(t, tokenizer)) for t in trajs]
    keep = [i for i, (ids, _) in enumerate(encoded) if len(ids) <= args.pe_max_tokens]
    tasks = sorted({trajs[i]["group"] for i in keep})  # whole tasks are held out
    rng.shuffle(tasks)
    heldout_tasks = set(tasks[:int(len(tasks) * args.pe_heldout)])
    heldout = [i for i in keep if trajs[i]["group"] in heldout_tasks]
    train = [i for i in keep if trajs[i]["group"] not in heldout_tasks]
    if not train:
        raise UsageError(f"no exploration rollout fits --pe-max-tokens {args.pe_max_tokens} "
                         f"(of {len(trajs)}); raise it")
    outcomes = torch.tensor([float(t["won"]) for t in trajs])
    params = [p for p in pe.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.pe_learning_rate, weight_decay=0.0)
    batches_per_epoch = math.ceil(len(train) / args.pe_batch_size)
    skipped_won = sum(trajs[i]["won"] for i in set(range(len(trajs))) - set(keep))
    print(f"progress estimator: {len(train)} rollouts to train on, {len(heldout)} of "
          f"{len(heldout_tasks)} other tasks held out, {len(trajs) - len(keep)} longer than "
          f"--pe-max-tokens skipped ({skipped_won} of them won), {args.pe_epochs} epochs, "
          f"{args.pe_epochs * batches_per_epoch} updates")
    pe.train()
    progress = Progress(args.pe_epochs * batches_per_epoch, "pe")
    losses: list[float] = []
    for _ in range(args.pe_epochs):
        rng.shuffle(train)
        for start in range(0, len(train), args.pe_batch_size):
            batch = train[start:start + args.pe_batch_size]
            scores = progress_forward(pe, head, [encoded[i] for i in batch],
                                      tokenizer.pad_token_id)
            loss = progress_estimator_loss(scores, outcomes[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            check_finite(f"progress estimator, update {progress.count + 1}", loss=loss.item(),
                         grad_norm=grad_norm.item())
            optimizer.step()
            losses.append(loss.item())
            progress.update(1, loss=float(np.mean(losses[-batches_per_epoch:])))
    progress.close()
    pe.eval()
    pe.requires_grad_(False)
    head.requires_grad_(False)
    stats = {"pe/train_loss": float(np.mean(losses[-batches_per_epoch:])),
             "pe/rollouts": len(train), "pe/skipped_too_long": len(trajs) - len(keep),
             "pe/skipped_too_long_won": skipped_won, "pe/explore_success": float(outcomes.mean())}
    if heldout:
        scores = []
        with torch.no_grad():
            for k in range(0, len(heldout), args.pe_batch_size):
                chunk = [encoded[i] for i in heldout[k:k + args.pe_batch_size]]
                scores += progress_forward(pe, head, chunk, tokenizer.pad_token_id)
        constant = torch.full((len(heldout),), outcomes[train].mean().item())
        stats["pe/heldout_mse"] = progress_estimator_loss(scores, outcomes[heldout]).item()
        stats["pe/heldout_mse_of_constant"] = ((constant - outcomes[heldout]) ** 2).mean().item()
    return stats


def readable_prefix(ids: list[int], mask: list[int], limit: int) -> tuple[list, list]:
    """The first `limit` tokens of an encoded trajectory, with a reply the cut leaves unclosed
    unmasked: c_t sees only s_t and a_t, so every reply closing within the limit is scored as it
    would be in the whole trajectory."""
    ids, cut = ids[:limit], mask[:limit]
    if len(mask) > limit and mask[limit] and cut[-1]:
        j = limit - 1
        while j >= 0 and cut[j]:
            cut[j] = 0
            j -= 1
    return ids, cut


def score_progress(args: Args, pe, head, tokenizer, trajs: list[dict]) -> int:
    """Writes "contrib" (c_t, Eq. 5, no gradient) into every step. A trajectory longer than
    --pe-max-tokens is read up to the limit: its replies that close within it are scored, the
    later steps get 0. Returns how many were that long."""
    encoded = [encode_trajectory(tokenizer, trajectory_messages(t, tokenizer)) for t in trajs]
    lengths = [len(ids) for ids, _ in encoded]
    fits = [i for i, n in enumerate(lengths) if n <= args.pe_max_tokens]
    too_long = [i for i, n in enumerate(lengths) if n > args.pe_max_tokens]
    chunks = length_sorted_chunks(fits, lengths, args.pe_batch_size) + [[i] for i in too_long]
    for i in too_long:
        encoded[i] = readable_prefix(*encoded[i], args.pe_max_tokens)
    for t in trajs:
        for s in t["steps"]:
            s["contrib"] = 0.0
    with torch.no_grad():
        for idx in chunks:
            for i, c in zip(idx, progress_forward(pe, head, [encoded[i] for i in idx],
                                                  tokenizer.pad_token_id)):
                steps = len(trajs[i]["steps"])
                if len(c) > steps or (len(c) < steps and lengths[i] <= args.pe_max_tokens):
                    raise RuntimeError(f"{len(c)} read positions for a trajectory of {steps} "
                                       "steps")
                for s, value in zip(trajs[i]["steps"], c.tolist()):
                    s["contrib"] = value
    return len(too_long)


def progress_stats(args: Args, batch: list[dict], too_long: int) -> dict:
    """The progress rewards in the training log: the mean contribution, the grounded share, the
    trajectories read only in part (too_long, summed over the processes) and the mean predicted
    outcome (Eq. 6) of won and lost trajectories: does it separate them?"""
    steps = [s for t in batch for s in t["steps"]]
    stats = {"reward/contrib_mean": float(np.mean([s["contrib"] for s in steps])),
             "reward/grounded": float(np.mean([grounding_flag(s["next_state"], s["parsed"],
                                                              args.env) for s in steps])),
             "pe/too_long": sum(gather_object([too_long]))}
    for won, name in ((True, "won"), (False, "lost")):
        predicted = [sum(s["contrib"] for s in t["steps"]) for t in batch if t["won"] == won]
        if predicted:
            stats[f"reward/predicted_outcome_{name}"] = float(np.mean(predicted))
    return stats


def save_progress_estimator(path: str, pe, head, base_model: str) -> None:
    """The PE's LoRA adapter (its config naming the start model it was trained on) and head."""
    pe.peft_config["default"].base_model_name_or_path = base_model
    pe.save_pretrained(path, save_embedding_layers=False)  # no hub lookup
    torch.save(head.state_dict(), os.path.join(path, "head.pt"))


def load_progress_estimator(args: Args, start_model, path: str):
    """(PE, head) from a directory save_progress_estimator wrote, on `start_model` (a copy of the
    start: the adapter is loaded into it)."""
    if not os.path.isfile(os.path.join(path, "head.pt")):
        raise UsageError(f"--progress-model {path}: no head.pt in it (not a progress_model/ "
                         "directory of spa.py?)")
    damaged = seal_errors(path)
    if damaged:
        raise UsageError(f"{path} is not as saved ({'; '.join(damaged)})")
    pe = load_lora(start_model, path)
    head = make_head(pe.config.hidden_size, args.pe_head, next(pe.parameters()).device)
    try:
        head.load_state_dict(torch.load(os.path.join(path, "head.pt"), map_location="cpu"))
    except Exception as e:  # truncated, or another head
        raise UsageError(f"{path}/head.pt cannot be loaded ({error_line(e)})") from None
    pe.eval()
    pe.requires_grad_(False)
    head.requires_grad_(False)
    return pe, head


def progress_estimator(args: Args, run: Run, pe_start, tokenizer, explore_trajs: list[dict],
                       start_path: str, began: float):
    """(pe, head), frozen for RL: the progress estimator saved before (--resume,
    --progress-model), or a LoRA adapter on `pe_start` (a copy of the start) and a head trained
    on the exploration rollouts (Eqs. 5-7), logged at iteration 0 (pe/seconds: since `began`,
    exploration included) and saved in the run (progress_model/)."""
    path = os.path.join(run.path, "progress_model")
    if args.resume or args.progress_model:
        return load_progress_estimator(args, pe_start, args.progress_model or path)
    pe = add_lora(pe_start, args.lora_r, args.lora_alpha, args.lora_dropout,
                  args.lora_target_modules)
    head = make_head(pe.config.hidden_size, args.pe_head, run.device)
    stats = train_progress_estimator(args, pe, head, tokenizer, explore_trajs,
                                     random.Random(args.seed + 3))
    stats["pe/seconds"] = time.time() - began
    fit = (f", held-out MSE {stats['pe/heldout_mse']:.4f} (a constant: "
           f"{stats['pe/heldout_mse_of_constant']:.4f})" if "pe/heldout_mse" in stats else "")
    print(f"progress estimator done in {stats['pe/seconds']:.0f}s: exploration success "
          f"{stats['pe/explore_success']:.3f}, train loss {stats['pe/train_loss']:.4f}{fit}")
    run.log(stats, 0)
    save_part(path, lambda folder: save_progress_estimator(folder, pe, head, start_path),
              reuse="--progress-model")
    return pe, head


# ---- 3. Policy and value loss (Eq. 10) ----------------------------------------------------------
def policy_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """(B, L) -> (B, L) pi / pi_old per token; 1 where masked (masked first: no overflow)."""
    return torch.exp(torch.where(mask.bool(), logp - old_logp, torch.zeros_like(logp)))


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  clip_eps: float = 0.2, entropy: Tensor | None = None,
                  entropy_coef: float = 0.0, clip_ratio_c: float | None = None) -> Tensor:
    """The negated clipped surrogate (Eq. 10) - entropy bonus, token-mean over mask.

    logp, old_logp, mask (and entropy): (B, L); advantages: (B,) one value per step, used for
    every token of its reply. Values at masked positions never matter. clip_ratio_c: dual clip,
    the loss of a token with A < 0 is at most -c * A. (The KL term is in the reward.)"""
    advantages = advantages[:, None]
    ratio = policy_ratio(logp, old_logp, mask)
    pg_loss = -torch.min(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    if clip_ratio_c is not None:
        bounded = torch.min(pg_loss, -clip_ratio_c * advantages)
        pg_loss = torch.where(advantages < 0, bounded, pg_loss)
    if entropy is not None and entropy_coef:
        pg_loss = pg_loss - entropy_coef * entropy
    return (pg_loss * mask).sum() / mask.sum().clamp(min=1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float = 0.2) -> Tensor:
    """(B,) -> per-step clipped value loss (B,): 0.5 * max((V - G)^2, (V_old + clip(V - V_old,
    -clip, clip) - G)^2), as trl; the caller averages it over steps."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)


def policy_forward(model, value_head, prompts: list[list[int]], responses: list[list[int]],
                   pad_id: int, temperature: float = 1.0, with_entropy: bool = False):
    """One pass of the policy for both heads: per-token log pi(reply token | prompt, earlier
    tokens) under softmax(logits / temperature), and V(s_t) read at the last prompt token.

    Returns (logp (B, R), mask (B, R), entropy (B, R) or None, values (B,)). Prompts are
    left-padded to P columns (pad_prompt_response), so column P - 1 is every prompt's last
    token; only the reply positions' logits are computed."""
    device = next(model.parameters()).device
    input_ids, attention, position_ids, targets, mask = (
        t.to(device) for t in pad_prompt_response(prompts, responses, pad_id))
    P = input_ids.shape[1] - targets.shape[1]
    hidden = final_hidden_states(model, input_ids, attention, position_ids)
    lm_head = model.get_output_embeddings()
    logits = lm_head(hidden[:, P - 1:-1]).float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    values = value_head(hidden[:, P - 1].float()).squeeze(-1)
    return logp, mask.float(), entropy, values


# ---- 4. Arguments -------------------------------------------------------------------------------
@dataclass
class Args(HarnessArgs):
    """SPA (and the PPO baseline on the sparse outcome) for multi-turn LLM agents."""

    exp_name: str = "spa"  # runs/<exp-name>__<env>__<advantage>__<seed>__<time>
    seed: int = 1  # seeds python, numpy, torch and the evaluations' own generator
    # household (built in) or alfworld (needs $ALFWORLD_DATA; docs/environments.md)
    env: Literal["household", "alfworld"] = "household"
    # local dir, hub id or Qwen name; tiny, tiny-weak, tiny-alfworld (ALFWorld), tiny-scratch (BC)
    model: str = "tiny"
    # rollout generation: transformers generate, its continuous batching, or vLLM (GPU)
    backend: Literal["hf", "hf-cb", "vllm"] = "hf"

    # Reward: spa, GAE over Eq. 8's fused reward; or the baseline ppo, GAE over the sparse
    # outcome with no progress estimator
    advantage: Literal["spa", "ppo"] = "spa"
    progress_weight: float = 1.0  # alpha, weight of c_t (Eq. 8); 0: ablation w/o stepwise progress
    grounding_weight: float = 0.5  # beta, weight of g_t (Eq. 8); 0: ablation w/o grounding
    gamma: float = 0.99  # discount of GAE (the code's config)
    gae_lambda: float = 0.95  # lambda of GAE (trl's default)
    normalize_advantages: bool = True  # whiten the batch's step advantages (population variance)
    # cost: beta * (g_t - 1); eq8: beta * g_t as written (online, pays for length)
    grounding_form: Literal["cost", "eq8"] = "cost"
    kl_coef: float = 0.01  # per-step KL to the reference, subtracted from the reward; 0 skips it
    vf_coef: float = 0.1  # weight of the value loss beside the policy loss
    value_clip: float = 0.2  # the value loss clips V to V_old +- this (V_old: before the update)
    value_learning_rate: float = 5e-3  # AdamW rate of the value head (the LoRA's: --learning-rate)

    # Exploration and the progress estimator (Eqs. 5-7)

    # RL data: explore, one pass over the exploration rollouts (the released code's); online,
    # fresh rollouts of the current policy
    rl_data: Literal["explore", "online"] = "explore"
    explore_num_tasks: int = 64  # training tasks the start policy explores; 0 = all of them
    explore_rollouts: int = 8  # M, rollouts per explored task
    explore_temperature: float = 0.7  # sampling temperature of the exploration rollouts
    # a trained PE (a run's progress_model/): with --rl-data online, skips its training
    progress_model: str | None = None
    pe_epochs: int = 2  # epochs of PE training over the exploration rollouts
    pe_learning_rate: float = 1e-4  # AdamW learning rate of the PE's LoRA and head
    pe_batch_size: int = 8  # trajectories per PE update
    pe_head: Literal["linear", "mlp"] = "linear"  # PE head: Linear(H, 1), or mlp (the paper's)
    pe_max_tokens: int = 2048  # longest trajectory the PE reads
    pe_heldout: float = 0.1  # share of the exploration rollouts held out to report the PE's fit

    # RL
    iterations: int = 8  # training iterations; 0 = BC, exploration, PE training, start evaluation
    tasks_per_iteration: int = 4  # training tasks per iteration, each played --group-size times
    group_size: int = 8  # N trajectories per task (SPA needs no groups: the scripts' batch shape)
    max_episode_steps: int = 30  # step limit of a game
    learning_rate: float = 5e-4  # AdamW learning rate of the LoRA weights
    weight_decay: float = 0.0  # AdamW weight decay of the RL update
    clip_eps: float = 0.2  # PPO clip range epsilon of the ratio (Eq. 10)
    clip_ratio_c: float | None = None  # dual clip c > 1: for A < 0 the loss is at most -c * A
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
    lora_r: int = 16  # LoRA rank of the RL adapter and the PE's (and of BC without full params)
    lora_alpha: int = 32  # LoRA alpha (the update is scaled by alpha / r)
    lora_dropout: float = 0.0  # dropout on the LoRA input
    lora_target_modules: str = "all-linear"  # comma-separated module names, or all-linear

    # Behavior cloning on expert trajectories (SPA's first stage)
    bc_epochs: int = 0  # epochs of behavior cloning before exploration; 0 skips it
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
    eval_temperature: float = 0.4  # sampling temperature of evaluation (SPA's paper: 0, greedy)
    eval_top_p: float = 1.0  # nucleus sampling of evaluation (1: off; training never truncates)
    save_every: int = 2  # iterations between checkpoints (the last iteration is always saved)


# The defaults above are the tiny models' (--model tiny, tiny-weak). --model picks one row of
# PRESETS on top of them: tiny-scratch and tiny-alfworld their own, any other model "real" (a
# "baseline" row, where a script has one, follows for another --advantage). The harness's own
# fields (device, max_prompt_tokens, ...) are HarnessArgs', in common/config.py.
PRESETS = {
    "tiny-scratch": dict(bc_epochs=3),
    "tiny-alfworld": dict(max_episode_steps=50, eval_splits=("valid_unseen",), eval_num_tasks=0,
                          explore_num_tasks=26, explore_rollouts=10, pe_max_tokens=4096),
    "real": dict(iterations=150, tasks_per_iteration=16, max_episode_steps=50, learning_rate=1e-5,
                 micro_batch_size=8, gradient_checkpointing=True, max_new_tokens=512,
                 history_length=2, reasoning=True, bc_epochs=3, bc_full_params=False,
                 bc_prompt_loss_weight=0.0, bc_learning_rate=1e-4, bc_batch_size=16, eval_every=5,
                 eval_num_tasks=0, ppo_epochs=4, lora_r=8, lora_alpha=16, explore_num_tasks=0,
                 explore_rollouts=10, pe_epochs=1, pe_learning_rate=1e-5, pe_max_tokens=16384,
                 value_learning_rate=1e-5),
}
RANGES = {  # the method's flags; common/config.py's RANGES: the harness's
    "progress_weight": ">= 0", "grounding_weight": ">= 0", "gamma": "in (0, 1]",
    "gae_lambda": "in [0, 1]", "vf_coef": ">= 0", "value_clip": "> 0",
    "value_learning_rate": "> 0", "explore_num_tasks": ">= 0 (0 = every training task)",
    "explore_rollouts": ">= 1", "explore_temperature": "> 0", "pe_epochs": ">= 1",
    "pe_learning_rate": "> 0", "pe_batch_size": ">= 1", "pe_max_tokens": ">= 16",
    "pe_heldout": "in [0, 1)",
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
def score_rollouts(args: Args, model, value_head, tokenizer, trajs: list[dict]) -> None:
    """The scoring passes before the advantages, no gradient: the current policy's log-probs of
    every reply ("old_logprobs", the ratio's denominator) and V(s_t) ("value") in one pass, then
    the reference's (adapter disabled) for "step_kl" = sum over the reply's tokens of log pi_old -
    log pi_ref. Written into each step; each pass timed under its name."""
    steps = [s for tr in trajs for s in tr["steps"]]
    lengths = [len(s["prompt"]) + len(s["response_ids"]) for s in steps]
    chunks = length_sorted_chunks(list(range(len(steps))), lengths, args.micro_batch_size)

    def forward(idx: list[int]):
        return policy_forward(model, value_head, [steps[i]["prompt"] for i in idx],
                              [steps[i]["response_ids"] for i in idx], tokenizer.pad_token_id,
                              args.rollout_temperature)

    model.eval()  # no dropout when scoring the rollout policy
    with torch.no_grad(), timer("old_logprobs"):
        for idx in chunks:
            logp, _, _, values = forward(idx)
            for row, value, i in zip(logp.cpu(), values.tolist(), idx):
                steps[i]["old_logprobs"] = row[:len(steps[i]["response_ids"])]
                steps[i]["value"] = value
                steps[i]["step_kl"] = 0.0  # the reference pass below, with a KL term
    with torch.no_grad(), timer("ref_logprobs"):
        if args.kl_coef > 0:  # without a KL term the reference pass is skipped
            for idx in chunks:
                with model.disable_adapter():  # the same pass, so a zero adapter gives KL 0
                    ref, _, _, _ = forward(idx)
                for row, i in zip(ref.cpu(), idx):
                    old = steps[i]["old_logprobs"]
                    steps[i]["step_kl"] = (old - row[:len(old)]).sum().item()


class StepSample(NamedTuple):
    """One step of the batch as the PPO update with a critic reads it."""
    prompt: list[int]  # token ids
    response: list[int]  # token ids
    advantage: float
    ret: float  # the critic's target: the GAE advantage before whitening + value
    old_logprobs: Tensor  # (len(response),), scored by the policy before the update
    old_value: float  # V(s_t) scored before the update, for the clipped value loss


def policy_update(args: Args, model, value_head, tokenizer, optimizer,
                  samples: list[StepSample], generator: torch.Generator, iteration: int) -> dict:
    """PPO with a critic over the step samples, `ppo_epochs` passes of shuffled mini-batches: loss
    = clipped surrogate (token-mean) + vf_coef * clipped value loss (step-mean). Data parallel:
    `samples` is this process's share of the batch, in process order; the mini-batches are drawn
    as one process would draw them, and the update is the sum of every process's gradients."""
    pad, mb = tokenizer.pad_token_id, args.micro_batch_size
    temperature = args.rollout_temperature  # the policy PPO scores (its old log-probs too)
    device = next(model.parameters()).device
    lengths = [len(s.prompt) + len(s.response) for s in samples]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad] + list(value_head.parameters())
    stats = defaultdict(list)
    response_lengths = [len(s.response) for s in samples]
    # ppo_epochs fresh shuffles, each cut into mini-batches of --minibatch-size (the last may be
    # smaller), one optimizer step each. A MiniBatch: .mine, this process's members (indices into
    # `samples`); .size, .tokens: its samples and response tokens, all processes; .epoch, .start.
    for mini in minibatches(response_lengths, args.minibatch_size, args.ppo_epochs, generator):
        optimizer.zero_grad(set_to_none=True)
        minibatch_loss = 0.0
        # This process's members (mini.mine) in micro-batches, any order: the gradient is a sum.
        for idx in length_sorted_chunks(mini.mine, lengths, mb):
            logp, mask, entropy, values = policy_forward(
                model, value_head, [samples[i].prompt for i in idx],
                [samples[i].response for i in idx], pad, temperature,
                with_entropy=args.entropy_coef > 0)
            old = pad_rows([samples[i].old_logprobs for i in idx], logp.shape[1]).to(device)
            adv = torch.tensor([samples[i].advantage for i in idx], dtype=torch.float32,
                               device=device)
            returns = torch.tensor([samples[i].ret for i in idx], dtype=torch.float32,
                                   device=device)
            old_values = torch.tensor([samples[i].old_value for i in idx], dtype=torch.float32,
                                      device=device)
            pg_loss = ppo_clip_loss(logp, old, adv, mask, args.clip_eps, entropy,
                                    args.entropy_coef, args.clip_ratio_c)
            vf_loss = value_loss(values, old_values, returns, args.value_clip)
            # token-mean of the policy loss and step-mean of the value loss over the mini-batch
            share = pg_loss * mask.sum() / mini.tokens + args.vf_coef * (vf_loss.sum() / mini.size)
            share.backward()
            minibatch_loss += share.item()
            with torch.no_grad():
                ratio = policy_ratio(logp, old, mask)
                clipped = ((ratio - 1).abs() > args.clip_eps).float()
                stats["clip_fraction"].append(((clipped * mask).sum() / mask.sum()).item())
                stats["policy_loss"].append(pg_loss.item())
                stats["value_loss"].append(vf_loss.mean().item())
        # Data parallel: every process's gradients (and loss) summed; one process: unchanged.
        minibatch_loss = sum_across_processes(params, minibatch_loss)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        check_finite(f"iteration {iteration}, PPO epoch {mini.epoch + 1}, mini-batch at "
                     f"{mini.start}", loss=minibatch_loss, grad_norm=grad_norm)
        stats["loss"].append(minibatch_loss)
        stats["grad_norm"].append(grad_norm)
        optimizer.step()
    return {f"train/{k}": v for k, v in mean_across_processes(stats).items()}


def batch_stats(batch: list[dict], advantages: list, returns: list) -> dict:
    """What the log shows of an iteration's batch (every process's summaries, with their
    advantages and returns): rollout_stats, the critic's mean value and the share of the
    returns' variance it explains, the mean step KL."""
    steps = [s for tr in batch for s in tr["steps"]]
    values = np.array([s["value"] for s in steps])
    targets_g = np.array([g for ret in returns for g in ret])
    return {**rollout_stats(batch, advantages),
            "train/value_mean": float(values.mean()),
            "train/explained_variance": float(
                1 - np.var(targets_g - values) / max(np.var(targets_g), 1e-12)),
            "reward/step_kl_mean": float(np.mean([s["step_kl"] for s in steps]))}


# The command line (common/config.py): value checks, --model/--env/--advantage presets, parsing.
def validate_args(args: Args) -> list[str]:
    a = args
    rules = [  # what a range cannot say (common/config.py checks the harness's flags)
        (a.progress_model is None or os.path.isdir(a.progress_model),
         f"--progress-model {a.progress_model}: no such directory"),
        (a.progress_model is None or a.advantage == "spa",
         "--progress-model is read by --advantage spa only"),
        (a.rl_data == "online" or a.progress_model is None,
         "--rl-data explore needs the exploration rollouts: drop --progress-model"),
    ]
    return config.errors(a, RANGES) + [message for ok, message in rules if not ok]


def preset_args(model: str = "tiny", env: str = "household", advantage: str | None = None) -> Args:
    return config.preset_args(Args, PRESETS, model, env, advantage)


def parse_args(argv: list[str]) -> Args:
    return config.parse_args(Args, PRESETS, argv)


def main(args: Args) -> dict:
    one_process = []  # what several processes cannot do
    if args.advantage == "spa" and args.progress_model is None and not args.resume:
        one_process.append("exploration and the progress estimator's training run in one "
                           "process: run `python spa.py ... --iterations 0` once, then launch RL "
                           "with --rl-data online --progress-model <its run>/progress_model")
    if args.rl_data == "explore":
        one_process.append("--rl-data explore runs in one process (with several: --rl-data "
                           "online)")
    # What the RL launch after behavior cloning takes besides its model (launch_errors):
    also = " --progress-model <its run>/progress_model" if args.advantage == "spa" else ""
    run, train_tasks, eval_tasks = start_run(args, __file__, validate_args(args),
                                             also=also, one_process=one_process)
    explore_tasks = exploration_tasks(args, run, train_tasks)  # checked before the model loads

    # Model: the start (--model, or cloned from the expert first), then RL's LoRA adapter.
    model, tokenizer = run.load_model()
    run.open()  # only now: a run stopped by bad flags or missing data leaves nothing

    if args.bc_epochs > 0 and not args.resume:
        model = clone_start(args, run, model, tokenizer, train_tasks)
    start_path = run.keep_base(model, tokenizer)  # the start's directory or hub id
    # SPA's progress estimator starts from the policy's start: a copy, before the policy's adapter.
    pe_start = copy.deepcopy(model) if args.advantage == "spa" else None
    if args.resume:
        model = load_lora(model, run.checkpoint)
    else:
        model = add_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout,
                         args.lora_target_modules)
    model.print_trainable_parameters()
    # The critic: a value head on the policy's final hidden state, backbone and adapter shared.
    value_head = make_head(model.config.hidden_size, "linear", run.device)
    same_start([*model.parameters(), *value_head.parameters()], args.seed)  # process 0's weights

    engine = make_vllm_engine(start_path, args) if args.backend == "vllm" else None
    policy = Policy(args, model, tokenizer, engine)

    # Exploration by the start policy (adapter zero), then the PE (Eqs. 5-7) or the saved one.
    pe = pe_head = None
    t0 = time.time()
    explore_trajs = exploration(args, run, policy, explore_tasks)
    if args.advantage == "spa":
        pe, pe_head = progress_estimator(args, run, pe_start, tokenizer, explore_trajs,
                                         start_path, t0)
        del pe_start
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.requires_grad]},
         {"params": list(value_head.parameters()), "lr": args.value_learning_rate}],
        lr=args.learning_rate, weight_decay=args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    task_rng = random.Random(args.seed)
    start_iteration = run.restore(optimizer=optimizer, value_head=value_head, generator=generator,
                                  task_rng=task_rng)

    batch_size = args.tasks_per_iteration * args.group_size
    progress = Progress(args.iterations, "rl", initial=start_iteration, interval=0)
    evaluate_splits = partial(evaluate, args, policy)  # (split, tasks) -> its stats

    if start_iteration == 0:
        policy.sync(run.path)  # vLLM reads the adapter from disk; hf: nothing to do
        run.evaluate(0, eval_tasks, evaluate_splits)
    for iteration in range(start_iteration + 1, args.iterations + 1):
        t0 = time.time()
        timings()  # the clocks restart: evaluations and set-up are not the iteration's
        if args.rl_data == "explore":  # the next batch of exploration rollouts, in order
            # Sampled by the start policy at --explore-temperature (a task's rollouts may straddle
            # two batches), as the release trains on them; score_rollouts (3) rescores their old
            # log-probs under the current policy at --rollout-temperature: PPO's ratio starts at 1.
            trajs = explore_trajs[(iteration - 1) * batch_size:iteration * batch_size]
        else:  # (1) B tasks x N copies, (2) lock-step rollouts of the current policy
            batch_tasks = task_rng.sample(train_tasks, args.tasks_per_iteration)
            policy.sync(run.path)
            # Each task N times, a group (id: its index in the batch); this process's groups only.
            tasks, groups = my_share(batch_tasks, args.group_size)
            trajs = rollout(args, tokenizer, policy, tasks, groups, args.rollout_temperature,
                            keys=episode_keys((args.seed, "train", iteration), groups))
        rollout_seconds = time.time() - t0
        # (3) old log-probs and values, the reference's step KL, contributions c_t (Eq. 5).
        score_rollouts(args, model, value_head, tokenizer, trajs)
        too_long = 0
        if pe is not None:
            with timer("progress"):
                too_long = score_progress(args, pe, pe_head, tokenizer, trajs)
        # (4) fused rewards (Eq. 8) and GAE over the batch, whitened; each process keeps its own
        with timer("advantages"):
            # batch: every process's (one process: trajs'); mine: where trajs' lie among them
            batch, mine = whole_batch([summarize(t) for t in trajs])
            batch_advantages, batch_returns = compute_advantages(args, batch)
            advantages, returns = batch_advantages[mine], batch_returns[mine]
        samples = [StepSample(s["prompt"], s["response_ids"], float(a), float(g),
                              s["old_logprobs"], s["value"])
                   for tr, adv, ret in zip(trajs, advantages, returns)
                   for s, a, g in zip(tr["steps"], adv, ret)]
        # (5) the clipped policy update with the critic's value loss (Eq. 10).
        policy.sleep()  # --vllm-sleep: the engine's memory to the update
        with timer("update"):
            stats = policy_update(args, model, value_head, tokenizer, optimizer, samples,
                                  generator, iteration)
        batch_tokens, _ = whole_batch([len(s.response) for s in samples])  # every process's
        stats.update(batch_stats(batch, batch_advantages, batch_returns))
        stats.update({"time/rollout_seconds": rollout_seconds,
                      "time/iteration_seconds": time.time() - t0})
        if args.rl_data == "online":  # explore mode generates nothing here
            stats["rollout/tokens_per_second"] = sum(batch_tokens) / max(rollout_seconds, 1e-9)
        if pe is not None:
            stats.update(progress_stats(args, batch, too_long))
        stats.update(timings())  # the main process's timer("x") blocks as time/x_seconds
        stats.update(policy.stats())  # vLLM: its log-probs' gap to the trainer's
        run.log(stats, iteration)
        progress.update(1, success=stats["rollout/success"], grounding=stats["rollout/grounding"],
                        kl=stats["reward/step_kl_mean"], vf=stats["train/value_loss"],
                        rollout_s=round(rollout_seconds),
                        update_s=round(stats["time/update_seconds"]),
                        iter_s=round(stats["time/iteration_seconds"]))
        if iteration % args.eval_every == 0 or iteration == args.iterations:
            policy.sync(run.path)
            run.evaluate(iteration, eval_tasks, evaluate_splits)
        if iteration % args.save_every == 0 or iteration == args.iterations:
            run.save(model, start_path, iteration, optimizer=optimizer,
                     value_head=value_head, generator=generator, task_rng=task_rng)
    progress.close()
    summary = run.finish()  # summary.json first: closing a backend cannot cost it
    policy.close()
    return summary


if __name__ == "__main__":
    config.run_command_line(main, parse_args)  # a bad flag: exit status 2; a NaN loss: 1
