"""The ALFWorld wrapper. The missing-data path is always tested; tests that need games skip with a
reason when $ALFWORLD_DATA holds none (fetch them with `alfworld-download`)."""

import os
import subprocess
import sys

import pytest

import envs
from common import UsageError
from envs import alfworld_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_missing_data_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(UsageError) as err:
        envs.list_tasks("alfworld", "train")
    assert "alfworld-download" in str(err.value) and str(tmp_path) in str(err.value)


def test_script_exits_cleanly_without_data(tmp_path):
    env = dict(os.environ, ALFWORLD_DATA=str(tmp_path), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "proxmo.py", "--env", "alfworld", "--model", "Qwen2.5-0.5B-Instruct"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "alfworld-download" in result.stderr and "Traceback" not in result.stderr


def test_unknown_split_is_rejected():
    with pytest.raises(UsageError, match="unknown ALFWorld split"):
        alfworld_env.game_files("test")


def test_task_type_from_game_path():
    path = "/d/json_2.1.1/valid_unseen/pick_cool_then_place_in_recep-Apple-None-Fridge-1/trial_T2019/game.tw-pddl"
    assert alfworld_env.task_type_of(path) == "pick_cool_then_place_in_recep"
    path = "/d/json_2.1.1/train/pick_and_place_simple-Mug-None-Desk-308/trial_T1/game.tw-pddl"
    assert alfworld_env.task_type_of(path) == "pick_and_place_simple"
    assert set(alfworld_env.TASK_TYPES) == set(envs.TASK_TYPES)


def _games_or_skip(split):
    try:
        return alfworld_env.game_files(split)
    except UsageError:
        pytest.skip(f"no ALFWorld games under $ALFWORLD_DATA ({alfworld_env.data_root()}); run alfworld-download")


def test_expert_solves_a_game_and_invalid_commands_are_flagged():
    game_file = _games_or_skip("valid_seen")[0]
    game = alfworld_env.AlfworldEnv(game_file, max_steps=50)
    obs = game.reset()
    assert obs.startswith("You are in the middle of a room") and game.task_description
    obs, reward, done, info = game.step("fly to the moon")
    assert info["valid"] is False and reward == 0.0 and "Nothing happens" in obs
    while not done:
        obs, reward, done, info = game.step(game.expert_action())
    assert info["won"] and reward == 1.0
