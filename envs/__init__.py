"""Environments behind one small interface.

A game object has: reset() -> observation; step(command) -> (observation, reward, done, info)
with info["won"] and info["valid"]; admissible_actions() -> list of commands; expert_action()
(a command, or None once the expert has given up);
and the attributes task_type and task_description. Rewards are sparse: 1.0 on success, else 0.

    tasks = list_tasks("household", "train")      # task handles (seeds or ALFWorld game files)
    game = make_game("household", tasks[0], max_steps=50)
"""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing
import os
import random

from common import UsageError
from common.envbatch import WorkerPool
from envs import alfworld_env, household

ENV_NAMES = ("household", "alfworld")
TASK_TYPES = household.TASK_TYPES  # ALFWorld's six type names, shared by both environments
SHORT_TYPE_NAMES = {"pick_and_place_simple": "pick", "look_at_obj_in_light": "look",
                    "pick_clean_then_place_in_recep": "clean",
                    "pick_heat_then_place_in_recep": "heat",
                    "pick_cool_then_place_in_recep": "cool", "pick_two_obj_and_place": "pick2"}
SPLITS = {"household": household.SPLITS, "alfworld": alfworld_env.SPLITS}
TRAIN_SPLIT = {"household": "train", "alfworld": "train"}
# Evaluation splits by default; the first is the headline. ALFWorld's valid_unseen holds the
# rooms and objects not seen in training, the papers' "unseen" test.
EVAL_SPLITS = {"household": ("test",), "alfworld": ("valid_unseen", "valid_seen")}


def _check(env_name: str) -> None:
    if env_name not in ENV_NAMES:
        raise UsageError(f"unknown environment {env_name!r}; choose one of: "
                         f"{', '.join(ENV_NAMES)}")


def list_tasks(env_name: str, split: str, num_tasks: int | None = None) -> list:
    """Task handles of a split, in a fixed order (the first num_tasks when given)."""
    _check(env_name)
    if env_name == "household":
        try:
            return household.task_seeds(split, num_tasks)
        except ValueError as e:
            raise UsageError(str(e)) from e
    files = alfworld_env.game_files(split)
    if num_tasks and num_tasks > len(files):
        raise UsageError(f"{num_tasks} {split} tasks asked for (--eval-num-tasks), but the split "
                         f"has {len(files)} games under {alfworld_env.data_root()}; 0 takes "
                         "them all")
    return files[:num_tasks] if num_tasks else files


def task_set(env_name: str, tasks: dict[str, list]) -> dict | None:
    """What identifies the games a run plays ({split: its tasks}), for its config.json and a
    resume's check: per split the number of games and a digest of their paths under the data
    root. None for the household, whose tasks are generated from their seeds."""
    if env_name == "household":
        return None
    root = alfworld_env.data_root()
    found = {}
    for split, files in tasks.items():
        names = "\n".join(sorted(os.path.relpath(f, root) for f in files))
        found[split] = {"games": len(files),
                        "sha256": hashlib.sha256(names.encode()).hexdigest()[:16]}
    return {"alfworld_data": root, "splits": found}


def make_game(env_name: str, task, max_steps: int, expert: bool = False, workers: int = 0,
              seed: int | None = None, progress: bool = False):
    """A game of `task`. expert=True is needed for expert_action() (behavior-cloning demos); the
    household's expert is free, ALFWorld's makes every step slower. workers > 0: the game lives in
    one of `workers` processes (a common.envbatch.WorkerPool, started at the first such call and
    kept), for ALFWorld's slow engine; EnvBatch steps such games at once. An ALFWorld game with
    a recorded demonstration of at least this step limit plays back from it
    (alfworld_env.RecordedGame: no engine, no worker), unless `progress` is asked. An ALFWorld
    expert's rare random choices come from its own generator, seeded from `random` here (or by
    `seed`), so a game plays the same in this process or in a worker. progress=True: a
    ProgressGame, whose steps' info also hold the oracle's label of the step."""
    _check(env_name)
    if env_name == "alfworld" and expert and not progress:
        recording = alfworld_env.load_demonstration(task, max_steps)
        if recording is not None:  # played once, with the game set: no engine, no worker
            return alfworld_env.RecordedGame(task, recording, max_steps)
    if env_name == "alfworld" and expert and seed is None:
        seed = random.getrandbits(32)
    if workers > 0:
        if workers not in _POOLS:
            _POOLS[workers] = WorkerPool(workers, make_game)
        return _POOLS[workers].make(env_name, task, max_steps, expert, 0, seed, progress)
    if env_name == "household":
        game = household.HouseholdEnv(household.generate_task(task), max_steps=max_steps)
    else:
        game = alfworld_env.AlfworldEnv(task, max_steps=max_steps, expert=expert, seed=seed)
    return ProgressGame(game, env_name) if progress else game


