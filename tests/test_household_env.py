"""The built-in household: the expert solves every task, invalid commands change nothing, seeds
reproduce tasks exactly, train and test are disjoint, and it is fast."""

import copy
import time
from collections import defaultdict

import pytest

import envs
from envs.household import (TASK_TYPES, HouseholdEnv, Task, generate_task, steps_to_go,
                            task_seeds, vocabulary)


def play_expert(seed: int, max_steps: int = 50) -> HouseholdEnv:
    env = HouseholdEnv(generate_task(seed), max_steps=max_steps)
    env.reset()
    done = False
    while not done:
        action = env.expert_action()
        assert action in env.admissible_actions()
        _, reward, done, info = env.step(action)
        assert info["valid"]
    assert reward == 1.0 and info["won"]
    return env


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_expert_solves_every_task_of_every_type(split):
    seeds = task_seeds(split)
    lengths = defaultdict(list)
    for seed in seeds:
        env = play_expert(seed)
        lengths[env.task_type].append(env.steps)
    assert set(lengths) == set(TASK_TYPES)
    # Hard enough for credit assignment: the harder types take the expert 10-30 steps.
    hard = [n for t in ("pick_two_obj_and_place", "pick_heat_then_place_in_recep",
                        "pick_cool_then_place_in_recep")
            for n in lengths[t]]
    assert sum(hard) / len(hard) >= 10 and max(hard) <= 30
    assert sum(lengths["pick_two_obj_and_place"]) / len(lengths["pick_two_obj_and_place"]) >= 11


def test_train_valid_and_test_tasks_are_disjoint():
    train = {generate_task(s).fingerprint() for s in task_seeds("train")}
    test = {generate_task(s).fingerprint() for s in task_seeds("test")}
    valid = {generate_task(s).fingerprint() for s in task_seeds("valid")}
    assert len(test) == 600 and len(valid) == 600
    assert not train & test and not train & valid and not valid & test
    assert task_seeds("valid", 5) == task_seeds("valid")[:5]
    with pytest.raises(ValueError, match="train, valid, test"):
        task_seeds("dev")
    with pytest.raises(ValueError, match="has 600 tasks"):  # more would reach into valid
        task_seeds("test", 601)


def test_seeds_reproduce_tasks_exactly():
    for seed in (0, 7, 123, 1_000_003):
        a, b = generate_task(seed), generate_task(seed)
        assert a == b
        env_a, env_b = HouseholdEnv(a), HouseholdEnv(b)
        assert env_a.reset() == env_b.reset()
        for _ in range(5):
            action = env_a.expert_action()
            assert env_a.step(action) == env_b.step(action)
    assert generate_task(1).fingerprint() != generate_task(2).fingerprint()


def test_invalid_actions_are_flagged_and_change_nothing():
    env = HouseholdEnv(generate_task(3))
    env.reset()
    env.step(env.expert_action())
    before = copy.deepcopy(env.__dict__)
    for command in ["fly to the moon", "", "take apple 9 from nowhere 1", "go to " + env.location]:
        obs, reward, done, info = env.step(command)
        assert obs == "Nothing happens."
        assert info == {"won": False, "valid": False} and reward == 0.0 and not done
    after = env.__dict__
    assert after["steps"] == before["steps"] + 4  # an invalid command still uses up a step
    for key in before:
        if key != "steps":
            assert after[key] == before[key], key


def test_step_limit_ends_the_episode_without_reward():
    env = HouseholdEnv(generate_task(5), max_steps=3)
    env.reset()
    results = [env.step("look") for _ in range(3)]
    assert [r[2] for r in results] == [False, False, True]
    assert all(r[1] == 0.0 for r in results)
    with pytest.raises(RuntimeError):
        env.step("look")


def test_observations_read_like_alfworld():
    env = HouseholdEnv(generate_task(11))
    first = env.reset()
    assert first.startswith("You are in the middle of a ") and "Your task is to: " in first
    assert env.task_description in first
    assert "go to " + env.task.receptacles[0] in env.admissible_actions()
    obs, *_ = env.step("go to " + env.task.receptacles[0])
    assert obs.startswith("You arrive at " + env.task.receptacles[0] + ".")


def test_vocabulary_covers_every_text():
    import re

    words = set(vocabulary())
    for seed in range(200):
        env = HouseholdEnv(generate_task(seed))
        texts = [env.reset()]
        done = False
        while not done:
            texts += env.admissible_actions()
            obs, _, done, _ = env.step(env.expert_action())
            texts.append(obs)
        for text in texts:
            assert set(re.findall(r"[a-z0-9]+", text.lower())) <= words


