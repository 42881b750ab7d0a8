"""Credit accuracy against an environment's oracle: does an estimator give more credit to the
steps that really moved the agent towards its goal?

The household knows what real benchmarks hide: from any state its expert reaches the goal in
envs.household.steps_to_go steps, so every step of a rollout has a progress, steps_to_go before
it minus steps_to_go after it (+1 for an expert step, 0 for a detour, negative for a step that
must be undone). This benchmark plays one batch as in training (the shared start `tiny` or
--model, groups of one task, the training temperature, seeded), labels every step with its
progress, lets each estimator compute the per-step credit its update would use on that same
batch, with its own script's functions, and reports how well the credit ranks the steps:

- same-state AUC: pairs of steps taken from one true game state of one task group, one with
  progress > 0, one with progress <= 0; the share where the better step got more credit (ties
  count one half). The comparison that moves the policy gradient; the state's value cancels.
- sign agreement: the share of steps whose credit is positive exactly when their progress is.
- within-trajectory AUC, over all trajectories and over failed ones: which steps of an episode
  helped, what process rewards claim. Every step of a trajectory with one credit scores 0.5.
- same-state AUC and sign agreement over admissible steps alone: an inadmissible step never
  makes progress, so credit that only tells grounding apart does well above and not here.

The summary line also screens a protocol (--max-episode-steps, --history-length, --model): the
start's success, the share of mixed groups (what GRPO learns from), and where failed episodes
stall, the probability that the policy gives the expert's action.

Each figure comes with a bootstrap standard error over tasks. The household's oracle is a
heuristic searching expert, not an optimal planner: steps_to_go is a consistent distance, not the
true one. With --env alfworld the batch is played on ALFWorld's engine from `tiny-alfworld`
(generated games, $ALFWORLD_DATA) and the oracle is the fewest commands to a win
(envs.alfworld_env.steps_to_go), the same for every estimator.

    python benchmarks/credit.py                                  # 32 tasks x 8, every estimator
    python benchmarks/credit.py --estimators grpo gigpo proxmo --num-tasks 8
    python benchmarks/credit.py --estimators grpo oracle admissible --max-episode-steps 50
    python benchmarks/credit.py --env alfworld --estimators oracle grpo gigpo proxmo --num-tasks 8
    python benchmarks/credit.py --env alfworld --estimators oracle grpo gigpo proxmo \\
        --adapter runs/.../checkpoint-10      # a trained policy plays the batch
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import sys
import textwrap
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace

# Before torch loads OpenMP, as the scripts do: waiting threads sleep instead of spinning (next to
# another busy process, spinning made this benchmark several times slower).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every table in benchmarks/results/credit was drawn from torch's global stream (the scripts'
# --sampler global); keyed draws would play another batch.
SAMPLER = "global"
sys.path.insert(0, ROOT)

import envs  # noqa: E402
import hisr  # noqa: E402
import istar  # noqa: E402
import proxmo  # noqa: E402
import spa  # noqa: E402
import sspo  # noqa: E402
from common import UsageError, error_line, write_text  # noqa: E402
from common.model import (DEFAULT_MODEL, TINY_ENV, TINY_STARTS, add_lora,  # noqa: E402
                          load_lora, load_model_and_tokenizer, merge_lora, response_logprobs)
from common.progress import Progress  # noqa: E402
from common.run import CODE_VERSION, quiet_libraries, weights_digest  # noqa: E402
from envs.alfworld_env import AlfworldEnv  # noqa: E402
from envs.household import HouseholdEnv, generate_task  # noqa: E402
from envs.text import expert_response  # noqa: E402
from learning import save_png  # noqa: E402


# ---- 1. The figures -----------------------------------------------------------------------------
def _pair_counts(credit: np.ndarray, progress: np.ndarray) -> tuple[float, int]:
    """(wins, pairs) over the pairs (i, j) of one group with progress_i > 0 >= progress_j: wins
    counts credit_i > credit_j as 1 and a tie as 1/2."""
    better, worse = np.sort(credit[progress > 0]), np.sort(credit[progress <= 0])
    if len(better) == 0 or len(worse) == 0:
        return 0.0, 0
    below = np.searchsorted(worse, better, side="left")   # worse credits strictly below
    not_above = np.searchsorted(worse, better, side="right")
    wins = below.sum() + 0.5 * (not_above - below).sum()
    return float(wins), len(better) * len(worse)


def credit_auc(credit, progress, groups=None) -> float:
    """Over all pairs of steps (i, j) with progress_i > 0 >= progress_j (and, when `groups` is
    given, groups_i == groups_j), the share where credit_i > credit_j, a tie counting one half;
    NaN when there is no pair. credit, progress, groups: (M,) sequences, one entry per step."""
    credit, progress = np.asarray(credit, dtype=float), np.asarray(progress, dtype=float)
    groups = np.zeros(len(credit), dtype=int) if groups is None else np.asarray(groups)
    wins = pairs = 0
    for g in np.unique(groups):
        w, p = _pair_counts(credit[groups == g], progress[groups == g])
        wins, pairs = wins + w, pairs + p
    return wins / pairs if pairs else float("nan")


def sign_agreement(credit, progress) -> float:
    """The share of steps with credit > 0 exactly when progress > 0 (a credit of 0 is not
    positive); NaN without steps."""
    credit, progress = np.asarray(credit, dtype=float), np.asarray(progress, dtype=float)
    return float(np.mean((credit > 0) == (progress > 0))) if len(credit) else float("nan")


FIGURES = ("same-state AUC", "sign agreement", "within-trajectory AUC", "within failed",
           "same-state AUC, admissible", "sign agreement, admissible")


def task_counts(batch: "Batch", credit: list[Tensor]) -> np.ndarray:
    """(tasks, figures, 2): per task of the batch the numerator and denominator of each figure,
    so that a figure over any multiset of tasks is a ratio of sums (what the bootstrap needs).
    A step whose credit is NaN (an estimator that scored part of the batch) is left out. The
    last two figures count admissible steps alone: an inadmissible step never makes progress, so
    credit that only tells grounding apart scores well on the first two and not on these."""
    counts = np.zeros((len(batch.task_ids), len(FIGURES), 2))
    for i, traj in enumerate(batch.trajs):
        k = batch.task_index[i]
        c = credit[i].detach().to(torch.float64).numpy()
        p = np.asarray(batch.progress[i], dtype=float)
        if len(c) != len(p):
            raise ValueError(f"trajectory {i}: {len(c)} credits for {len(p)} steps")
        valid = np.array([s["valid"] for s in traj["steps"]], dtype=bool)[~np.isnan(c)]
        c, p = c[~np.isnan(c)], p[~np.isnan(c)]
        counts[k, 1] += ((c > 0) == (p > 0)).sum(), len(p)
        counts[k, 5] += ((c[valid] > 0) == (p[valid] > 0)).sum(), valid.sum()
        counts[k, 2] += _pair_counts(c, p)
        if not traj["won"]:
            counts[k, 3] += _pair_counts(c, p)
    for k, rows in batch.same_state:  # the steps from one true state of one task group
        c = np.array([float(credit[i][t]) for i, t in rows])
        p = np.array([batch.progress[i][t] for i, t in rows], dtype=float)
        valid = np.array([batch.trajs[i]["steps"][t]["valid"] for i, t in rows], dtype=bool)
        counts[k, 0] += _pair_counts(c[~np.isnan(c)], p[~np.isnan(c)])
        counts[k, 4] += _pair_counts(c[valid & ~np.isnan(c)], p[valid & ~np.isnan(c)])
    return counts


def figures_with_se(counts: np.ndarray, resamples: int = 200,
                    seed: int = 0) -> list[tuple[float, float]]:
    """(value, bootstrap SE over tasks) of each figure; the SE is the std of the figure over
    `resamples` draws of the tasks with replacement (NaN when a figure has no pair). Tasks
    without any counted step (not scored by the estimator) are left out of the draws."""
    counts = counts[counts[:, 1, 1] > 0]
    totals = counts.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        values = totals[:, 0] / totals[:, 1]
        rng = np.random.default_rng(seed)
        draws = rng.integers(0, len(counts), size=(resamples, len(counts)))
        sums = counts[draws].sum(axis=1)                   # (resamples, figures, 2)
        boot = sums[..., 0] / sums[..., 1]
    ses = [float(np.nanstd(boot[:, f], ddof=1)) if totals[f, 1] else float("nan")
           for f in range(len(FIGURES))]
    return [(float(v), s) for v, s in zip(values, ses)]


# ---- 2. One batch, labelled by the oracle ------------------------------------------------------
@dataclass
class Budget:
    """What the estimators that need data of their own get, from the same start and seed."""

    # SPA's progress estimator learns from exploration: spa.py's 64 tasks x 8 take minutes; the
    # first 16 of its draw keep it near 3 (12 gave a PE worse than a constant on held-out tasks).
    explore_tasks: int = 16
    # HISR's reward models learn from a collection: hisr.py's 48 tasks x 4, here the first 16.
    collect_tasks: int = 16
    # HISR's hindsight pass (a cloze input of the whole episode per reply) is the slowest
    # scoring: it scores the batch's first hisr_tasks task groups, and its figures rest on them.
    hisr_tasks: int = 8
    # iStar's PRM equals the policy at iteration 1 (every step reward 0: iStar = RLOO); measured
    # is the PRM after dpo_steps of its DPO steps, each on dpo_tasks other tasks x 8 rollouts of
    # the frozen start (the protocol takes 20 steps of 8 tasks).
    dpo_steps: int = 5
    dpo_tasks: int = 8
    # 3SPO's search: finished paths per task (0: sspo.py's own budget).
    search_paths: int = 0


@dataclass
class Batch:
    """One training batch of the start and its oracle labels. trajs: proxmo.rollout's
    trajectories (every script's rollout makes the same ones); tasks[i]: the task seed of
    trajectory i; task_index[i]: its group (the index of its task in task_ids); progress[i]:
    (T_i,) ints; same_state: (task index, [(trajectory, step), ...]) for each true state of a
    task group from which more than one step was taken."""

    args: proxmo.Args
    model: torch.nn.Module
    tokenizer: object
    trajs: list[dict]
    tasks: list[int]
    task_ids: list[int]
    task_index: list[int]
    progress: list[list[int]]
    same_state: list[tuple[int, list[tuple[int, int]]]]
    budget: Budget = field(default_factory=Budget)
    cache: dict = field(default_factory=dict)  # what two estimators share (a search, a PRM)


def check_adapter_base(adapter: str, model, name: str) -> None:
    """Refuse a run's adapter on weights other than those it trained on (its checkpoint's
    trainer_state.pt names them by digest): a BC start, say, is the run's own base_model/."""
    state_file = os.path.join(adapter, "trainer_state.pt")
    if not os.path.isfile(state_file):
        return  # an adapter saved by hand: nothing to check it against
    try:
        trained_on = torch.load(state_file, weights_only=False).get("base_weights")
    except Exception as e:  # a damaged file: pickle raises many kinds
        raise UsageError(f"--adapter {adapter}: its trainer_state.pt cannot be read "
                         f"({error_line(e)})") from None
    if trained_on is not None and trained_on != weights_digest(model):
        raise UsageError(f"--adapter {adapter} trained on other weights than --model {name}; "
                         "pass the model its run started from (its run directory's base_model/ "
                         "when the run cloned or trained its own start)")


