"""spa.py end to end on the tiny model: exploration, the progress estimator, PPO with a critic,
the baseline and the RL-data modes, checkpoints and --resume, and clean errors (exit 2, no
traceback) for bad input."""

import glob
import json
import os
import re

import pytest
import torch

from common.run import seal_errors
from helpers import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds on 2 CPU cores; still explore -> PE -> eval -> rollouts -> update -> eval -> checkpoint.
SMALL = ["--eval-num-tasks", "6", "--tasks-per-iteration", "2", "--group-size", "3",
         "--max-episode-steps", "6", "--explore-num-tasks", "6", "--explore-rollouts", "3",
         "--eval-every", "1", "--save-every", "1", "--minibatch-size", "16"]


def run(args, tmp_path, expect=0):
    return run_script("spa.py", args, tmp_path, expect)


def explored(result) -> bool:
    """Whether the run printed exploration progress."""
    return re.search(r"^explore \d", result.stdout, re.MULTILINE) is not None


def scalars(run_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(run_path, "events.out.tfevents.*"))
    return EventAccumulator(events).Reload()


def test_two_iterations_of_spa_online(tmp_path):
    out = run(["--iterations", "2", "--rl-data", "online", "--run-dir", str(tmp_path), *SMALL,
               "--pe-heldout", "0.34"], tmp_path)
    assert re.search(r"^explore 18/18 ", out.stdout, re.MULTILINE)
    assert "12 rollouts to train on, 6 of 2 other tasks held out" in out.stdout
    assert "[eval test @ iter 0]" in out.stdout and "[eval test @ iter 2]" in out.stdout
    (run_path,) = glob.glob(str(tmp_path / "spa__household__spa__1__*"))
    for name in ("config.json", "summary.json", "checkpoint/adapter_config.json",
                 "checkpoint/trainer_state.pt", "progress_model/adapter_config.json",
                 "progress_model/head.pt"):
        assert os.path.isfile(os.path.join(run_path, name)), name
    logged = scalars(run_path)
    assert logged.Scalars("pe/rollouts")[0].value == 12
    assert logged.Scalars("pe/heldout_mse")
    iteration = [e.value for e in logged.Scalars("time/iteration_seconds")]
    parts = [[e.value for e in logged.Scalars(f"time/{part}_seconds")] for part in
             ("prompts", "generation", "env", "old_logprobs", "ref_logprobs", "progress",
              "advantages", "update")]
    for k in range(2):  # the breakdown of each iteration fits inside it
        assert all(p[k] >= 0 for p in parts) and sum(p[k] for p in parts) <= iteration[k]
    for key in ("train/value_loss", "train/explained_variance", "reward/contrib_mean",
                "reward/grounded", "reward/step_kl_mean", "eval_test/grounding_per_trajectory"):
        assert logged.Scalars(key), key
    state = torch.load(os.path.join(run_path, "checkpoint", "trainer_state.pt"),
                       weights_only=False)
    assert state["iteration"] == 2 and state["value_head"]["0.weight"].abs().sum() > 0


def test_ppo_online_trains_no_progress_estimator(tmp_path):
    out = run(["--iterations", "1", "--advantage", "ppo", "--rl-data", "online", "--run-dir",
               str(tmp_path), *SMALL], tmp_path)
    assert "progress estimator" not in out.stdout and not explored(out)
    (run_path,) = glob.glob(str(tmp_path / "spa__household__ppo__1__*"))
    assert not os.path.exists(os.path.join(run_path, "progress_model"))
    assert "rl 1/1" in out.stdout


def test_spa_and_ppo_train_on_the_same_exploration_rollouts(tmp_path):
    """--rl-data explore (default): no new rollouts; the 18 exploration rollouts make 3 batches
    of 6, and PPO (no progress estimator) trains on the same ones, batch by batch."""
    logged = {}
    for advantage in ("spa", "ppo"):
        out = run(["--iterations", "3", "--advantage", advantage, "--run-dir",
                   str(tmp_path / advantage), *SMALL], tmp_path)
        assert "rl 3/3" in out.stdout and explored(out)
        (run_path,) = glob.glob(str(tmp_path / advantage / "*"))
        assert os.path.isfile(os.path.join(run_path, "explore_rollouts.pt"))
        logged[advantage] = scalars(run_path)
        assert "time/generation_seconds" not in logged[advantage].Tags()["scalars"]
    (ppo_path,) = glob.glob(str(tmp_path / "ppo" / "*"))
    assert not os.path.exists(os.path.join(ppo_path, "progress_model"))
    for tag in ("rollout/success", "rollout/episode_length", "rollout/grounding"):
        spa_values = [e.value for e in logged["spa"].Scalars(tag)]
        assert len(spa_values) == 3
        assert spa_values == [e.value for e in logged["ppo"].Scalars(tag)], tag
    refused = run(["--iterations", "4", "--run-dir", str(tmp_path / "x"), *SMALL], tmp_path,
                  expect=2)
    assert "make 3 batches of 6, fewer than --iterations 4" in refused.stderr


