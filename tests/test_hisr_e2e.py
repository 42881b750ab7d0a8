"""hisr.py end to end on the tiny model: collection, the SPRM and the hindsight model, PPO with a
critic, the baseline and the ablations, checkpoints and --resume, and clean errors (exit 2, no
traceback) for bad input."""

import glob
import os
import re

import pytest
import torch

from common.run import seal_errors
from helpers import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds on 2 CPU cores; still collect -> SPRM -> hindsight -> eval -> rollouts -> update ->
# eval -> checkpoint.
SMALL = ["--eval-num-tasks", "6", "--tasks-per-iteration", "2", "--group-size", "3",
         "--max-episode-steps", "6", "--collect-num-tasks", "6", "--collect-rollouts", "3",
         "--eval-every", "1", "--save-every", "1", "--minibatch-size", "16"]


def run(args, tmp_path, expect=0):
    return run_script("hisr.py", args, tmp_path, expect)


def collected(result) -> bool:
    """Whether the run printed collection progress."""
    return re.search(r"^collect \d", result.stdout, re.MULTILINE) is not None


def scalars(run_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(run_path, "events.out.tfevents.*"))
    return EventAccumulator(events).Reload()


def test_two_iterations_of_hisr(tmp_path):
    out = run(["--iterations", "2", "--run-dir", str(tmp_path), *SMALL, "--aux-heldout", "0.34"],
              tmp_path)
    assert re.search(r"^collect 18/18 ", out.stdout, re.MULTILINE)
    assert re.search(r"held out \(6 rollouts, unfiltered; 0 too long for the SPRM\): SPRM AUC "
                     r"\S+, MSE \S+ \(a constant: \S+\)\n  held out: hindsight NLL per token "
                     r"\S+ \(the policy: \S+\)", out.stdout)
    assert "[eval test @ iter 0]" in out.stdout and "[eval test @ iter 2]" in out.stdout
    (run_path,) = glob.glob(str(tmp_path / "hisr__household__hisr__1__*"))
    for name in ("config.json", "summary.json", "checkpoint/adapter_config.json",
                 "checkpoint/trainer_state.pt", "reward_models/sprm/model.pt",
                 "reward_models/sprm/head.pt", "reward_models/hindsight/model.pt"):
        assert os.path.isfile(os.path.join(run_path, name)), name
    logged = scalars(run_path)
    kept = logged.Scalars("collect/kept_share")[0].value
    assert 0 < kept <= 1
    held_tasks = 2  # a third of the 6 collected tasks, 3 rollouts each, all kept for the fit
    assert logged.Scalars("sprm/trajectories")[0].value <= 18 - 3 * held_tasks
    iteration = [e.value for e in logged.Scalars("time/iteration_seconds")]
    parts = [[e.value for e in logged.Scalars(f"time/{part}_seconds")] for part in
             ("prompts", "generation", "env", "old_logprobs", "ref_logprobs", "sprm",
              "hindsight", "advantages", "update")]
    for k in range(2):  # the breakdown of each iteration fits inside it
        assert all(p[k] >= 0 for p in parts) and sum(p[k] for p in parts) <= iteration[k]
    for key in ("train/value_loss", "train/explained_variance", "credit/sprm_inputs_cut",
                "credit/hindsight_inputs_cut", "reward/step_kl_mean", "sprm/heldout_mse",
                "sprm/heldout_auc", "hindsight/heldout_nll_hindsight",
                "hindsight/heldout_nll_start_policy"):
        assert logged.Scalars(key), key
    assert logged.Scalars("collect/segments_per_trajectory")[0].value >= 1
    state = torch.load(os.path.join(run_path, "checkpoint", "trainer_state.pt"),
                       weights_only=False)
    assert state["iteration"] == 2 and state["value_head"]["0.weight"].abs().sum() > 0


def test_ppo_baseline_trains_no_reward_models(tmp_path):
    out = run(["--iterations", "1", "--advantage", "ppo", "--run-dir", str(tmp_path), *SMALL],
              tmp_path)
    assert "reward models" not in out.stdout and not collected(out)
    (run_path,) = glob.glob(str(tmp_path / "hisr__household__ppo__1__*"))
    assert not os.path.exists(os.path.join(run_path, "reward_models"))
    assert "rl 1/1" in out.stdout


@pytest.mark.parametrize("ablation", [["--no-use-hindsight", "--segmenter", "turns",
                                       "--reasoning", "--collect-filter", "none"],
                                      ["--him-scale", "unit", "--grounding-form", "eq8"]])