def collect(num_tasks: int, group_size: int, seed: int, temperature: float | None = None,
            max_episode_steps: int | None = None, budget: Budget | None = None,
            model: str | None = None, history_length: int | None = None,
            env: str = "household", adapter: str | None = None) -> Batch:
    """Rollouts of the start (the env's shared tiny start, or `model`: tiny-weak or a directory;
    with `adapter`, a run's checkpoint, its LoRA adapter folded in: the trained policy) on
    `num_tasks` training tasks of `env` (drawn with `seed`) x `group_size`, as proxmo.py's
    first iteration plays them (its tiny preset: temperature, step limit, history, env workers),
    each step labelled with its progress."""
    args = replace(proxmo.preset_args(DEFAULT_MODEL[env], env), seed=seed,
                   group_size=group_size, model=model or DEFAULT_MODEL[env], sampler=SAMPLER)
    if temperature is not None:
        args.rollout_temperature = temperature
    if max_episode_steps is not None:
        args.max_episode_steps = max_episode_steps
    if history_length is not None:
        args.history_length = history_length
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)  # as the scripts
    model, tokenizer = load_model_and_tokenizer(args.model, seed=seed)
    if adapter:
        check_adapter_base(adapter, model, args.model)
        with torch.random.fork_rng():  # the adapter's initialisation draws: not the batch's
            model = merge_lora(load_lora(model, adapter))
    model.requires_grad_(False)
    policy = proxmo.Policy(args, model, tokenizer)  # the harness every script shares
    task_ids = random.Random(seed).sample(envs.list_tasks(env, "train"), num_tasks)
    tasks = [t for t in task_ids for _ in range(group_size)]
    groups = [k for k in range(num_tasks) for _ in range(group_size)]
    trajs = proxmo.rollout(args, tokenizer, policy, tasks, groups, args.rollout_temperature,
                           desc=f"batch: {num_tasks} tasks x {group_size}")
    jobs = [(task, [s["action"] for s in traj["steps"]], [s["next_state"] for s in traj["steps"]],
             args.max_episode_steps) for task, traj in zip(tasks, trajs)]
    steps = sum(len(traj["steps"]) for traj in trajs)
    where = f"{args.env_workers} env workers" if args.env_workers else "in this process"
    print(f"labelling {steps} steps with the oracle ({where})", flush=True)
    progress, by_state = [], defaultdict(list)
    for i, (p, states) in enumerate(envs.label_batch(env, jobs, args.env_workers)):
        progress.append(p)
        for t, state in enumerate(states):
            by_state[groups[i], state].append((i, t))
    same_state = [(k, rows) for (k, _), rows in by_state.items() if len(rows) > 1]
    return Batch(args, model, tokenizer, trajs, tasks, task_ids, groups, progress,
                 same_state, budget or Budget())


