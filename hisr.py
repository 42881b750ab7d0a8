"""HISR: Hindsight-modulated Segmental process Rewards (Lu et al., 2026), single-file reference.

HISR builds on SPA (spa.py): the behavior-cloned policy plays the training tasks, reward models
are trained on what it collected and frozen, then PPO with a critic and GAE optimises a dense
reward. Two things differ from SPA:
  * segments instead of turns: a trajectory is cut into sub-goal segments, and a segmental
    process reward model (SPRM: a copy of the start policy and an MLP head, Eq. 2) scores each
    segment at its last token, trained so that a trajectory's segment scores sum to its outcome
    (Eq. 3);
  * hindsight modulation: a hindsight model (another copy, fine-tuned to fill in one hidden reply
    of a finished trajectory that shows everything after it and the outcome, Eq. 4) scores each
    reply; its likelihood over the rollout policy's, per token and to the power 1/beta, is the
    action's importance z (Eqs. 5-6), summed per segment. The segment rewards times the
    importances, L1-normalised (Eq. 7), land on each segment's last turn, and the turn reward is
    (1 - alpha) * that + alpha * g_t, g_t = 1 when the action was admissible (Eq. 8). The outcome
    enters only through the two reward models.

Departures from the paper, no code released (docs/hisr.md, "Departures from the paper, in full"):
  * Segments end at environment events, not GPT-4o's; --segmenter turns: one a turn ("w/o SPR").
  * Collection drops trajectories with a malformed reply (--collect-filter none keeps them); a
    held-out tenth of the tasks (--aux-heldout) reports the reward models' fit.
  * SPRM head W2 SiLU(W1 h), no biases, W2 zero at the start; both reward models are full copies,
    every weight trained.
  * Inputs: one chat of the episode; the cloze shows all but reply k, turn k's admissible
    actions, the outcome; float32; over --aux-max-tokens: cut, counted.
  * Eq. 5 over the rollout policy; Eq. 7 L1 times the SPRM's mass (--him-scale sprm; unit: Eq. 7
    as written), on the segment's last turn; --no-use-hindsight (w/o HIM): z = 1, and no
    hindsight model is trained.
  * Grounding as a cost, alpha * (g_t - 1), Eq. 8 less a constant per turn: --grounding-form eq8.
  * Online RL: every iteration rolls out the current policy (the paper does not say).
  * PPO, KL (fixed 0.01) and critic as spa.py's: a value head sharing the LoRA, not the spec's
    separate critic adapter, so that the two scripts differ only in their rewards.
  * Batch and tiny presets: the harness's (the spec's tiny: 16 rollouts, 4 epochs of 64, rank 8);
    real preset: the spec's, but the harness's BC; the paper's Llama-3.2-3B-Instruct: --model.
  * Harness prompts, rollouts, BC; eval at 0.4 (the paper: --eval-temperature 0); tiny ships
    cloned (--bc-epochs 0), real models clone with LoRA (the paper: every weight).
  * Not built: streaming the cloze inputs (a batch's are encoded up front).
  * Readings removed since (and the commit that has them): docs/hisr.md, "Readings removed".

Run:
    python hisr.py                          # tiny model, built-in household, CPU, minutes
    python hisr.py --advantage ppo          # the baseline: PPO on the sparse outcome
    python hisr.py --no-use-hindsight       # the ablations: w/o HIM, --segmenter turns (w/o
                                            # SPR), both, --grounding-weight 0 (w/o AGR)
    python hisr.py --him-scale unit --grounding-form eq8    # Eqs. 7 and 8 as written
    python hisr.py --env alfworld --model Qwen2.5-1.5B-Instruct --backend vllm   # the real run

Sections: 1 HISR rewards and advantages, 2 segments and the reward models, 3 policy and value loss,
4 arguments, 5 rollouts, 6 behavior cloning, 7 evaluation, 8 training loop.
To read: sections 1-3 tell the method, 8 the loop (`main`: rollout -> reward -> advantage ->
update, then `policy_update`); 4 (the flags) and 5-7 (the harness, alike in every script) can wait.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Literal, NamedTuple

import numpy as np

# Before torch loads OpenMP: waiting threads sleep, not spin (docs/performance.md), unless set.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
from torch import Tensor

import envs
from common import UsageError, config, error_line
from common.config import HarnessArgs
from common.dist import (mean_across_processes, minibatches, my_share, same_start,
                         sum_across_processes, whole_batch)
from common.envbatch import EnvBatch
from common.generation import Policy, episode_keys, make_vllm_engine
from common.model import (TINY_NAMES, add_lora, length_sorted_chunks, load_lora, merge_lora,
                          next_token_losses, pad_prompt_response, pad_rows,
                          response_logprobs, scored_logprobs)
from common.progress import Progress
from common.run import (Run, check_finite, rollout_stats, save_part, seal_errors, start_run,
                        timer, timings)
from envs.text import (PROMPT_INTRO, encode_prompt, expert_response, is_well_formed,
                       parse_action)


# ---- 1. HISR rewards and advantages (pure functions: float64 tensors in, no grad) --------------
def segment_ends(seg_ids: Tensor) -> Tensor:
    """(m,) segment ids -> (n,) index of each segment's last turn: [0,0,1,2,2] -> [1,2,4]."""
    if seg_ids.numel() == 0:
        return seg_ids.new_zeros(0)
    last = torch.ones_like(seg_ids, dtype=torch.bool)
    last[:-1] = seg_ids[1:] != seg_ids[:-1]
    return torch.nonzero(last).squeeze(-1)


def check_segment_ids(seg_ids: Tensor) -> int:
    """n, the number of segments; ValueError unless the ids are 0..n-1, non-decreasing by steps
    of 0 or 1."""
    if seg_ids.numel() == 0:
        return 0
    steps = seg_ids[1:] - seg_ids[:-1]
    if seg_ids[0] != 0 or not bool(((steps == 0) | (steps == 1)).all()):
        raise ValueError(f"segment ids must be contiguous from 0, got {seg_ids.tolist()}")
    return int(seg_ids[-1]) + 1


def action_log_importance(hind_logp: Tensor, policy_logp: Tensor, mask: Tensor,
                          beta: float = 0.3) -> Tensor:
    """Eqs. 5-6 in log space, (m, L) x 3 -> (m,): l_k = sum_j mask * (hind - policy) /
    (beta * sum_j mask), the mean token log-ratio over beta; 0 for an empty mask row. Values
    outside the mask never enter."""
    if not hind_logp.shape == policy_logp.shape == mask.shape:
        raise ValueError(f"shapes differ: {tuple(hind_logp.shape)}, {tuple(policy_logp.shape)}, "
                         f"{tuple(mask.shape)}")
    real = mask.bool()
    diff = torch.where(real, hind_logp.double() - policy_logp.double(), 0.0)
    counts = real.sum(-1).double()
    return torch.where(counts > 0, diff.sum(-1) / (beta * counts.clamp(min=1)), 0.0)


def action_importance(hind_logp: Tensor, policy_logp: Tensor, mask: Tensor,
                      beta: float = 0.3) -> Tensor:
    """Eq. 6: z(a_k) = exp(l_k), (m,)."""
    return action_log_importance(hind_logp, policy_logp, mask, beta).exp()


def segment_importance(log_z: Tensor, seg_ids: Tensor, normalize: bool = True) -> Tensor:
    """(m,), (m,) -> (n,): z(s_i) = sum over the segment's turns of z(a_k) = exp(l_k). With
    normalize, divided by the trajectory's total, computed with the max shift (no overflow for
    any l); without, the raw sums (may overflow)."""
    if log_z.shape != seg_ids.shape:
        raise ValueError(f"{log_z.numel()} importances but {seg_ids.numel()} segment ids")
    n = check_segment_ids(seg_ids)
    log_z = log_z.double()
    shift = log_z.max() if normalize and n else 0.0
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, seg_ids, (log_z - shift).exp())
    return sums / sums.sum() if normalize else sums