def test_ablations_run(tmp_path, ablation):
    out = run(["--iterations", "1", "--run-dir", str(tmp_path), *SMALL, *ablation], tmp_path)
    assert "rl 1/1" in out.stdout
    (run_path,) = glob.glob(str(tmp_path / "*"))
    logged = scalars(run_path)
    # The tiny model never reasons, so no reply is well formed under --reasoning: the default
    # filter would keep none, --collect-filter none keeps all. (One segment a turn, and z = 1
    # w/o HIM: test_hisr_model.py.)
    if "turns" in ablation:
        assert logged.Scalars("collect/kept_share")[0].value == 1.0
    if "--no-use-hindsight" in ablation:  # w/o HIM: no hindsight model is trained
        assert not os.path.exists(os.path.join(run_path, "reward_models", "hindsight"))
        assert "hindsight/heldout_nll_hindsight" not in logged.Tags()["scalars"]
    else:
        assert os.path.isfile(os.path.join(run_path, "reward_models", "hindsight", "model.pt"))


def adapter_weights(run_path):
    from safetensors.torch import load_file

    return load_file(os.path.join(run_path, "checkpoint", "adapter_model.safetensors"))


def test_resumed_run_gives_the_same_numbers_as_one_run(tmp_path):
    """2 iterations in one go, and 1 + --resume (the reward models reloaded, not retrained), end
    with the same evaluation and bit-identical adapter weights."""
    whole = run(["--iterations", "2", "--run-dir", str(tmp_path / "whole"), *SMALL], tmp_path)
    run(["--iterations", "1", "--run-dir", str(tmp_path / "split"), *SMALL], tmp_path)
    (whole_path,) = glob.glob(str(tmp_path / "whole" / "*"))
    (split_path,) = glob.glob(str(tmp_path / "split" / "*"))
    resumed = run(["--resume", split_path, "--iterations", "2"], tmp_path)
    assert "at iteration 1" in resumed.stdout and not collected(resumed)
    final = [re.search(r"\[eval test @ iter 2\].*success (\S+) grounding (\S+) \(([^)]*)\)",
                       o.stdout).groups()
             for o in (whole, resumed)]
    assert final[0] == final[1]
    a, b = adapter_weights(whole_path), adapter_weights(split_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_saved_reward_models_skip_collection(tmp_path):
    run(["--iterations", "0", "--run-dir", str(tmp_path / "first"), *SMALL], tmp_path)
    (first,) = glob.glob(str(tmp_path / "first" / "*"))
    saved = os.path.join(first, "reward_models")
    assert os.path.isfile(os.path.join(saved, "checksums.json")) and seal_errors(saved) == []
    out = run(["--iterations", "1", "--reward-models", saved, "--run-dir",
               str(tmp_path / "second"), *SMALL], tmp_path)
    assert not collected(out) and "rl 1/1" in out.stdout
    # w/o HIM reads the SPRM alone and saves no hindsight model of its own.
    out = run(["--iterations", "1", "--reward-models", saved, "--no-use-hindsight", "--run-dir",
               str(tmp_path / "no-him"), *SMALL], tmp_path)
    assert not collected(out) and "rl 1/1" in out.stdout
    wrong = run(["--iterations", "1", "--reward-models", saved, "--segmenter", "turns",
                 "--run-dir", str(tmp_path / "third"), *SMALL], tmp_path, expect=2)
    assert "were trained with --segmenter 'events'" in wrong.stderr
    assert "Traceback" not in wrong.stderr


def test_help_lists_the_flags(tmp_path):
    out = run(["--help"], tmp_path).stdout
    for flag in ("--advantage", "--segmenter", "--use-hindsight", "--importance-beta",
                 "--grounding-weight", "--him-scale", "--collect-rollouts", "--reward-models",
                 "--aux-max-tokens", "--resume", "--collect-filter", "--grounding-form"):
        assert flag in out


@pytest.mark.parametrize("argv, message", [
    (["--reward-models", "/nonexistent/rm"], "--reward-models /nonexistent/rm: no such"),
    (["--advantage", "ppo", "--reward-models", ROOT], "--reward-models is read by --advantage"),
    (["--grounding-weight", "1.5"], "--grounding-weight must be in [0, 1]"),
    (["--importance-beta", "0"], "--importance-beta must be > 0"),
    (["--collect-rollouts", "0"], "--collect-rollouts must be >= 1"),
    (["--aux-heldout", "1"], "--aux-heldout must be in [0, 1)"),
    (["--segmenter", "gpt4o"], "gpt4o"),
    (["--importance-beta", "nan"], "--importance-beta must be finite"),
    (["--env", "alfworld", "--model", "tiny"], "--model tiny knows only the household's words"),
])
def test_bad_input_is_a_clear_error(argv, message, tmp_path):
    """Rejected before any work: no collection, no run directory."""
    result = run([*argv, "--run-dir", str(tmp_path / "runs")], tmp_path, expect=2)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not collected(result) and not (tmp_path / "runs").exists()


def test_no_transcript_fits_the_reward_models(tmp_path):
    result = run(["--iterations", "1", "--aux-max-tokens", "64", "--run-dir", str(tmp_path),
                  *SMALL], tmp_path, expect=2)
    assert "no collected trajectory fits --aux-max-tokens 64" in result.stderr
    assert "Traceback" not in result.stderr