def stall_expert_probability(batch: Batch, chunk: int = 32) -> tuple[float, float, int]:
    """Where failed episodes stall: every step of a failed episode after its last step with
    progress > 0 (all its steps when none had). At each, the probability that the policy, at the
    rollout temperature, replies with the expert's action (the reply BC taught:
    envs.text.expert_response). Returns (median probability, the share of stall steps where a
    group of 8 samples draws it once in expectation, 8 p >= 1, their number); (nan, nan, 0)
    without one."""
    prompts, responses = [], []
    for traj, task, progress in zip(batch.trajs, batch.tasks, batch.progress):
        if traj["won"]:
            continue
        last = max([t for t, p in enumerate(progress) if p > 0], default=-1)
        if batch.args.env == "household":
            game = HouseholdEnv(generate_task(task), max_steps=batch.args.max_episode_steps)
        else:  # the hand-coded expert, watching the episode (its own random stream: seed 0)
            game = AlfworldEnv(task, batch.args.max_episode_steps, expert=True, seed=0)
        game.reset()
        for t, step in enumerate(traj["steps"]):
            expert = game.expert_action()
            if t > last and expert is not None:
                reply = expert_response(expert, batch.args.reasoning)
                ids = batch.tokenizer(reply, add_special_tokens=False).input_ids
                prompts.append(step["prompt"])
                responses.append(ids + [batch.tokenizer.eos_token_id])
            game.step(step["action"])
    if not prompts:
        return float("nan"), float("nan"), 0
    logp = []
    with torch.no_grad():
        for k in range(0, len(prompts), chunk):
            lp, mask, _ = response_logprobs(batch.model, prompts[k:k + chunk],
                                            responses[k:k + chunk], batch.tokenizer.pad_token_id,
                                            temperature=batch.args.rollout_temperature)
            logp += (lp * mask).sum(dim=1).tolist()
    p = np.exp(np.array(logp))
    return float(np.median(p)), float(np.mean(8 * p >= 1)), len(p)


# ---- 3. The estimators: each script's own functions on the batch -------------------------------
# Each takes the batch and returns (credit per trajectory as (T_i,) tensors, what data beyond the
# batch it used). The credit is the per-step advantage the script's update would use.
def preset(script, batch: Batch):
    """The script's tiny preset for the batch's environment (its Args, from preset_args), drawing
    as the batch does (SAMPLER)."""
    return replace(script.preset_args(DEFAULT_MODEL[batch.args.env], batch.args.env),
                   sampler=SAMPLER)


def proxmo_credit(batch: Batch, advantage: str) -> tuple[list[Tensor], str]:
    """GRPO, GiGPO, ProxMO or the oracle with proxmo.py's tiny preset (the oracle reads the
    batch's progress, as proxmo.py's update would)."""
    args = replace(batch.args, advantage=advantage)
    trajs = [{**traj, "progress": p} for traj, p in zip(batch.trajs, batch.progress)]
    data = "the batch and its progress" if advantage in proxmo.ORACLES else "the batch"
    return proxmo.compute_advantages(args, trajs), data