def modulate_segment_rewards(seg_rewards: Tensor, seg_importance: Tensor, scale: str = "unit",
                             eps: float = 1e-12) -> Tensor:
    """Eq. 7 with the L1 norm, (n,), (n,) -> (n,): x = r * z, d = sum |x|; zeros when d <= eps;
    "unit": x / d (the paper's; L1 mass 1 whatever the outcome); "sprm": x / d * sum |r| (keeps
    the SPRM's L1 mass; equal to "unit" when the r are >= 0 and sum to 1)."""
    if seg_rewards.shape != seg_importance.shape:
        raise ValueError(f"{seg_rewards.numel()} segment rewards but {seg_importance.numel()} "
                         "importances")
    if scale not in ("unit", "sprm"):
        raise ValueError(f"scale must be unit or sprm, got {scale!r}")
    x = seg_rewards.double() * seg_importance.double()
    mass = x.abs().sum()
    if mass <= eps:
        return torch.zeros_like(x)
    modulated = x / mass  # Eq. 7
    return modulated * seg_rewards.double().abs().sum() if scale == "sprm" else modulated


def turn_rewards(seg_values: Tensor, seg_ids: Tensor, placement: str = "end") -> Tensor:
    """(n,), (m,) -> (m,): "end" puts segment i's value on its last turn, 0 on the others;
    "uniform" gives each of its turns value_i / |s_i|."""
    n = check_segment_ids(seg_ids)
    if len(seg_values) != n:
        raise ValueError(f"{len(seg_values)} segment values but {n} segments")
    seg_values = seg_values.double()
    if placement == "end":
        rewards = torch.zeros(len(seg_ids), dtype=torch.float64)
        rewards[segment_ends(seg_ids)] = seg_values
        return rewards
    if placement == "uniform":
        sizes = torch.bincount(seg_ids, minlength=n).double()
        return (seg_values / sizes)[seg_ids]
    raise ValueError(f"placement must be end or uniform, got {placement!r}")


def fused_rewards(him: Tensor, grounded: Tensor, alpha: float = 0.3, step_kl: Tensor | None = None,
                  kl_coef: float = 0.0) -> Tensor:
    """Eq. 8 (+ the KL penalty), (m,) -> (m,): r_k = (1 - alpha) him_k + alpha g_k - kl_coef
    step_kl_k (no KL term when step_kl is None). alpha is --grounding-weight (HISR's alpha, not
    SPA's); `grounded` holds the grounding term g_k as grounding_terms gives it (g - 1 with the
    default cost form, g with eq8)."""
    if len(grounded) != len(him) or (step_kl is not None and len(step_kl) != len(him)):
        raise ValueError(f"{len(him)} turn rewards, {len(grounded)} grounding flags"
                         + ("" if step_kl is None else f", {len(step_kl)} step KLs"))
    rewards = (1 - alpha) * him.double() + alpha * grounded.double()  # Eq. 8
    if step_kl is not None:
        rewards = rewards - kl_coef * step_kl.double()
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


def hisr_rewards(seg_rewards: Tensor, log_z: Tensor, seg_ids: Tensor, grounded: Tensor,
                 alpha: float = 0.3, placement: str = "end", scale: str = "unit",
                 use_hindsight: bool = True, step_kl: Tensor | None = None,
                 kl_coef: float = 0.0) -> Tensor:
    """One trajectory's turn rewards, (m,): segment importances (ones without hindsight: the
    "w/o HIM" ablation keeps Eq. 7's normalisation), the modulated segment rewards (Eq. 7)
    placed on turns, fused with grounding (Eq. 8) and the KL penalty."""
    n = check_segment_ids(seg_ids)
    if use_hindsight:
        importance = segment_importance(log_z, seg_ids)  # z(s_i), Eq. 6's z(a_k) summed
    else:
        importance = torch.ones(n, dtype=torch.float64)
    if len(seg_rewards) != n:
        raise ValueError(f"{len(seg_rewards)} segment rewards but {n} segments")
    him = turn_rewards(modulate_segment_rewards(seg_rewards, importance, scale), seg_ids,
                       placement)
    return fused_rewards(him, grounded, alpha, step_kl, kl_coef)


def hisr_advantages(batch: list[dict], *, beta: float = 0.3, alpha: float = 0.3,
                    gamma: float = 0.99, lam: float = 0.95, placement: str = "end",
                    scale: str = "unit", use_hindsight: bool = True, kl_coef: float = 0.01,
                    normalize: bool = True) -> tuple[list[Tensor], list[Tensor]]:
    """The whole batch. batch[i] = {"seg_ids" (m,) int64, "seg_rewards" (n,), "hind_logp",
    "policy_logp", "mask" (m, L) each, "grounded" (m,), "values" (m,), optional "step_kl" (m,)}.
    Per trajectory: l = action_log_importance (Eqs. 5-6), r = hisr_rewards (Eqs. 7-8; the KL
    term only when "step_kl" is there), A, G = gae(r, values). With normalize, the advantages are
    whitened pooled over the batch and split back. Returns (advantages, un-whitened returns), one
    (m_i,) float64 tensor each, in input order."""
    advantages, returns = [], []
    for traj in batch:
        m = len(traj["seg_ids"])
        if traj["hind_logp"].shape[0] != m or len(traj["values"]) != m:
            raise ValueError(f"{m} turns but {traj['hind_logp'].shape[0]} token rows and "
                             f"{len(traj['values'])} values")
        log_z = action_log_importance(traj["hind_logp"], traj["policy_logp"], traj["mask"], beta)
        rewards = hisr_rewards(traj["seg_rewards"], log_z, traj["seg_ids"], traj["grounded"],
                               alpha, placement, scale, use_hindsight, traj.get("step_kl"),
                               kl_coef)
        adv, ret = gae(rewards, torch.as_tensor(traj["values"]), gamma, lam)
        advantages.append(adv)
        returns.append(ret)
    if normalize:
        advantages = whiten_pooled(advantages)
    return advantages, returns


def summarize(traj: dict) -> dict:
    """What advantages and logged stats read of a trajectory: no token ids, cheap to gather."""
    keys = ("state", "next_state", "valid", "well_formed", "parsed", "value", "step_kl",
            "old_logprobs", "hind_logprobs")
    steps = [{k: s[k] for k in keys if k in s} for s in traj["steps"]]
    traj_keys = ("task_type", "group", "won", "rewards", "seg_ids", "seg_rewards")
    return {**{k: traj[k] for k in traj_keys if k in traj}, "steps": steps}


def advantage_inputs(traj: dict, grounding_form: str) -> dict:
    """A trajectory summary as one entry of hisr_advantages' batch: token rows padded, the
    grounding flags as the terms of grounding_form."""
    steps = traj["steps"]
    width = max(len(s["old_logprobs"]) for s in steps)
    return {"seg_ids": torch.tensor(traj["seg_ids"], dtype=torch.int64),
            "seg_rewards": torch.tensor(traj["seg_rewards"], dtype=torch.float64),
            "hind_logp": pad_rows([s["hind_logprobs"].double() for s in steps], width),
            "policy_logp": pad_rows([s["old_logprobs"].double() for s in steps], width),
            "mask": pad_rows([torch.ones(len(s["old_logprobs"])) for s in steps], width),
            "grounded": grounding_terms([float(s["valid"]) for s in steps], grounding_form),
            "values": torch.tensor([s["value"] for s in steps], dtype=torch.float64),
            "step_kl": torch.tensor([s["step_kl"] for s in steps], dtype=torch.float64)}