class ProgressGame:
    """A game whose step info also holds "progress", the oracle's label of that step: the distance
    to a win before it minus after it (the household's: its expert's steps,
    household.steps_to_go; ALFWorld's: the fewest commands to a win, alfworld_env.steps_to_go).
    It telescopes, so a loop or a detour earns 0 in all. Read in the game as it is played (a
    rollout's own, or label_progress's replay); everything else is the wrapped game's, but a
    restore() measures the distance again."""

    def __init__(self, game, env_name: str):
        self.game = game
        module = household if env_name == "household" else alfworld_env
        self.distance = module.steps_to_go
        self.to_go = None  # the distance before the next step

    def __getattr__(self, name: str):
        if name == "game":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.game, name)

    def reset(self) -> str:
        observation = self.game.reset()
        self.to_go = self.distance(self.game)
        return observation

    def step(self, command: str):
        observation, reward, done, info = self.game.step(command)
        after = self.distance(self.game)
        info = {**info, "progress": self.to_go - after}
        self.to_go = after
        return observation, reward, done, info

    def restore(self, snapshot) -> None:
        self.game.restore(snapshot)
        self.to_go = self.distance(self.game)


_POOLS: dict = {}  # worker count -> WorkerPool, kept for the run


_REPLAYED: dict = {}  # label_progress's last game: a group's trajectories share one game


def label_progress(env_name: str, task, actions: list[str], next_states: list[str],
                   max_steps: int) -> tuple[list[int], list[str]]:
    """The oracle's labels of a trajectory: its commands replayed in a game of `task` from its
    start, (progress per step, ProgressGame's; the true state before each step). The replay
    must see the observations the rollout saw (a RuntimeError otherwise). A rollout that asks
    make_game for progress has the labels already, without a replay."""
    _check(env_name)
    module = household if env_name == "household" else alfworld_env
    key = (env_name, task, max_steps)
    if key not in _REPLAYED:  # the same task again (a group) replays in the same game
        _REPLAYED.clear()
        _REPLAYED[key] = make_game(env_name, task, max_steps, progress=True)
    game = _REPLAYED[key]
    game.reset()
    progress, states = [], []
    for action, seen in zip(actions, next_states):
        states.append(module.true_state(game.game))
        obs, _, _, info = game.step(action)
        if obs != seen:
            raise RuntimeError(f"task {task}: the replay of {action!r} saw {obs!r}, the rollout "
                               f"{seen!r}")
        progress.append(info["progress"])
    return progress, states


def label_batch(env_name: str, jobs: list[tuple], workers: int = 0) -> list[tuple]:
    """label_progress(env_name, *job) for every job (task, actions, next_states, max_steps), in
    order; with workers > 1, shared among that many processes (kept for the run), each taking
    consecutive jobs, so that a group's trajectories replay in one game."""
    if workers <= 1:
        return [label_progress(env_name, *job) for job in jobs]
    if workers not in _LABELLERS:
        _LABELLERS[workers] = multiprocessing.get_context("spawn").Pool(workers)
        atexit.register(_LABELLERS[workers].terminate)
    share = -(-len(jobs) // workers)  # ceil: one run of consecutive jobs per process
    return _LABELLERS[workers].starmap(label_progress, [(env_name, *job) for job in jobs],
                                       chunksize=max(1, share))


_LABELLERS: dict = {}  # worker count -> the processes label_batch shares its jobs among


def default_env_workers(env_name: str) -> int:
    """The --env-workers preset: 0 for the household (a step takes microseconds); for ALFWorld
    the CPU cores this process may use, shared among the data-parallel processes of a node
    (accelerate sets LOCAL_WORLD_SIZE), at most 16."""
    if env_name != "alfworld":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(16, (cores or 1) // processes))


def vocabulary(env_name: str) -> list[str]:
    """Words of the environment's texts, for the locally built `tiny-scratch` tokenizer."""
    _check(env_name)
    if env_name == "household":
        return household.vocabulary()
    return alfworld_env.vocabulary()


def noisy_expert(game, history: list, noise: float, rng: random.Random) -> tuple[str | None, str]:
    """(label, command) of the expert's next step, for behavior-cloning demonstrations. label:
    the expert's command, None once it has given up (it then only looks around). command, the
    one executed: the label with probability 1 - noise; else, half the time, the previous command
    of `history` ((observation, command) pairs) again (the typical mistake, usually answered
    "Nothing happens."), and otherwise a random admissible one."""
    if isinstance(game, alfworld_env.RecordedGame):  # played once, its mistakes recorded
        return game.recorded_step(noise)
    label = game.expert_action()
    if label is None:
        return None, "look"
    if rng.random() >= noise:
        return label, label
    if history and rng.random() < 0.5:
        return label, history[-1][1]
    return label, rng.choice(game.admissible_actions())