def rloo_credit(batch: Batch) -> tuple[list[Tensor], str]:
    """RLOO, iStar's baseline, with istar.py's tiny preset (outcome --success-reward x won)."""
    args = replace(preset(istar, batch), seed=batch.args.seed,
                   advantage="rloo")
    return istar.compute_advantages(args, batch.trajs), "the batch"


def spa_first_iteration(batch: Batch, advantage: str,
                        grounding_form: str = "cost") -> tuple[list[Tensor], str]:
    """spa.py's advantage at its first iteration (tiny preset, with `grounding_form`): the
    zero-initialised value head gives V = 0 and the zero LoRA adapter a step KL of 0 to the
    reference; with SPA, c_t from a PE trained as main trains it (spa.explore of the start,
    spa.train_progress_estimator) and spa.score_progress; then spa.compute_advantages (GAE,
    whitened over the batch). The PE is trained once a batch."""
    args = replace(preset(spa, batch), seed=batch.args.seed,
                   advantage=advantage, grounding_form=grounding_form)
    trajs = [{**t, "steps": [{**s, "value": 0.0, "step_kl": 0.0, "contrib": 0.0}
                             for s in t["steps"]]} for t in batch.trajs]
    data = "the batch; V = 0 (the zero-initialised critic of iteration 1)"
    if advantage == "spa":
        if "spa" not in batch.cache:
            tasks = random.Random(args.seed + 2).sample(envs.list_tasks(args.env, "train"),
                                                        batch.budget.explore_tasks)
            with torch.random.fork_rng():
                torch.manual_seed(args.seed)
                explored = spa.explore(args, spa.Policy(args, batch.model, batch.tokenizer),
                                       tasks)
                pe = add_lora(copy.deepcopy(batch.model), args.lora_r, args.lora_alpha,
                              args.lora_dropout, args.lora_target_modules)
                head = spa.make_head(pe.config.hidden_size, args.pe_head, "cpu")
                spa.train_progress_estimator(args, pe, head, batch.tokenizer, explored,
                                             random.Random(args.seed + 3))
            batch.cache["spa"] = pe, head
        pe, head = batch.cache["spa"]
        spa.score_progress(args, pe, head, batch.tokenizer, trajs)
        data = (f"own exploration, {batch.budget.explore_tasks} tasks x {args.explore_rollouts} "
                f"(spa.py: {args.explore_num_tasks} x {args.explore_rollouts}); V = 0 "
                "(iteration 1)")
    advantages, _ = spa.compute_advantages(args, [spa.summarize(t) for t in trajs])
    return [torch.tensor(a, dtype=torch.float64) for a in advantages], data


def hisr_scored(batch: Batch) -> tuple[hisr.Args, list[dict], str]:
    """hisr.py's steps before its first update (tiny preset): hisr.collect of the start and
    hisr.train_reward_models, then on the batch's first budget.hisr_tasks groups score_segments
    and score_hindsight, with the recorded old log-probs, V = 0 (the zero critic of iteration 1)
    and step KL 0 (the zero adapter). Computed once a batch. (The literal reading's row, with the
    loop filter and no admissible actions in the cloze, went with those flags in issue 44;
    commit 32ae25f has it.)"""
    key = "hisr"
    if key in batch.cache:
        return batch.cache[key]
    args = replace(preset(hisr, batch), seed=batch.args.seed,
                   collect_num_tasks=batch.budget.collect_tasks)
    train_tasks = envs.list_tasks(args.env, "train")
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        tasks = random.Random(args.seed + 2).sample(train_tasks, args.collect_num_tasks)
        collected = hisr.collect(args, hisr.Policy(args, batch.model, batch.tokenizer), tasks)
        sprm, head, hindsight, fit = hisr.train_reward_models(args, batch.model, batch.tokenizer,
                                                              collected)
    trajs = [{**t, "steps": [{**s, "old_logprobs": torch.tensor(s["logprobs"]), "value": 0.0,
                              "step_kl": 0.0} for s in t["steps"]]}
             for t, k in zip(batch.trajs, batch.task_index) if k < batch.budget.hisr_tasks]
    hisr.score_segments(args, sprm, head, batch.tokenizer, trajs)
    hisr.score_hindsight(args, hindsight, batch.tokenizer, trajs)
    nan = float("nan")
    held = (f"{fit['aux/heldout']} held out, unfiltered: SPRM AUC "
            f"{fit.get('sprm/heldout_auc', nan):.2f}, hindsight NLL "
            f"{fit.get('hindsight/heldout_nll_hindsight', nan):.2f} (policy "
            f"{fit.get('hindsight/heldout_nll_start_policy', nan):.2f})")
    data = (f"own collection, {args.collect_num_tasks} tasks x {args.collect_rollouts} (hisr.py: "
            f"{preset(hisr, batch).collect_num_tasks} x "
            f"{args.collect_rollouts}), {fit['aux/trained_on']} trained on, {held}; V = 0; the "
            f"first {min(batch.budget.hisr_tasks, len(batch.task_ids))} task groups")
    batch.cache[key] = args, [hisr.summarize(t) for t in trajs], data
    return batch.cache[key]


def hisr_credit(batch: Batch, **change) -> tuple[list[Tensor], str]:
    """HISR's first-iteration advantage (with `change`, settings of the reward only):
    hisr.compute_advantages on the scored groups; the steps of the groups HISR did not score get
    NaN (left out of every figure)."""
    args, summaries, data = hisr_scored(batch)
    advantages, _ = hisr.compute_advantages(replace(args, **change), summaries)
    scored = iter(advantages)
    return [torch.as_tensor(next(scored), dtype=torch.float64) if k < batch.budget.hisr_tasks
            else torch.full((len(t["steps"]),), float("nan"))
            for t, k in zip(batch.trajs, batch.task_index)], data