def compute_advantages(args: Args, summaries: list[dict]) -> tuple[list, list]:
    """(advantages, returns) per step of every trajectory of a batch (summaries with the segment
    ids and rewards, and per step "old_logprobs", "hind_logprobs", "valid", "value", "step_kl"):
    HISR's fused reward with the --grounding-form term, or with --advantage ppo GAE over the
    sparse outcome minus the KL penalty."""
    if args.advantage == "ppo":
        advantages, returns = [], []
        for t in summaries:
            step_kl = torch.tensor([s["step_kl"] for s in t["steps"]], dtype=torch.float64)
            rewards = torch.tensor(t["rewards"], dtype=torch.float64) - args.kl_coef * step_kl
            values = torch.tensor([s["value"] for s in t["steps"]], dtype=torch.float64)
            adv, ret = gae(rewards, values, args.gamma, args.gae_lambda)
            advantages.append(adv)
            returns.append(ret)
        if args.normalize_advantages:
            advantages = whiten_pooled(advantages)
        return advantages, returns
    batch = [advantage_inputs(t, args.grounding_form) for t in summaries]
    return hisr_advantages(batch, beta=args.importance_beta, alpha=args.grounding_weight,
                           gamma=args.gamma, lam=args.gae_lambda, scale=args.him_scale,
                           use_hindsight=args.use_hindsight, kl_coef=args.kl_coef,
                           normalize=args.normalize_advantages)


# ---- 2. Segments, the segmental reward model and the hindsight model (Eqs. 2-5) ----------------
MILESTONE_RE = re.compile(r"\s*you (pick up|move|put|clean|heat|cool|turn on)\b", re.IGNORECASE)
# The six goal templates (ALFWorld's, which the household copies): the word after these is the
# object the task is about.
GOAL_OBJECT_RE = re.compile(r"(?:put (?:a|an|some|two) (?:(?:clean|hot|cool) )?"
                            r"|(?:clean|heat|cool) some |find two |look at |examine the )(\w+)",
                            re.IGNORECASE)


def goal_object(goal: str) -> str | None:
    """The lower-cased object word of a goal sentence, None if no template matches:
    "put a hot egg in garbagecan." -> "egg"; "examine the vase with the desklamp." -> "vase"."""
    found = GOAL_OBJECT_RE.search(goal)
    return found.group(1).lower() if found else None


def segment_ids_from_events(feedback: list[str], target: str | None = None) -> Tensor:
    """(m,) int64 segment id per turn, from the environment's events (the paper's GPT-4o
    segmentation replaced by a rule). feedback[k] = the observation action k got. Turn k < m - 1
    ends a segment when feedback[k] is a milestone (MILESTONE_RE: pick up, move, put, clean,
    heat, cool, turn on) or, with a target, is the first feedback naming "<target> <number>"; the
    last turn closes the last segment. [] -> empty."""
    sighting = re.compile(rf"\b{re.escape(target)} \d+", re.IGNORECASE) if target else None
    ids, current, seen = [], 0, False
    for k, text in enumerate(feedback):
        ids.append(current)
        event = MILESTONE_RE.match(text) is not None
        if sighting is not None and not seen and sighting.search(text):
            seen, event = True, True
        if event and k < len(feedback) - 1:
            current += 1
    return torch.tensor(ids, dtype=torch.int64)