def adapter_weights(run_path):
    from safetensors.torch import load_file

    return load_file(os.path.join(run_path, "checkpoint", "adapter_model.safetensors"))


def test_resumed_run_gives_the_same_numbers_as_one_run(tmp_path):
    """2 iterations in one go, and 1 + --resume (the PE reloaded, not retrained), end with the
    same evaluation and bit-identical adapter weights."""
    whole = run(["--iterations", "2", "--run-dir", str(tmp_path / "whole"), *SMALL], tmp_path)
    run(["--iterations", "1", "--run-dir", str(tmp_path / "split"), *SMALL], tmp_path)
    (whole_path,) = glob.glob(str(tmp_path / "whole" / "*"))
    (split_path,) = glob.glob(str(tmp_path / "split" / "*"))
    resumed = run(["--resume", split_path, "--iterations", "2"], tmp_path)
    assert "at iteration 1" in resumed.stdout and not explored(resumed)
    final = [re.search(r"\[eval test @ iter 2\].*success (\S+) grounding (\S+) \(([^)]*)\)",
                       o.stdout).groups()
             for o in (whole, resumed)]
    assert final[0] == final[1]
    a, b = adapter_weights(whole_path), adapter_weights(split_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_saved_progress_estimator_skips_exploration(tmp_path):
    run(["--iterations", "0", "--run-dir", str(tmp_path / "first"), *SMALL], tmp_path)
    (first,) = glob.glob(str(tmp_path / "first" / "*"))
    assert os.path.isfile(os.path.join(first, "progress_model", "head.pt"))
    assert os.path.isfile(os.path.join(first, "progress_model", "checksums.json"))  # sealed
    assert seal_errors(os.path.join(first, "progress_model")) == []
    out = run(["--iterations", "1", "--progress-model", os.path.join(first, "progress_model"),
               "--rl-data", "online", "--run-dir", str(tmp_path / "second"), *SMALL], tmp_path)
    assert not explored(out) and "rl 1/1" in out.stdout
    os.remove(os.path.join(first, "progress_model", "head.pt"))
    broken = run(["--iterations", "1", "--progress-model", os.path.join(first, "progress_model"),
                  "--rl-data", "online", "--run-dir", str(tmp_path / "third"), *SMALL], tmp_path,
                 expect=2)
    assert "no head.pt" in broken.stderr and "Traceback" not in broken.stderr


def test_help_lists_the_flags(tmp_path):
    out = run(["--help"], tmp_path).stdout
    for flag in ("--advantage", "--progress-weight", "--grounding-weight", "--grounding-form",
                 "--rl-data",
                 "--explore-rollouts", "--progress-model", "--pe-head", "--vf-coef", "--resume"):
        assert flag in out


@pytest.mark.parametrize("argv, message", [
    (["--progress-model", "/nonexistent/pe"], "--progress-model /nonexistent/pe: no such"),
    (["--progress-model", ROOT], "--rl-data explore needs the exploration rollouts"),
    (["--gae-lambda", "1.5"], "--gae-lambda must be in [0, 1]"),
    (["--explore-rollouts", "0"], "--explore-rollouts must be >= 1"),
    (["--pe-heldout", "1"], "--pe-heldout must be in [0, 1)"),
    (["--grounding-weight", "nan"], "--grounding-weight must be finite"),
    (["--env", "alfworld", "--model", "tiny"], "--model tiny knows only the household's words"),
    (["--tasks-per-iteration", "5000"], "exceeds the 4000 training tasks"),
])
def test_bad_input_is_a_clear_error(argv, message, tmp_path):
    """Rejected before any work: no exploration, no run directory."""
    result = run([*argv, "--run-dir", str(tmp_path / "runs")], tmp_path, expect=2)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not explored(result) and not (tmp_path / "runs").exists()


def test_no_rollout_fits_the_progress_estimator(tmp_path):
    result = run(["--iterations", "1", "--pe-max-tokens", "16", "--run-dir", str(tmp_path),
                  *SMALL], tmp_path, expect=2)
    assert "no exploration rollout fits --pe-max-tokens 16" in result.stderr
    assert "Traceback" not in result.stderr
    with open(glob.glob(str(tmp_path / "*" / "config.json"))[0]) as f:
        assert json.load(f)["args"]["pe_max_tokens"] == 16