def istar_step_rewards(batch: Batch) -> tuple[list[list[float]], str]:
    """Eq. 1 of every step of the batch under the PRM after budget.dpo_steps DPO steps (istar.py's
    tiny preset; the PRM, its adapter and optimizer as istar.py's main makes them; each step as an
    iteration of main without the policy update: rollout, score_responses of the start and the
    PRM, step_rewards_per_trajectory, prm_update), pi_old the start. Computed once a batch."""
    if "istar" in batch.cache:
        return batch.cache["istar"]
    args = replace(preset(istar, batch), seed=batch.args.seed,
                   rollout_temperature=batch.args.rollout_temperature)
    policy = istar.Policy(args, batch.model, batch.tokenizer)

    def step_rewards(prm, trajs: list[dict]) -> tuple[list[list[float]], list]:
        steps = [istar.ScoredStep(s["prompt"], s["response_ids"], None)
                 for tr in trajs for s in tr["steps"]]
        old = istar.score_responses(batch.model, batch.tokenizer, steps, args.micro_batch_size,
                                    args.rollout_temperature)
        new = istar.score_responses(prm, batch.tokenizer, steps, args.micro_batch_size,
                                    args.rollout_temperature)
        rewards = istar.step_rewards_per_trajectory(trajs, new, old, args.beta)
        return rewards, [step._replace(old_logprobs=lp) for step, lp in zip(steps, old)]

    pool = [t for t in envs.list_tasks(args.env, "train") if t not in set(batch.task_ids)]
    task_rng = random.Random(args.seed)
    with torch.random.fork_rng():
        torch.manual_seed(args.seed + 1)  # the PRM's adapter, then its rollouts
        prm = add_lora(copy.deepcopy(batch.model), args.lora_r, args.lora_alpha,
                       args.lora_dropout, args.lora_target_modules)
        optimizer = torch.optim.AdamW([p for p in prm.parameters() if p.requires_grad],
                                      lr=args.prm_learning_rate, weight_decay=0.0)
        for step in range(1, batch.budget.dpo_steps + 1):
            task_ids = task_rng.sample(pool, batch.budget.dpo_tasks)
            tasks = [t for t in task_ids for _ in range(args.group_size)]
            groups = [g for g in range(batch.budget.dpo_tasks) for _ in range(args.group_size)]
            trajs = istar.rollout(args, batch.tokenizer, policy, tasks, groups,
                                  args.rollout_temperature)
            rewards, samples = step_rewards(prm, trajs)
            summary = [{**istar.summarize(t), "step_rewards": r} for t, r in zip(trajs, rewards)]
            istar.prm_update(args, prm, batch.tokenizer, optimizer, summary, samples,
                             slice(0, len(trajs)), step)
    rewards, _ = step_rewards(prm, batch.trajs)
    data = (f"{batch.budget.dpo_steps} DPO steps, each on {batch.budget.dpo_tasks} x "
            f"{args.group_size} fresh rollouts of "
            "other tasks by the frozen start")
    batch.cache["istar"] = rewards, data
    return rewards, data


def istar_credit(batch: Batch) -> tuple[list[Tensor], str]:
    """iStar with istar.py's tiny preset (RLOO estimator) and the trained PRM's step rewards."""
    rewards, data = istar_step_rewards(batch)
    args = replace(preset(istar, batch), seed=batch.args.seed,
                   advantage="istar")
    trajs = [{**t, "step_rewards": r} for t, r in zip(batch.trajs, rewards)]
    return istar.compute_advantages(args, trajs), data


def istar_reward_credit(batch: Batch) -> tuple[list[Tensor], str]:
    """The trained PRM's raw step rewards: what the process reward claims of each step."""
    rewards, data = istar_step_rewards(batch)
    return [torch.tensor(r, dtype=torch.float64) for r in rewards], data


# sspo.py's readings: as revised (its defaults) and the literal one (per-task keys, the paper's
# alpha 50, R_succ 1).
SSPO_READINGS = {"new": {},
                 "literal": {"share_states_across_tasks": False, "score_alpha": 50.0,
                             "success_reward": 1.0}}


def sspo_args(batch: Batch, reading: str) -> sspo.Args:
    """sspo.py's tiny preset with SSPO_READINGS[reading] and the batch's seed."""
    return replace(preset(sspo, batch), seed=batch.args.seed,
                   **SSPO_READINGS[reading])


def sspo_search(batch: Batch, reading: str = "new") -> tuple[sspo.Args, sspo.StateTable, str]:
    """3SPO's state table after its own search on the batch's tasks (sspo.py's tiny preset with
    SSPO_READINGS[reading] and budget, --tasks-per-iteration tasks at a time, one table), by the
    start policy without any update: search_and_learn's loop of search_round and
    update_counters, less the update. Computed once a batch and reading."""
    key = f"sspo-{reading}"
    if key in batch.cache:
        return batch.cache[key]
    args = sspo_args(batch, reading)
    if batch.budget.search_paths:
        args.max_paths = batch.budget.search_paths
    policy = sspo.Policy(args, batch.model, batch.tokenizer)
    table, paths, pathless = sspo.StateTable(), 0, 0
    progress = Progress(len(batch.task_ids), f"3SPO search ({reading} reading), tasks")
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        for first in range(0, len(batch.task_ids), args.tasks_per_iteration):
            tasks = batch.task_ids[first:first + args.tasks_per_iteration]
            searches = [sspo.new_search(args, task) for task in tasks]
            while any(sspo.search_active(args, search) for search in searches):
                _, finished, _ = sspo.search_round(args, batch.tokenizer, policy, searches,
                                                   table)
                for index, keys, won, _ in finished:
                    searches[index]["paths"] += 1
                    sspo.update_counters(table.counts, keys, won)
                    table.t += 1
                    paths += 1
                done = first + sum(not sspo.search_active(args, search) for search in searches)
                progress.update(done - progress.count, paths=paths)
            pathless += sum(search["paths"] == 0 for search in searches)
    progress.close()
    data = (f"own search on the batch's tasks by the start, no update ({paths} paths, "
            f"{pathless} tasks without one)")
    batch.cache[key] = args, table, data
    return batch.cache[key]