def test_thousands_of_steps_per_second():
    env = HouseholdEnv(generate_task(0), max_steps=10_000)
    env.reset()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.5:
        _, _, done, _ = env.step(env.admissible_actions()[n % 3])
        if done:
            env.reset()
        n += 1
    assert n / (time.perf_counter() - start) > 2000


def test_registry_errors_are_clear():
    with pytest.raises(envs.UsageError, match="unknown environment 'nope'"):
        envs.list_tasks("nope", "train")
    with pytest.raises(envs.UsageError, match="unknown household split"):
        envs.list_tasks("household", "valid_unseen")
    game = envs.make_game("household", envs.list_tasks("household", "train", 1)[0], max_steps=7)
    assert game.max_steps == 7 and game.task_type in envs.TASK_TYPES


def _small_kitchen() -> HouseholdEnv:
    """Put an apple on the dining table; the apple is in the closed fridge, a mug on the counter.
    The expert searches countertop 1, then fridge 1: go, go, open, take, go, move = 6 steps."""
    task = Task(seed=-1, room="kitchen", task_type="pick_and_place_simple",
                receptacles=["countertop 1", "fridge 1", "diningtable 1"],
                contents={"countertop 1": ["mug 1"], "fridge 1": ["apple 1"],
                          "diningtable 1": []},
                lamp="", target_object="apple", target_receptacle="diningtable",
                goal="put a apple in diningtable.")
    game = HouseholdEnv(task, max_steps=8)
    game.reset()
    return game


def test_steps_to_go_counts_the_experts_remaining_steps():
    game = _small_kitchen()
    assert steps_to_go(game) == 6
    assert steps_to_go(game, cap=4) == 4          # the expert needs more than the cap
    before = game.snapshot()
    game.step("go to countertop 1")               # the expert's own first step: progress +1
    assert steps_to_go(game) == 5
    game.step("take mug 1 from countertop 1")     # the wrong object: it must be put back, -1
    assert steps_to_go(game) == 6
    game.step("move mug 1 to countertop 1")
    game.step("go to fridge 1")
    assert steps_to_go(game) == 4                 # countertop 1 is seen: open, take, go, move
    game.step("open fridge 1")
    game.step("take apple 1 from fridge 1")
    assert game.steps == 6 and steps_to_go(game) == 2   # the two steps the limit has left
    assert game.snapshot()["steps"] == 6 and game.max_steps == 8
    game.step("go to diningtable 1")
    _, reward, done, _ = game.step("move apple 1 to diningtable 1")
    assert reward == 1.0 and done and steps_to_go(game) == 0
    game.restore(before)
    assert steps_to_go(game) == 6


def test_steps_to_go_leaves_the_game_as_it_was():
    game = _small_kitchen()
    game.step("go to fridge 1")                   # before the expert's countertop 1: progress 0
    before = copy.deepcopy(game)
    assert steps_to_go(game) == 6
    assert game == before                         # every field, the step counter included
    game.step("open fridge 1")                    # a lucky look: take, go, move remain, +3
    assert steps_to_go(game) == 3


def test_steps_to_go_looks_past_the_step_limit():
    game = _small_kitchen()                       # max_steps 8
    for command in ["go to diningtable 1", "look", "inventory", "look", "inventory"]:
        game.step(command)
    assert game.steps == 5 and steps_to_go(game) == 6   # 11 steps in all: past the limit
    assert game.max_steps == 8 and game.steps == 5


def test_a_wrong_object_at_a_closed_receptacle_is_put_down_when_all_is_seen():
    game = _small_kitchen()
    for command in ["go to diningtable 1", "go to countertop 1", "take mug 1 from countertop 1",
                    "go to fridge 1", "open fridge 1"]:
        game.step(command)
    assert steps_to_go(game) == 4                 # move the mug here, take, go, move
    game.step("close fridge 1")                   # everything seen, the mug still in hand
    assert game.expert_action() == "open fridge 1" and steps_to_go(game) == 5


def test_every_expert_step_is_progress_one():
    for seed in task_seeds("train", 40):
        game = HouseholdEnv(generate_task(seed))
        game.reset()
        distance, done = steps_to_go(game), False
        while not done:
            _, _, done, _ = game.step(game.expert_action())
            after = steps_to_go(game)
            assert distance - after == 1
            distance = after
        assert distance == 0