class SegmentRewardHead(torch.nn.Module):
    """Eq. 2: r_i = W2 SiLU(W1 h_i), W1: H -> H and W2: H -> 1, no biases, float32. W2 starts at
    zero, so a new head predicts 0 for every segment."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.w1 = torch.nn.Linear(hidden_size, hidden_size, bias=False)
        self.w2 = torch.nn.Linear(hidden_size, 1, bias=False)
        torch.nn.init.zeros_(self.w2.weight)

    def forward(self, hidden: Tensor) -> Tensor:
        """(..., H) -> (...)"""
        return self.w2(torch.nn.functional.silu(self.w1(hidden.float()))).squeeze(-1)


def sprm_loss(seg_scores: list[Tensor], outcomes: Tensor) -> Tensor:
    """Eq. 3, mean over the batch: mean_i (R_i - sum of trajectory i's segment scores)^2.
    seg_scores[i]: (n_i,); outcomes: (B,). A scalar with the gradient of the scores; ValueError
    for a trajectory without segments or a length mismatch."""
    if len(seg_scores) != len(outcomes):
        raise ValueError(f"{len(seg_scores)} trajectories but {len(outcomes)} outcomes")
    if any(s.numel() == 0 for s in seg_scores):
        raise ValueError("a trajectory without segments has no scores to sum")
    predicted = torch.stack([s.sum() for s in seg_scores])
    return ((outcomes.to(predicted) - predicted) ** 2).mean()


def hindsight_loss(logp: Tensor, mask: Tensor) -> Tensor:
    """Eq. 4 reduced as SFT: -(logp * mask).sum() / mask.sum() over a batch's target tokens,
    logp and mask (B, L)."""
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


OBSERVATION = "Observation: {obs}"
# The hindsight model's request (our wording of the paper's cloze prompt): (instruction before the
# episode, the hidden reply's stand-in, the request after it). The tiny models' vocabulary lacks
# most of these words (they would read as [UNK]), so they get a wording made of words it knows.
CLOZE_TEXTS = {
    "real": ("The episode below is complete. One of the agent's replies is hidden as ___; knowing "
             "how the episode ended, write that reply.", "___",
             "The episode ended with reward {reward:.1f}. Write the hidden reply."),
    "tiny": ("", "?", "Your task: {reward:.1f}. Give exactly the reply at ?."),
}
CLOZE_ADMISSIBLE = "Admissible actions: {actions}"  # the policy's words (PROMPT_NOW)


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


def action_end_positions(assistant_mask: list[int]) -> list[int]:
    """Index of the last 1 in each maximal run of 1s: the token closing each reply.
    [0,0,1,1,0,0,1,1,1,0] -> [3, 8]; [] and all zeros -> []."""
    n = len(assistant_mask)
    return [j for j in range(n) if assistant_mask[j] and (j + 1 == n or not assistant_mask[j + 1])]


def trajectory_segments(args: Args, traj: dict) -> list[int]:
    """Segment id of every turn: --segmenter events (segment_ids_from_events on the feedback each
    action got, with the goal's object) or turns (one per turn: "w/o SPR")."""
    if args.segmenter == "turns":
        return list(range(len(traj["steps"])))
    feedback = [s["next_state"] for s in traj["steps"]]
    return segment_ids_from_events(feedback, goal_object(traj["task"])).tolist()


def first_message(traj: dict, instruction: str = "") -> dict:
    text = PROMPT_INTRO.format(task=traj["task"]) + "\n" + traj["steps"][0]["state"]
    return {"role": "user", "content": f"{instruction}\n{text}" if instruction else text}


def cloze_texts(args: Args) -> tuple[str, str, str]:
    return CLOZE_TEXTS["tiny" if args.model in TINY_NAMES else "real"]


def transcript_messages(traj: dict, tokenizer, first_turn: int = 0) -> list[dict]:
    """What the SPRM reads, as a chat: the task and first observation, then every reply (from
    turn first_turn on) and the observation it got; the trailing observation is dropped."""
    steps = traj["steps"]
    messages = [first_message(traj)]
    for k in range(first_turn, len(steps)):
        # stripped: some chat templates (Llama 3's) trim what they are given
        reply = tokenizer.decode(steps[k]["response_ids"], skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": reply})
        if k + 1 < len(steps):
            messages.append({"role": "user",
                             "content": OBSERVATION.format(obs=steps[k]["next_state"])})
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
                             "segment reward model needs them verbatim")
        closing = next((j for j, s in enumerate(starts) if s >= end), None)
        if closing is None:
            raise UsageError("this tokenizer's chat template does not close the agent's last "
                             "reply with a token; the segment reward model reads it there")
        for j in range(len(starts)):
            if begin <= starts[j] < end or j == closing:
                mask[j] = 1
    return encoded.input_ids, mask


def encode_transcript(args: Args, tokenizer, traj: dict) -> tuple[list[int], list[int], int]:
    """(ids, assistant mask, first turn shown) of a trajectory's transcript. Longer than
    --aux-max-tokens: the first message and the longest suffix of whole turns that fits."""
    for first_turn in range(len(traj["steps"])):
        ids, mask = encode_trajectory(tokenizer, transcript_messages(traj, tokenizer, first_turn))
        if len(ids) <= args.aux_max_tokens:
            return ids, mask, first_turn
    ids, mask = encode_trajectory(tokenizer, [first_message(traj)])  # not even the last turn fits
    return ids[:args.aux_max_tokens], mask[:args.aux_max_tokens], len(traj["steps"])


def segment_scores(sprm, head, sequences: list[tuple[list[int], list[int], list[int]]],
                   pad_id: int) -> list[Tensor]:
    """r_i = head(h_i) (Eq. 2) for each (ids, assistant mask, turns read): h_i is the final hidden
    state at the token closing reply `turns read[i]`, the last turn of segment i (causal
    attention: it sees the trajectory up to there). (n_i,) tensors, with the gradient of the
    trainable weights when enabled."""
    device = next(head.parameters()).device
    width = max(len(ids) for ids, _, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, (ids, _, _) in enumerate(sequences):  # right padding: positions 0.. of every row
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention[i, :len(ids)] = 1
    hidden = final_hidden_states(sprm, input_ids.to(device), attention.to(device))
    scores = []
    for i, (_, mask, turns) in enumerate(sequences):
        ends = action_end_positions(mask)
        scores.append(head(hidden[i, [ends[k] for k in turns]]))
    return scores


def cloze_messages(traj: dict, replies: list[str], k: int, shown: range,
                   texts: tuple[str, str, str] = CLOZE_TEXTS["real"]) -> list[dict]:
    """The hindsight model's input for turn k (Eq. 4): the instruction, the task and first
    observation, the turns in `shown` with their replies (decoded, stripped) and observations
    (the last one included) and reply k hidden, then the outcome and the request (texts: see
    CLOZE_TEXTS); the generation prompt follows. The message before the hidden reply ends with
    turn k's admissible actions (steps[k]["admissible"]), as the policy's prompt listed them."""
    instruction, hidden, ask = texts
    steps = traj["steps"]
    messages = [first_message(traj, instruction)]
    for t in shown:
        if t == k:
            actions = CLOZE_ADMISSIBLE.format(actions=", ".join(steps[k]["admissible"]))
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n" + actions}
        messages.append({"role": "assistant", "content": hidden if t == k else replies[t]})
        observation = OBSERVATION.format(obs=steps[t]["next_state"])
        messages.append({"role": "user", "content": observation})
    messages.append({"role": "user", "content": ask.format(reward=float(traj["won"]))})
    return messages


def encode_cloze(args: Args, tokenizer, traj: dict, replies: list[str],
                 k: int) -> tuple[list[int], bool]:
    """(prompt ids, whether turns were dropped) of turn k's cloze input. Too long for
    --aux-max-tokens with its reply: whole turns farthest from k go first, alternately after and
    before it."""
    m, target = len(traj["steps"]), len(traj["steps"][k]["response_ids"])
    low, high, after = 0, m - 1, True
    while True:
        messages = cloze_messages(traj, replies, k, range(low, high + 1), cloze_texts(args))
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) + target <= args.aux_max_tokens or low == high == k:
            return ids, (low, high) != (0, m - 1)
        if (after and high > k) or low == k:
            high -= 1
        else:
            low += 1
        after = not after


def collect(args: Args, policy: Policy, tasks: list) -> list[dict]:
    """D_ct: the start policy plays every task --collect-rollouts times at
    --collect-temperature, in chunks of one RL batch's size (games in lock-step)."""
    copies = [t for t in tasks for _ in range(args.collect_rollouts)]
    groups = [g for g in range(len(tasks)) for _ in range(args.collect_rollouts)]
    chunk = args.tasks_per_iteration * args.group_size
    progress = Progress(len(copies), "collect")
    trajs: list[dict] = []
    for start in range(0, len(copies), chunk):
        trajs += rollout(args, policy.tokenizer, policy, copies[start:start + chunk],
                         groups[start:start + chunk], args.collect_temperature)
        progress.update(len(copies[start:start + chunk]),
                        success=float(np.mean([t["won"] for t in trajs])))
    progress.close()
    return trajs


REPEATED_TEXT_RE = re.compile(r"(\w.{2,199}?)(?:\W*\1){2}", re.DOTALL)


def repeats_itself(reply: str) -> bool:
    """Whether a reply degenerates (REPEATED_TEXT_RE, white space collapsed): a piece of 3-200
    characters, starting with a letter or digit, said 3 times in a row with nothing but
    punctuation or spaces between. "go to desk 1, go to desk 1, go to desk 1" -> True;
    "<action>go to desk 1</action>" -> False."""
    return REPEATED_TEXT_RE.search(" ".join(reply.split())) is not None


def keep_for_training(traj: dict, replies: list[str]) -> bool:
    """The collection filter (the paper's "format errors or repetition"; loops are kept): every
    reply well formed (an action) and none repeating itself (replies: decoded, in turn order)."""
    steps = traj["steps"]
    return all(s["well_formed"] for s in steps) and not any(repeats_itself(r) for r in replies)


def split_heldout(trajs: list[dict], share: float, rng: random.Random) -> tuple[list, list]:
    """(train, held-out) indices; whole tasks are held out, `share` of them."""
    tasks = sorted({t["group"] for t in trajs})
    rng.shuffle(tasks)
    heldout_tasks = set(tasks[:int(len(tasks) * share)])
    heldout = [i for i, t in enumerate(trajs) if t["group"] in heldout_tasks]
    return [i for i, t in enumerate(trajs) if t["group"] not in heldout_tasks], heldout


def outcome_auc(predicted: Tensor, won: Tensor) -> float:
    """How well predicted outcomes (B,) separate wins from losses (B,) bool: the share of (won,
    lost) pairs where the won one is predicted higher, ties half; nan without both outcomes.
    [0.9, 0.2, 0.5] with won [True, False, False] -> 1.0."""
    wins, losses = predicted[won.bool()].double(), predicted[~won.bool()].double()
    if len(wins) == 0 or len(losses) == 0:
        return float("nan")
    diff = wins[:, None] - losses[None, :]
    return ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()


def clipped_step(args: Args, optimizer, params: list[Tensor], loss: float, where: str) -> None:
    """A reward model's optimizer step: gradient-norm clip, stop on a non-finite loss or norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
    check_finite(where, loss=loss, grad_norm=grad_norm.item())
    optimizer.step()


def freeze(*modules) -> None:
    for module in modules:
        module.eval()
        module.requires_grad_(False)


def train_sprm(args: Args, sprm, head, tokenizer, trajs: list[dict], train: list[int],
               heldout: list[int], rng: random.Random) -> dict:
    """Eq. 3 over the trajectories `train` (the kept ones of the training tasks), --sprm-epochs
    epochs of --sprm-batch-size trajectories (micro-batches of --micro-batch-size); the `heldout`
    ones (every collected rollout of the held-out tasks, as RL sees them) report the fit: MSE
    beside a constant predictor's, and the AUC of the predicted outcome for won against lost. A
    transcript longer than --aux-max-tokens is left out (counted). Trains in place, freezes."""
    encoded = {}
    for i in train + heldout:
        ids, mask, first_turn = encode_transcript(args, tokenizer, trajs[i])
        if first_turn == 0 and len(ids) <= args.aux_max_tokens:
            encoded[i] = (ids, mask, segment_ends(torch.tensor(trajs[i]["seg_ids"])).tolist())
    too_long = len(train) + len(heldout) - len(encoded)
    heldout_too_long = sum(i not in encoded for i in heldout)  # long failures, mostly: counted
    train = [i for i in train if i in encoded]
    heldout = [i for i in heldout if i in encoded]
    if not train:
        raise UsageError(f"no collected trajectory fits --aux-max-tokens {args.aux_max_tokens}; "
                         "raise it")
    outcomes = torch.tensor([float(t["won"]) for t in trajs])
    params = [p for p in sprm.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.sprm_learning_rate, weight_decay=0.0)
    per_epoch = math.ceil(len(train) / args.sprm_batch_size)
    sprm.train()
    progress = Progress(args.sprm_epochs * per_epoch, "sprm")
    losses: list[float] = []
    for _ in range(args.sprm_epochs):
        rng.shuffle(train)
        for start in range(0, len(train), args.sprm_batch_size):
            batch = train[start:start + args.sprm_batch_size]
            optimizer.zero_grad(set_to_none=True)
            batch_loss = 0.0
            for k in range(0, len(batch), args.micro_batch_size):
                micro = batch[k:k + args.micro_batch_size]
                scores = segment_scores(sprm, head, [encoded[i] for i in micro],
                                        tokenizer.pad_token_id)
                # Eq. 3's batch mean, in micro-batches
                share = sprm_loss(scores, outcomes[micro]) * (len(micro) / len(batch))
                share.backward()
                batch_loss += share.item()
            clipped_step(args, optimizer, params, batch_loss,
                         f"segment reward model, update {progress.count + 1}")
            losses.append(batch_loss)
            progress.update(1, loss=float(np.mean(losses[-per_epoch:])))
    progress.close()
    freeze(sprm, head)
    stats = {"sprm/train_loss": float(np.mean(losses[-per_epoch:])),
             "sprm/trajectories": len(train), "sprm/skipped_too_long": too_long,
             "sprm/heldout_skipped_too_long": heldout_too_long}
    if heldout:
        with torch.no_grad():
            scores = [s for k in range(0, len(heldout), args.sprm_batch_size)
                      for s in segment_scores(sprm, head, [encoded[i] for i in
                                                           heldout[k:k + args.sprm_batch_size]],
                                              tokenizer.pad_token_id)]
        constant = torch.full((len(heldout),), outcomes[train].mean().item())
        stats["sprm/heldout_mse"] = sprm_loss(scores, outcomes[heldout]).item()
        stats["sprm/heldout_mse_of_constant"] = ((constant - outcomes[heldout]) ** 2).mean().item()
        stats["sprm/heldout_auc"] = outcome_auc(torch.stack([s.sum() for s in scores]),
                                                outcomes[heldout] > 0.5)
    return stats


class ClozeSample(NamedTuple):
    """One turn as the hindsight model reads it (Eq. 4)."""
    cloze: list[int]  # the cloze input's token ids: the episode with this reply hidden
    reply: list[int]  # the hidden reply's token ids, the target
    step_prompt: list[int]  # the prompt the policy sampled the reply from
    cut: bool  # whether turns were dropped for the cloze input to fit


def cloze_samples(args: Args, tokenizer, trajs: list[dict],
                  indices: list[int]) -> list[ClozeSample]:
    """A ClozeSample for every turn of the given trajectories."""
    samples = []
    for i in indices:
        steps = trajs[i]["steps"]
        replies = [r.strip() for r in tokenizer.batch_decode([s["response_ids"] for s in steps],
                                                             skip_special_tokens=True)]
        for k, step in enumerate(steps):
            ids, cut = encode_cloze(args, tokenizer, trajs[i], replies, k)
            samples.append(ClozeSample(ids, step["response_ids"], step["prompt"], cut))
    return samples


def train_hindsight(args: Args, hindsight, start_model, tokenizer, trajs: list[dict],
                    train: list[int], heldout: list[int], rng: random.Random) -> dict:
    """Eq. 4 on the masked-reply cloze of every turn of the kept collected trajectories,
    --hindsight-epochs epochs of --hindsight-batch-size replies (the token-mean loss of each
    batch), then frozen. Reports the held-out replies' NLL under the hindsight model beside the
    start policy's on the step prompt they were sampled from (the hindsight model should be
    lower)."""
    samples = cloze_samples(args, tokenizer, trajs, train)
    pad = tokenizer.pad_token_id
    lengths = [len(s.cloze) + len(s.reply) for s in samples]
    params = [p for p in hindsight.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.hindsight_learning_rate, weight_decay=0.0)
    order = list(range(len(samples)))
    per_epoch = math.ceil(len(samples) / args.hindsight_batch_size)
    hindsight.train()
    progress = Progress(args.hindsight_epochs * per_epoch, "hindsight")
    losses: list[float] = []
    for _ in range(args.hindsight_epochs):
        rng.shuffle(order)
        for start in range(0, len(order), args.hindsight_batch_size):
            batch = order[start:start + args.hindsight_batch_size]
            n_tokens = sum(len(samples[i].reply) for i in batch)
            optimizer.zero_grad(set_to_none=True)
            batch_loss = 0.0
            for idx in length_sorted_chunks(batch, lengths, args.micro_batch_size):
                logp, mask, _ = response_logprobs(hindsight, [samples[i].cloze for i in idx],
                                                  [samples[i].reply for i in idx], pad)
                # the token mean of the whole batch (Eq. 4), in micro-batches
                share = hindsight_loss(logp, mask) * mask.sum() / n_tokens
                share.backward()
                batch_loss += share.item()
            clipped_step(args, optimizer, params, batch_loss,
                         f"hindsight model, update {progress.count + 1}")
            losses.append(batch_loss)
            progress.update(1, loss=float(np.mean(losses[-per_epoch:])))
    progress.close()
    freeze(hindsight)
    stats = {"hindsight/train_loss": float(np.mean(losses[-per_epoch:])),
             "hindsight/replies": len(samples),
             "hindsight/inputs_cut": sum(s.cut for s in samples)}
    held = cloze_samples(args, tokenizer, trajs, heldout)
    if held:
        nll = {"hindsight": 0.0, "start_policy": 0.0}
        held_lengths = [len(s.cloze) + len(s.reply) for s in held]
        with torch.no_grad():
            for idx in length_sorted_chunks(list(range(len(held))), held_lengths,
                                            args.micro_batch_size):
                for name, model, field in (("hindsight", hindsight, "cloze"),
                                           ("start_policy", start_model, "step_prompt")):
                    inputs = [getattr(held[i], field) for i in idx]
                    logp, mask, _ = response_logprobs(model, inputs,
                                                      [held[i].reply for i in idx], pad)
                    nll[name] -= (logp * mask).sum().item()
        n_tokens = sum(len(s.reply) for s in held)
        stats.update({f"hindsight/heldout_nll_{k}": v / n_tokens for k, v in nll.items()})
    return stats


def score_segments(args: Args, sprm, head, tokenizer, trajs: list[dict]) -> int:
    """Writes "seg_ids" and "seg_rewards" (r^_i of the frozen SPRM, Eq. 2) into every
    trajectory. A transcript longer than --aux-max-tokens is read from the longest suffix of
    whole turns that fits; segments ending before it get 0. Returns how many were cut."""
    transcripts, unread, cut = [], [], 0
    for t in trajs:
        t["seg_ids"] = trajectory_segments(args, t)
        ends = segment_ends(torch.tensor(t["seg_ids"])).tolist()
        ids, mask, first_turn = encode_transcript(args, tokenizer, t)
        cut += first_turn > 0
        readable = [e - first_turn for e in ends if e >= first_turn]
        transcripts.append((ids, mask, readable))  # what segment_scores reads
        unread.append(len(ends) - len(readable))  # segments that end before the suffix read
    lengths = [len(ids) for ids, _, _ in transcripts]
    with torch.no_grad():
        for idx in length_sorted_chunks(list(range(len(trajs))), lengths, args.sprm_batch_size):
            scores = segment_scores(sprm, head, [transcripts[i] for i in idx],
                                    tokenizer.pad_token_id)
            for i, r in zip(idx, scores):
                trajs[i]["seg_rewards"] = [0.0] * unread[i] + r.tolist()
    return cut


def score_hindsight(args: Args, hindsight, tokenizer, trajs: list[dict]) -> int:
    """Writes "hind_logprobs", log pi_hind of every reply token given its cloze input (Eq. 5's
    numerator), into every step. Returns how many cloze inputs were cut to fit."""
    steps = [s for t in trajs for s in t["steps"]]
    samples = cloze_samples(args, tokenizer, trajs, list(range(len(trajs))))
    logp = scored_logprobs(hindsight, [s.cloze for s in samples], [s.reply for s in samples],
                           tokenizer.pad_token_id, args.micro_batch_size)
    for step, row in zip(steps, logp, strict=True):
        step["hind_logprobs"] = row.cpu()
    return sum(s.cut for s in samples)


def auxiliary_copy(start_model):
    """A copy of the start policy to train into the SPRM or the hindsight model, in float32 (the
    paper's learning rates of 1e-6 would round away in bf16 weights), every weight trainable."""
    return copy.deepcopy(start_model).float().requires_grad_(True)


def train_reward_models(args: Args, start_model, tokenizer, collected: list[dict]) -> tuple:
    """(SPRM, head, hindsight model, statistics) trained on the collection (Eqs. 2-4), frozen.
    Writes "seg_ids" into every trajectory; whole tasks are held out (split_heldout), every
    rollout of them, filtered or not, as RL will see them; the rest of the kept trajectories
    (keep_for_training) train the SPRM and then the hindsight model, each on a copy of the
    start (auxiliary_copy). w/o HIM (--no-use-hindsight) trains no hindsight model: None."""
    for t in collected:
        t["seg_ids"] = trajectory_segments(args, t)
    replies = [tokenizer.batch_decode([s["response_ids"] for s in t["steps"]],
                                      skip_special_tokens=True) for t in collected]
    kept = [args.collect_filter == "none" or keep_for_training(t, r)
            for t, r in zip(collected, replies)]
    tasks_train, heldout = split_heldout(collected, args.aux_heldout,
                                         random.Random(args.seed + 3))
    train = [i for i in tasks_train if kept[i]]
    if not train:
        raise UsageError(f"the collection filter (--collect-filter {args.collect_filter}) left "
                         f"none of the {len(tasks_train)} collected trajectories of the training "
                         "tasks; raise --collect-num-tasks or --collect-rollouts")
    stats = {"collect/success": float(np.mean([t["won"] for t in collected])),
             "collect/kept": sum(kept),
             "collect/kept_share": float(np.mean(kept)),
             "collect/kept_success": float(np.mean(
                 [t["won"] for t, k in zip(collected, kept) if k])),
             "collect/segments_per_trajectory": float(np.mean(
                 [max(t["seg_ids"]) + 1 for t in collected])),
             "aux/trained_on": len(train), "aux/heldout": len(heldout)}
    device = next(start_model.parameters()).device
    sprm = auxiliary_copy(start_model)
    head = SegmentRewardHead(start_model.config.hidden_size).to(device)
    stats.update(train_sprm(args, sprm, head, tokenizer, collected, train, heldout,
                            random.Random(args.seed + 4)))
    hindsight = None
    if args.use_hindsight:
        hindsight = auxiliary_copy(start_model)
        stats.update(train_hindsight(args, hindsight, start_model, tokenizer, collected, train,
                                     heldout, random.Random(args.seed + 5)))
    return sprm, head, hindsight, stats


# What the reward models' inputs and data depend on: a run that loads them must read alike.
READING = ("segmenter", "collect_filter")


def save_reward_models(path: str, sprm, head, hindsight, args: Args) -> None:
    """The trained SPRM (model.pt and head.pt) and hindsight model (model.pt, unless None) under
    path/, with reading.json: the settings of READING they were trained with."""
    for name, model in (("sprm", sprm), ("hindsight", hindsight)):
        if model is not None:
            os.makedirs(os.path.join(path, name), exist_ok=True)
            torch.save(model.state_dict(), os.path.join(path, name, "model.pt"))
    torch.save(head.state_dict(), os.path.join(path, "sprm", "head.pt"))
    with open(os.path.join(path, "reading.json"), "w") as f:
        json.dump({name: getattr(args, name) for name in READING}, f, indent=1)


def load_reward_models(args: Args, start_model, path: str):
    """(SPRM, head, hindsight model or None w/o HIM), frozen, from a directory save_reward_models
    wrote; refused when trained with other settings of READING than args, or with a reading
    removed since (no admissible actions in the cloze: docs/hisr.md, "Readings removed")."""
    found = os.path.join(path, "sprm", "head.pt")
    reading = os.path.join(path, "reading.json")
    names = ["sprm", "hindsight"] if args.use_hindsight else ["sprm"]
    needed = [found, reading] + [os.path.join(path, name, "model.pt") for name in names]
    missing = [p for p in needed if not os.path.isfile(p)]
    if missing:
        raise UsageError(f"--reward-models {path}: {', '.join(missing)} missing (not hisr.py's "
                         "reward_models/, one trained with --no-use-hindsight, or one saved by "
                         "an older hisr.py?)")
    with open(reading) as f:
        trained = json.load(f)
    differ = [f"--{n.replace('_', '-')} {trained.get(n)!r} (this run: {getattr(args, n)!r})"
              for n in READING if trained.get(n) != getattr(args, n)]
    if trained.get("hindsight_admissible", True) is not True:  # a reading removed since
        differ.append("--no-hindsight-admissible (removed; docs/hisr.md, \"Readings removed\")")
    if differ:
        raise UsageError(f"--reward-models {path} were trained with " + ", ".join(differ))
    damaged = seal_errors(path)
    if damaged:
        raise UsageError(f"{path} is not as saved ({'; '.join(damaged)})")
    models = []
    device = next(start_model.parameters()).device
    head = SegmentRewardHead(start_model.config.hidden_size).to(device)
    try:  # a file truncated or from another model: one line naming it
        for name in names:
            model = copy.deepcopy(start_model).float()
            model.load_state_dict(torch.load(os.path.join(path, name, "model.pt"),
                                             map_location="cpu"))
            models.append(model)
        head.load_state_dict(torch.load(found, map_location="cpu"))
    except Exception as e:
        message = f"--reward-models {path}: cannot be loaded ({error_line(e)})"
        raise UsageError(message) from None
    freeze(head, *models)
    hindsight = models[1] if args.use_hindsight else None
    return models[0], head, hindsight


def reward_models_stage(args: Args, run: Run, policy: Policy, start_model,
                        train_tasks: list) -> tuple:
    """(SPRM, head, hindsight model), frozen, for RL; None each with --advantage ppo. With
    --resume or --reward-models, those saved (load_reward_models); else the policy, whose new
    adapter is zero (the start policy), plays --collect-num-tasks training tasks (collect), the
    reward models train on them from copies of start_model (train_reward_models), their
    statistics are logged at iteration 0, and they are saved as the run's reward_models/."""
    if args.advantage != "hisr":
        return None, None, None
    path = os.path.join(run.path, "reward_models")
    if args.resume or args.reward_models:
        return load_reward_models(args, start_model, args.reward_models or path)
    t0 = time.time()
    n_collect = min(args.collect_num_tasks or len(train_tasks), len(train_tasks))
    tasks = random.Random(args.seed + 2).sample(train_tasks, n_collect)
    policy.sync(run.path)
    collected = collect(args, policy, tasks)
    sprm, head, hindsight, stats = train_reward_models(args, start_model, policy.tokenizer,
                                                       collected)
    stats["aux/seconds"] = time.time() - t0
    print(f"reward models done in {stats['aux/seconds']:.0f}s: collection success "
          f"{stats['collect/success']:.3f}, kept {stats['collect/kept']} of {len(collected)} "
          f"(success {stats['collect/kept_success']:.3f}), "
          f"{stats['collect/segments_per_trajectory']:.2f} segments per trajectory")
    if "sprm/heldout_mse" in stats:
        print(f"  held out ({stats['aux/heldout']} rollouts, unfiltered; "
              f"{stats['sprm/heldout_skipped_too_long']} too long for the SPRM): SPRM AUC "
              f"{stats['sprm/heldout_auc']:.3f}, MSE {stats['sprm/heldout_mse']:.4f} "
              f"(a constant: {stats['sprm/heldout_mse_of_constant']:.4f})")
    if "hindsight/heldout_nll_hindsight" in stats:
        print(f"  held out: hindsight NLL per token "
              f"{stats['hindsight/heldout_nll_hindsight']:.4f} (the policy: "
              f"{stats['hindsight/heldout_nll_start_policy']:.4f})")
    run.log(stats, 0)
    save_part(path, lambda folder: save_reward_models(folder, sprm, head, hindsight, args),
              reuse="--reward-models")
    return sprm, head, hindsight


def score_reward_models(args: Args, sprm, head, hindsight, tokenizer, trajs: list[dict]) -> dict:
    """RL's reading of the frozen reward models, written into every trajectory: the segments and
    their SPRM rewards (score_segments, Eq. 2), the hindsight log-probs (score_hindsight, Eq. 5's
    numerator; w/o HIM log pi_hind = log pi_old, z = 1). Nothing with --advantage ppo (sprm
    None). Returns how many inputs of each this process cut to fit, under the names the log
    shows them; each pass timed under its name."""
    cut = {"credit/sprm_inputs_cut": 0, "credit/hindsight_inputs_cut": 0}
    if sprm is None:
        return cut
    with timer("sprm"):
        cut["credit/sprm_inputs_cut"] = score_segments(args, sprm, head, tokenizer, trajs)
    if hindsight is None:  # w/o HIM
        for traj in trajs:
            for step in traj["steps"]:
                step["hind_logprobs"] = step["old_logprobs"]
        return cut
    with timer("hindsight"):
        cut["credit/hindsight_inputs_cut"] = score_hindsight(args, hindsight, tokenizer, trajs)
    return cut


# ---- 3. Policy and value loss (Eq. 9) -----------------------------------------------------------
def policy_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """(B, L) -> (B, L) pi / pi_old per token; 1 where masked (masked first: no overflow)."""
    return torch.exp(torch.where(mask.bool(), logp - old_logp, torch.zeros_like(logp)))


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                  clip_eps: float = 0.2, entropy: Tensor | None = None,
                  entropy_coef: float = 0.0, clip_ratio_c: float | None = None) -> Tensor:
    """The negated clipped surrogate (Eq. 9) - entropy bonus, token-mean over mask.

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
    """HISR (and the PPO baseline on the sparse outcome) for multi-turn LLM agents."""

    exp_name: str = "hisr"  # runs/<exp-name>__<env>__<advantage>__<seed>__<time>
    seed: int = 1  # seeds python, numpy, torch and the evaluations' own generator
    # household (built in) or alfworld (needs $ALFWORLD_DATA; docs/environments.md)
    env: Literal["household", "alfworld"] = "household"
    # local dir, hub id or Qwen name; tiny, tiny-weak, tiny-alfworld (ALFWorld), tiny-scratch (BC)
    model: str = "tiny"
    # rollout generation: transformers generate, its continuous batching, or vLLM (GPU)
    backend: Literal["hf", "hf-cb", "vllm"] = "hf"

    # Reward: hisr, GAE over Eqs. 5-8's rewards; or the baseline ppo, GAE over the sparse
    # outcome with no reward models
    advantage: Literal["hisr", "ppo"] = "hisr"
    segmenter: Literal["events", "turns"] = "events"  # cut at milestone events, or turns (w/o SPR)
    use_hindsight: bool = True  # hindsight importance z (Eqs. 5-7); off: z = 1, w/o HIM
    importance_beta: float = 0.3  # beta of Eq. 6: z = exp(mean token log-ratio / beta)
    grounding_weight: float = 0.3  # alpha of Eq. 8, the grounding term's weight; 0: w/o AGR
    # sprm: Eq. 7 times the SPRM's L1 mass; unit: Eq. 7 as written (mass 1 per trajectory)
    him_scale: Literal["sprm", "unit"] = "sprm"
    # cost: alpha * (g_t - 1); eq8: alpha * g_t as written (online, pays for length)
    grounding_form: Literal["cost", "eq8"] = "cost"
    gamma: float = 0.99  # discount of GAE
    gae_lambda: float = 0.95  # lambda of GAE
    normalize_advantages: bool = True  # whiten advantages over the batch (population variance)
    kl_coef: float = 0.01  # per-step KL to the reference, subtracted from the reward; 0 skips it
    vf_coef: float = 0.1  # weight of the value loss beside the policy loss
    value_clip: float = 0.2  # the value loss clips V to V_old +- this (V_old: before the update)
    value_learning_rate: float = 5e-3  # AdamW rate of the value head (the LoRA's: --learning-rate)

    # Collection and the reward models (Eqs. 2-4)
    collect_num_tasks: int = 48  # training tasks the start policy plays to collect D_ct; 0: all
    collect_rollouts: int = 4  # N, rollouts per collected task
    collect_temperature: float = 0.7  # sampling temperature of collection (the paper's)
    # the reward models' data: trajectories whose replies are all well formed, or all of them
    collect_filter: Literal["well-formed", "none"] = "well-formed"
    reward_models: str | None = None  # a run's reward_models/: skips collection and their training
    sprm_epochs: int = 3  # epochs of SPRM training
    sprm_learning_rate: float = 1e-3  # AdamW learning rate of the SPRM and its head
    sprm_batch_size: int = 16  # trajectories per SPRM update (the paper's)
    hindsight_epochs: int = 1  # epochs of hindsight-model training (the paper's)
    hindsight_learning_rate: float = 1e-3  # AdamW learning rate of the hindsight model
    hindsight_batch_size: int = 16  # masked replies per hindsight update (micro-batched)
    aux_max_tokens: int = 2048  # longest transcript or cloze input the reward models read
    aux_heldout: float = 0.1  # share of collected tasks held out, unfiltered, to report the fit

    # RL
    iterations: int = 8  # training iterations; 0 = BC, collection, reward models, start evaluation
    tasks_per_iteration: int = 4  # training tasks per iteration, each played --group-size times
    group_size: int = 8  # N trajectories per task (HISR needs no groups)
    max_episode_steps: int = 30  # step limit of a game
    learning_rate: float = 5e-4  # AdamW learning rate of the LoRA weights
    weight_decay: float = 0.0  # AdamW weight decay of the RL update
    clip_eps: float = 0.2  # PPO clip range epsilon of the ratio (Eq. 9)
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
    lora_r: int = 16  # LoRA rank of the RL adapter (and of BC without --bc-full-params)
    lora_alpha: int = 32  # LoRA alpha (the update is scaled by alpha / r)
    lora_dropout: float = 0.0  # dropout on the LoRA input
    lora_target_modules: str = "all-linear"  # comma-separated module names, or all-linear

    # Behavior cloning on expert trajectories (HISR's first stage)
    bc_epochs: int = 0  # epochs of behavior cloning before collection; 0 skips it
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
    eval_temperature: float = 0.4  # sampling temperature of evaluation (HISR's paper: 0, greedy)
    eval_top_p: float = 1.0  # nucleus sampling of evaluation (1: off; training never truncates)
    save_every: int = 2  # iterations between checkpoints (the last iteration is always saved)


# The defaults above are the tiny models' (--model tiny, tiny-weak). --model picks one row of
# PRESETS on top of them: tiny-scratch and tiny-alfworld their own, any other model "real" (a
# "baseline" row, where a script has one, follows for another --advantage). The harness's own
# fields (device, max_prompt_tokens, ...) are HarnessArgs', in common/config.py.
PRESETS = {
    "tiny-scratch": dict(bc_epochs=3),
    "tiny-alfworld": dict(max_episode_steps=50, eval_splits=("valid_unseen",), eval_num_tasks=0,
                          collect_num_tasks=10, collect_rollouts=10, aux_max_tokens=4096),
    "real": dict(iterations=100, tasks_per_iteration=16, group_size=1, max_episode_steps=40,
                 learning_rate=1e-5, micro_batch_size=8, gradient_checkpointing=True,
                 max_new_tokens=512, max_prompt_tokens=4096, history_length=40, reasoning=True,
                 bc_epochs=3, bc_full_params=False, bc_prompt_loss_weight=0.0,
                 bc_learning_rate=1e-4, bc_batch_size=16, eval_every=5, eval_num_tasks=0,
                 ppo_epochs=4, minibatch_size=64, lora_r=8, lora_alpha=16, collect_num_tasks=400,
                 collect_rollouts=10, sprm_epochs=1, sprm_learning_rate=2e-6,
                 hindsight_learning_rate=1e-6, hindsight_batch_size=192, aux_max_tokens=8192,
                 value_learning_rate=1e-4),
}
RANGES = {  # the method's flags; common/config.py's RANGES: the harness's
    "importance_beta": "> 0", "grounding_weight": "in [0, 1] (Eq. 8 mixes (1 - alpha) and alpha)",
    "gamma": "in (0, 1]", "gae_lambda": "in [0, 1]", "vf_coef": ">= 0", "value_clip": "> 0",
    "value_learning_rate": "> 0", "collect_num_tasks": ">= 0 (0 = every training task)",
    "collect_rollouts": ">= 1", "collect_temperature": "> 0", "sprm_epochs": ">= 1",
    "sprm_learning_rate": "> 0", "sprm_batch_size": ">= 1", "hindsight_epochs": ">= 1",
    "hindsight_learning_rate": "> 0", "hindsight_batch_size": ">= 1", "aux_max_tokens": ">= 64",
    "aux_heldout": "in [0, 1)",
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
        (a.reward_models is None or os.path.isdir(a.reward_models),
         f"--reward-models {a.reward_models}: no such directory"),
        (a.reward_models is None or a.advantage == "hisr",
         "--reward-models is read by --advantage hisr only"),
    ]
    return config.errors(a, RANGES) + [message for ok, message in rules if not ok]


def preset_args(model: str = "tiny", env: str = "household", advantage: str | None = None) -> Args:
    return config.preset_args(Args, PRESETS, model, env, advantage)


def parse_args(argv: list[str]) -> Args:
    return config.parse_args(Args, PRESETS, argv)


def main(args: Args) -> dict:
    one_process = []  # what several processes cannot do
    if args.advantage == "hisr" and args.reward_models is None and not args.resume:
        one_process.append("collection and the reward models' training run in one process: run "
                           "`python hisr.py ... --iterations 0` once, then launch RL with "
                           "--reward-models <its run>/reward_models")
    # What the RL launch after behavior cloning takes besides its model (launch_errors):
    also = " --reward-models <its run>/reward_models" if args.advantage == "hisr" else ""
    run, train_tasks, eval_tasks = start_run(args, __file__, validate_args(args),
                                             also=also, one_process=one_process)
    collects = args.advantage == "hisr" and not (args.resume or args.reward_models)
    if collects and not train_tasks:  # --iterations 0 without a train split (start_run)
        raise UsageError(f"HISR trains its reward models on rollouts of training tasks, and --env "
                         f"{args.env} has no {envs.TRAIN_SPLIT[args.env]} split here; give "
                         "--reward-models <a run>/reward_models, or make the split")

    # Model: the start (--model, or cloned from the expert first), then RL's LoRA adapter.
    model, tokenizer = run.load_model()
    run.open()  # only now: a run stopped by bad flags or missing data leaves nothing

    if args.bc_epochs > 0 and not args.resume:
        model = clone_start(args, run, model, tokenizer, train_tasks)
    start_path = run.keep_base(model, tokenizer)  # the start's directory or hub id
    # HISR's reward models start from the policy's start: a copy, before the policy's adapter.
    aux_start = copy.deepcopy(model) if args.advantage == "hisr" else None
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

    # Collection and the reward models (Eqs. 2-4), or those saved before.
    sprm, sprm_head, hindsight = reward_models_stage(args, run, policy, aux_start, train_tasks)
    del aux_start
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.requires_grad]},
         {"params": list(value_head.parameters()), "lr": args.value_learning_rate}],
        lr=args.learning_rate, weight_decay=args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    task_rng = random.Random(args.seed)
    start_iteration = run.restore(optimizer=optimizer, value_head=value_head, generator=generator,
                                  task_rng=task_rng)

    progress = Progress(args.iterations, "rl", initial=start_iteration, interval=0)
    evaluate_splits = partial(evaluate, args, policy)  # (split, tasks) -> its stats

    if start_iteration == 0:
        policy.sync(run.path)  # vLLM reads the adapter from disk; hf: nothing to do
        run.evaluate(0, eval_tasks, evaluate_splits)
    for iteration in range(start_iteration + 1, args.iterations + 1):
        t0 = time.time()
        timings()  # the clocks restart: evaluations and set-up are not the iteration's
        # (1) B tasks x N copies, lock-step rollouts of the current policy
        batch_tasks = task_rng.sample(train_tasks, args.tasks_per_iteration)
        policy.sync(run.path)
        # Each task N times, a group (id: its index in the batch); this process's groups only.
        tasks, groups = my_share(batch_tasks, args.group_size)
        trajs = rollout(args, tokenizer, policy, tasks, groups, args.rollout_temperature,
                        keys=episode_keys((args.seed, "train", iteration), groups))
        rollout_seconds = time.time() - t0
        # (2-4) old log-probs (Eq. 5's denominator) and values, the reference's step KL; the
        # segments and their SPRM rewards (Eq. 2), the hindsight log-probs (Eq. 5's numerator).
        score_rollouts(args, model, value_head, tokenizer, trajs)
        cut = score_reward_models(args, sprm, sprm_head, hindsight, tokenizer, trajs)
        # (5) importance (Eqs. 5-6), modulated segment rewards (Eq. 7), fused rewards (Eq. 8) and
        # GAE over the whole batch, whitened over all of it; each process keeps its own.
        with timer("advantages"):
            # batch: every process's (one process: trajs'); mine: where trajs' lie among them
            batch, mine = whole_batch([summarize(t) for t in trajs])
            batch_advantages, batch_returns = compute_advantages(args, batch)
            advantages, returns = batch_advantages[mine], batch_returns[mine]
        samples = [StepSample(s["prompt"], s["response_ids"], float(a), float(g),
                              s["old_logprobs"], s["value"])
                   for tr, adv, ret in zip(trajs, advantages, returns)
                   for s, a, g in zip(tr["steps"], adv, ret)]
        # (6) the clipped policy update (Eq. 9) with the critic's value loss.
        policy.sleep()  # --vllm-sleep: the engine's memory to the update
        with timer("update"):
            stats = policy_update(args, model, value_head, tokenizer, optimizer, samples,
                                  generator, iteration)
        batch_tokens, _ = whole_batch([len(s.response) for s in samples])  # every process's
        stats.update(batch_stats(batch, batch_advantages, batch_returns))
        stats.update({"time/rollout_seconds": rollout_seconds,
                      "time/iteration_seconds": time.time() - t0,
                      "rollout/tokens_per_second": sum(batch_tokens) / max(rollout_seconds, 1e-9)})
        if sprm is not None:
            for name, count in cut.items():  # summed over every process
                stats[name] = sum(whole_batch([count])[0])
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