def sspo_step_rewards(batch: Batch, searched: bool = True,
                      reading: str = "new") -> tuple[list[list[float]], list[list[str]], str]:
    """Eq. 2's step reward of every step of the batch, as search_round rewards a child (a
    "Nothing happens." keeps the state's key; success and terminal = the step won; valid = well
    formed), and the key of each step's state. searched: from the counts (and final t) of the
    whole search on these very tasks, which no update of 3SPO sees; else from the empty table of
    3SPO's first round. reading: a key of SSPO_READINGS."""
    if searched:
        args, table, data = sspo_search(batch, reading)
    else:
        args = sspo_args(batch, reading)
        table, data = sspo.StateTable(), "the batch; an empty state table (the first round)"
    rewards, sources = [], []
    for task, traj in zip(batch.tasks, batch.trajs):
        key = sspo.state_key(str(task), traj["steps"][0]["state"],
                             args.share_states_across_tasks)
        row, keys = [], []
        for step, reward in zip(traj["steps"], traj["rewards"]):
            next_key = key if step["next_state"] == sspo.NOTHING_HAPPENS else sspo.state_key(
                str(task), step["next_state"], args.share_states_across_tasks)
            won = reward > 0
            row += sspo.transition_rewards(
                table.counts, key, [next_key], [won], [step["well_formed"]], table.t,
                args.score_alpha, args.fail_threshold, args.success_threshold,
                k=args.novelty_decay, invalid_penalty=args.step_invalid_penalty,
                terminals=[won], **sspo.score_schedule(args), novelty=args.novelty_reward,
                score_difference=args.score_difference_reward,
                fixed_weight=args.fixed_novelty_weight, success_reward=args.success_reward)
            keys.append(key)
            key = next_key
        rewards.append(row)
        sources.append(keys)
    return rewards, sources, data


def sspo_reward_credit(batch: Batch, reading: str = "new") -> tuple[list[Tensor], str]:
    """3SPO's step rewards (Eq. 2) themselves."""
    rewards, _, data = sspo_step_rewards(batch, reading=reading)
    return [torch.tensor(r, dtype=torch.float64) for r in rewards], data


def sspo_credit(batch: Batch, searched: bool = True,
                reading: str = "new") -> tuple[list[Tensor], str]:
    """3SPO's advantage (Eq. 4): group_advantages of the step rewards of the batch's steps taken
    from one state key within one task group (3SPO's children of a state); 0 for a state left
    by one step only (3SPO trains no group of one)."""
    rewards, sources, data = sspo_step_rewards(batch, searched, reading)
    children: dict = defaultdict(list)
    for i, keys in enumerate(sources):
        for t, key in enumerate(keys):
            children[batch.task_index[i], key].append((i, t))
    credit = [torch.zeros(len(row), dtype=torch.float64) for row in rewards]
    use_std = sspo_args(batch, reading).use_std
    for members in children.values():
        if len(members) > 1:
            advantages = sspo.group_advantages([rewards[i][t] for i, t in members],
                                               use_std=use_std)
            for (i, t), advantage in zip(members, advantages):
                credit[i][t] = advantage
    return credit, data + "; children: a group's steps from one state"


def admissible_credit(batch: Batch) -> tuple[list[Tensor], str]:
    """A reference, no method: 1 for an admissible step, 0 otherwise. An inadmissible step never
    makes progress, so any reward for admissible or new-text steps ranks this well."""
    credit = [torch.tensor([float(s["valid"]) for s in t["steps"]]) for t in batch.trajs]
    return credit, "the batch"


ESTIMATORS = {
    "oracle-step": lambda batch: proxmo_credit(batch, "oracle-step"),
    "oracle": lambda batch: proxmo_credit(batch, "oracle"),
    "admissible": admissible_credit,
    "grpo": lambda batch: proxmo_credit(batch, "grpo"),
    "gigpo": lambda batch: proxmo_credit(batch, "gigpo"),
    "proxmo": lambda batch: proxmo_credit(batch, "proxmo"),
    "ppo": lambda batch: spa_first_iteration(batch, "ppo"),
    "spa-eq8": lambda batch: spa_first_iteration(batch, "spa", "eq8"),
    "spa": lambda batch: spa_first_iteration(batch, "spa"),
    "hisr-eq8": lambda batch: hisr_credit(batch, grounding_form="eq8"),
    "hisr": hisr_credit,
    "rloo": rloo_credit,
    "istar": istar_credit,
    "istar-rewards": istar_reward_credit,
    "sspo-first-literal": lambda batch: sspo_credit(batch, False, "literal"),
    "sspo-literal": lambda batch: sspo_credit(batch, True, "literal"),
    "sspo-rewards-literal": lambda batch: sspo_reward_credit(batch, "literal"),
    "sspo-first": lambda batch: sspo_credit(batch, searched=False),
    "sspo": sspo_credit,
    "sspo-rewards": sspo_reward_credit,
}
# What credits the batch alone, with the batch's settings (the others play, explore or train with
# their own script's tiny preset).
ON_THE_BATCH = ("oracle-step", "oracle", "admissible", "grpo", "gigpo", "proxmo", "rloo")
LABELS = {"oracle-step": "oracle: progress alone (reference, proxmo.py)",
          "oracle": "oracle: GRPO + progress (reference, proxmo.py)",
          "admissible": "admissible steps only (reference)", "grpo": "GRPO (proxmo.py)",
          "gigpo": "GiGPO (proxmo.py)", "proxmo": "ProxMO (proxmo.py)",
          "ppo": "PPO (spa.py)", "spa-eq8": "SPA, Eq. 8 as written (spa.py)",
          "spa": "SPA, grounding as a cost (spa.py)",
          "hisr-eq8": "HISR, as revised but Eq. 8 as written (hisr.py)",
          "hisr": "HISR, as revised (hisr.py)",
          "rloo": "RLOO (istar.py)", "istar": "iStar (istar.py)",
          "istar-rewards": "iStar step rewards (istar.py)",
          "sspo-first-literal": "3SPO, the literal reading, first round (sspo.py)",
          "sspo-literal": "3SPO, the literal reading, searched counts (sspo.py)",
          "sspo-rewards-literal": "3SPO step rewards, the literal reading (sspo.py)",
          "sspo-first": "3SPO, as revised, first round (sspo.py)",
          "sspo": "3SPO, as revised, searched counts (sspo.py)",
          "sspo-rewards": "3SPO step rewards, as revised, searched counts (sspo.py)"}


# ---- 4. Table and picture -----------------------------------------------------------------------
def markdown_table(rows: list[dict]) -> str:
    """One row per estimator: every figure +- SE, the data it used, its seconds."""
    lines = ["| estimator | " + " | ".join(FIGURES) + " | data | seconds |",
             "| --- | " + " | ".join("---" for _ in FIGURES) + " | --- | --- |"]
    for row in rows:
        cells = [f"{v:.3f} +- {se:.3f}" for v, se in row["figures"]]
        lines.append(f"| {LABELS[row['name']]} | " + " | ".join(cells) +
                     f" | {row['data']} | {row['seconds']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    """A panel per figure, a horizontal bar per estimator (top to bottom in the table's order)
    with its SE; the reference rows (no method: the oracle, admissible steps) in grey and marked;
    the 0.5 of no information dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [LABELS[row["name"]] for row in rows]
    reference = ["(reference" in label for label in labels]
    fig, axes = plt.subplots(1, len(FIGURES), sharey=True,
                             figsize=(16.0, 1.4 + 0.32 * len(rows)))
    ys = np.arange(len(rows))
    for f, (ax, name) in enumerate(zip(axes, FIGURES)):
        values = [row["figures"][f][0] for row in rows]
        errors = [0.0 if np.isnan(row["figures"][f][1]) else row["figures"][f][1]
                  for row in rows]
        colors = ["0.6" if ref else "C0" for ref in reference]
        ax.barh(ys, values, xerr=errors, color=colors, capsize=2, height=0.7)
        ax.axvline(0.5, color="black", linewidth=0.8, linestyle="--")
        ax.set_xlim(0, 1)
        ax.set_title(name, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].set_yticks(ys, labels, fontsize=7)
    axes[0].invert_yaxis()  # the table's first row on top
    fig.suptitle(textwrap.fill(title, 180) + "\ngrey: references, not methods; dashed: 0.5, no "
                 "information", fontsize=8)
    fig.tight_layout()
    save_png(fig, path)  # whole: a failure leaves no partial picture


BUDGET_HELP = {"explore_tasks": "SPA: tasks its progress estimator explores (x 8)",
               "collect_tasks": "HISR: tasks its reward models' collection plays (x 4)",
               "hisr_tasks": "HISR: task groups of the batch it scores",
               "dpo_steps": "iStar: DPO steps of its PRM before it scores the batch",
               "dpo_tasks": "iStar: tasks of each DPO step's rollouts (x 8)",
               "search_paths": "3SPO: a task's search stops once this many paths have finished "
                               "(a round may finish several; 0: sspo.py's)"}


def main(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="household", choices=list(DEFAULT_MODEL),
                        help="environment (default household; alfworld reads $ALFWORLD_DATA)")
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS),
                        choices=list(ESTIMATORS), help="which (default: all)")
    parser.add_argument("--num-tasks", type=int, default=32, help="training tasks (default 32)")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per task (default 8)")
    parser.add_argument("--seed", type=int, default=1, help="draws tasks and samples (default 1)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature (default: the training temperature)")
    parser.add_argument("--max-episode-steps", type=int, default=None,
                        help="step limit (default: the training limit)")
    parser.add_argument("--history-length", type=int, default=None,
                        help="past steps in the prompt (default: the training setting)")
    parser.add_argument("--model", default=None,
                        help="the start: tiny or tiny-weak (shipped; on alfworld tiny-alfworld, "
                             "the default), or a directory with a cloned model")
    parser.add_argument("--adapter", default=None,
                        help="a run's checkpoint folder: its LoRA adapter on --model plays the "
                             "batch (the trained policy's credit)")
    for name, value in asdict(Budget()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                            help=f"{BUDGET_HELP[name]} (default {value})")
    parser.add_argument("--resamples", type=int, default=200, help="bootstrap draws (default 200)")
    parser.add_argument("--out", default=None,
                        help="where table.md and credit.png go (default benchmarks/results/"
                             "credit, on alfworld credit/alfworld)")
    args = parser.parse_args(argv)
    start = DEFAULT_MODEL[args.env]
    args.model = args.model or start
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", "credit",
                                        *(["alfworld"] if args.env == "alfworld" else []))
    for flag in ("num_tasks", "group_size", "resamples", "explore_tasks", "collect_tasks",
                 "hisr_tasks", "dpo_tasks"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("dpo_steps", "search_paths"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0")
    if args.group_size > 1024:  # the scripts' own bound: more cannot be played in memory
        parser.error(f"--group-size must be <= 1024 (got {args.group_size})")
    try:
        train_tasks = len(envs.list_tasks(args.env, "train"))
    except UsageError as e:  # no ALFWorld games where $ALFWORLD_DATA points
        parser.error(str(e))
    if args.num_tasks > train_tasks:
        parser.error(f"--num-tasks {args.num_tasks}: --env {args.env} has {train_tasks} training "
                     "tasks")
    if args.temperature is not None and not (math.isfinite(args.temperature)
                                             and args.temperature > 0):
        parser.error("--temperature must be finite and > 0")
    if not 0 <= args.seed < 2 ** 32:
        parser.error("--seed must be in [0, 2**32)")
    if args.max_episode_steps is not None and args.max_episode_steps < 1:
        parser.error("--max-episode-steps must be >= 1")
    if args.history_length is not None and args.history_length < 0:
        parser.error("--history-length must be >= 0")
    shipped = [name for name in TINY_STARTS if TINY_ENV[name] == args.env]
    if args.model not in shipped and not os.path.isdir(args.model):
        parser.error(f"--model {args.model} on --env {args.env}: {', '.join(shipped)}, or a "
                     "directory with a model in it")
    for needed in ("adapter_config.json", "adapter_model.safetensors"):
        if args.adapter and not os.path.isfile(os.path.join(args.adapter, needed)):
            parser.error(f"--adapter {args.adapter}: no LoRA adapter there (a run's checkpoint "
                         f"folder holds {needed})")
    own_rollouts = [e for e in args.estimators if e not in ON_THE_BATCH]
    if (args.model != start or args.adapter or args.history_length is not None) and own_rollouts:
        parser.error(f"--model, --adapter and --history-length reach the batch, not the rollouts "
                     f"and models of {' '.join(own_rollouts)}: screen with "
                     f"{' '.join(ON_THE_BATCH)}")
    try:  # before the work: a table that cannot be written fails now, not after it
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "rows.partial.md"), "w") as f:
            f.write("")
    except OSError as e:
        parser.error(f"--out {args.out}: cannot write there ({e})")

    quiet_libraries()
    began = time.time()
    budget = Budget(**{name: getattr(args, name) for name in asdict(Budget())})
    try:  # a damaged adapter, or one trained on other weights: one line, before any rollout
        batch = collect(args.num_tasks, args.group_size, args.seed, args.temperature,
                        args.max_episode_steps, budget, args.model, args.history_length,
                        args.env, args.adapter)
    except UsageError as e:
        os.remove(os.path.join(args.out, "rows.partial.md"))
        parser.error(str(e))
    steps = [p for traj in batch.progress for p in traj]
    won = np.mean([t["won"] for t in batch.trajs])
    wins = defaultdict(list)
    for traj, group in zip(batch.trajs, batch.task_index):
        wins[group].append(traj["won"])
    mixed = np.mean([0 < sum(w) < len(w) for w in wins.values()])  # a group GRPO can learn from
    by_wins = [sum(sum(w) == k for w in wins.values()) for k in range(args.group_size + 1)]
    stall_p, stall_drawn, stalls = stall_expert_probability(batch)
    played = f"{args.model} + {args.adapter}" if args.adapter else args.model
    summary = (f"{args.env}: start {played}, {args.num_tasks} train tasks x "
               f"{args.group_size}, "
               f"temperature {batch.args.rollout_temperature}, step limit "
               f"{batch.args.max_episode_steps}, history {batch.args.history_length}, seed "
               f"{args.seed}: {len(batch.trajs)} "
               f"episodes, success {won:.3f}, mixed groups {mixed:.3f} (groups by wins 0-"
               f"{args.group_size}: {' '.join(map(str, by_wins))}), {len(steps)} steps "
               f"(progress > 0: "
               f"{np.mean(np.array(steps) > 0):.3f}, so credit <= 0 everywhere agrees in sign "
               f"{np.mean(np.array(steps) <= 0):.3f}), {len(batch.same_state)} states with more "
               f"than one step; at the {stalls} steps where failed episodes stall, the "
               f"expert's action has median probability {stall_p:.4f} and 8 samples draw it "
               f"({stall_drawn:.3f} of them); commit {CODE_VERSION}, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads")
    print(f"{summary} [{time.time() - began:.0f}s]", flush=True)
    rows = []
    for name in args.estimators:
        start = time.time()
        torch.manual_seed(args.seed)
        credit, data = ESTIMATORS[name](batch)
        counts = task_counts(batch, credit)
        rows.append({"name": name, "figures": figures_with_se(counts, args.resamples, args.seed),
                     "data": data, "seconds": time.time() - start})
        print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
        try:  # each estimator's row kept as it finishes: a later failure loses only the rest
            write_text(os.path.join(args.out, "rows.partial.md"),
                       f"{summary}\n\n{markdown_table(rows)}\n")
        except OSError as e:
            print(f"warning: cannot keep the rows so far in {args.out} ({e}); they are above",
                  file=sys.stderr)
    markdown = markdown_table(rows)
    try:
        write_text(os.path.join(args.out, "table.md"), f"{summary}\n\n{markdown}\n")
        os.remove(os.path.join(args.out, "rows.partial.md"))
    except OSError as e:
        print(markdown)
        raise SystemExit(f"error: cannot write {args.out}/table.md ({e}); the table is above")
    plot(rows, os.path.join(args.out, "credit.png"), summary)
    print(markdown)
    print(f"(table.md and credit.png in {args.out}; {time.time() - began:.0f}s in all)")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
