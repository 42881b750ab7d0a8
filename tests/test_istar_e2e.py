"""istar.py end to end on the tiny model: the implicit PRM beside the policy, the RLOO / GRPO
baselines, checkpoints and --resume, and clean errors (exit 2, no traceback) for bad input."""

import glob
import os
import re

import pytest
import torch

from helpers import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds on 2 CPU cores; still eval -> rollouts -> step rewards -> DPO -> update -> checkpoint.
SMALL = ["--eval-num-tasks", "6", "--tasks-per-iteration", "2", "--group-size", "4",
         "--max-episode-steps", "8", "--eval-every", "1", "--save-every", "1",
         "--minibatch-size", "16"]


def run(args, tmp_path, expect=0):
    return run_script("istar.py", args, tmp_path, expect)


def scalars(run_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(run_path, "events.out.tfevents.*"))
    return EventAccumulator(events).Reload()


def adapter_weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def test_three_iterations_of_istar(tmp_path):
    out = run(["--iterations", "3", "--run-dir", str(tmp_path), *SMALL], tmp_path)
    assert "[eval test @ iter 0]" in out.stdout and "[eval test @ iter 3]" in out.stdout
    (run_path,) = glob.glob(str(tmp_path / "istar__household__istar-rloo__1__*"))
    for name in ("config.json", "summary.json", "checkpoint/adapter_config.json",
                 "checkpoint/trainer_state.pt", "checkpoint/prm/adapter_config.json"):
        assert os.path.isfile(os.path.join(run_path, name)), name
    logged = scalars(run_path)
    # Iteration 1: PRM = policy = the start, so every step reward is exactly 0 and the first
    # DPO loss is log 2; afterwards the PRM has moved.
    abs_max = [e.value for e in logged.Scalars("prm/step_reward_abs_max")]
    assert abs_max[0] == 0.0 and abs_max[1] > 0
    pairs = {e.step: e.value for e in logged.Scalars("prm/pairs")}
    losses = {e.step: e.value for e in logged.Scalars("prm/dpo_loss")}
    assert pairs[1] > 0 and losses[1] == pytest.approx(0.693147, abs=1e-6)
    assert set(losses) == {step for step, n in pairs.items() if n > 0}
    # the PRM's pairwise accuracy before each DPO step, beside the loss: chance (all ties) first
    accuracy = {e.step: e.value for e in logged.Scalars("prm/pair_accuracy_before")}
    assert set(accuracy) == set(losses) and accuracy[1] == 0.5
    assert all(0 <= a <= 1 for a in accuracy.values())
    assert re.search(r"rl 3/3 .*dpo=\S+ pair_acc=\S+", out.stdout)
    # the step term's share of |A|: 0 in iteration 1 (every r_t = 0), then > 0
    tags = logged.Tags()["scalars"]
    shares = [e.value for tag in ("credit/step_share_uniform", "credit/step_share_mixed")
              if tag in tags for e in logged.Scalars(tag)]
    assert shares and all(v >= 0 for v in shares) and max(shares) > 0
    assert "credit/abs_share_uniform" in tags
    assert all(e.value > 0 for e in logged.Scalars("prm/grad_norm"))
    iteration = [e.value for e in logged.Scalars("time/iteration_seconds")]
    parts = [[e.value for e in logged.Scalars(f"time/{part}_seconds")] for part in
             ("prompts", "generation", "env", "old_logprobs", "prm_logprobs", "advantages",
              "update")]
    for k in range(3):  # the breakdown of each iteration fits inside it
        assert sum(p[k] for p in parts) <= iteration[k]
    prm, policy = (adapter_weights(os.path.join(run_path, "checkpoint", sub))
                   for sub in ("prm", ""))
    assert prm.keys() == policy.keys()
    assert any(not torch.equal(prm[k], policy[k]) for k in prm)


@pytest.mark.parametrize("advantage", ["rloo", "grpo"])
def test_baselines_train_no_prm(advantage, tmp_path):
    out = run(["--iterations", "1", "--advantage", advantage, "--run-dir", str(tmp_path), *SMALL],
              tmp_path)
    assert "rl 1/1" in out.stdout and "dpo=" not in out.stdout  # no PRM step to show
    (run_path,) = glob.glob(str(tmp_path / f"istar__household__{advantage}__1__*"))
    assert not os.path.exists(os.path.join(run_path, "checkpoint", "prm"))
    tags = scalars(run_path).Tags()["scalars"]
    assert "prm/pairs" not in tags and not any(t.startswith("credit/") for t in tags)


def test_resumed_run_gives_the_same_numbers_as_one_run(tmp_path):
    """3 iterations in one go, and 2 + --resume (the PRM and its optimizer reloaded), end with
    the same evaluation and bit-identical policy and PRM adapters."""
    whole = run(["--iterations", "3", "--run-dir", str(tmp_path / "whole"), *SMALL], tmp_path)
    run(["--iterations", "2", "--run-dir", str(tmp_path / "split"), *SMALL], tmp_path)
    (whole_path,) = glob.glob(str(tmp_path / "whole" / "*"))
    (split_path,) = glob.glob(str(tmp_path / "split" / "*"))
    resumed = run(["--resume", split_path, "--iterations", "3"], tmp_path)
    assert "at iteration 2" in resumed.stdout
    final = [re.search(r"\[eval test @ iter 3\].*success (\S+) grounding (\S+) \(([^)]*)\)",
                       o.stdout).groups()
             for o in (whole, resumed)]
    assert final[0] == final[1]
    for sub in ("", "prm"):
        a, b = (adapter_weights(os.path.join(p, "checkpoint", sub))
                for p in (whole_path, split_path))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_without_the_prm_is_a_clear_error(tmp_path):
    run(["--iterations", "1", "--run-dir", str(tmp_path), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "*"))
    os.remove(os.path.join(run_path, "checkpoint", "prm", "adapter_config.json"))
    with open(os.path.join(run_path, "config.json")) as f:
        config = f.read()
    result = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
    assert "prm/adapter_config.json is missing" in result.stderr  # its checksum names it
    assert "Traceback" not in result.stderr
    os.remove(os.path.join(run_path, "checkpoint", "checksums.json"))  # a checkpoint before them
    state_file = os.path.join(run_path, "checkpoint", "trainer_state.pt")
    state = torch.load(state_file, weights_only=False)
    del state["base_weights"]
    torch.save(state, state_file)
    result = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
    assert "no checkpoint/prm/" in result.stderr and "Traceback" not in result.stderr
    with open(os.path.join(run_path, "config.json")) as f:  # a failed resume is not recorded
        assert f.read() == config


def test_help_lists_the_flags(tmp_path):
    out = run(["--help"], tmp_path).stdout
    for flag in ("--advantage", "--estimator", "--step-weight", "--beta", "--traj-agg",
                 "--step-reward-scale", "--prm-learning-rate", "--prm-max-grad-norm", "--use-std",
                 "--bc-epochs", "--resume"):
        assert flag in out


@pytest.mark.parametrize("argv, message", [
    (["--beta", "0"], "--beta must be > 0"),
    (["--success-reward", "-10"], "--success-reward must be > 0"),
    (["--step-weight", "-1"], "--step-weight must be >= 0"),
    (["--prm-learning-rate", "0"], "--prm-learning-rate must be > 0"),
    (["--prm-learning-rate=-5e-4"], "--prm-learning-rate must be > 0"),
    (["--advantage", "rloo", "--learning-rate=-1e-3"], "--learning-rate must be in (0, 1]"),
    (["--prm-max-grad-norm", "inf"], "--prm-max-grad-norm must be finite"),
    (["--estimator", "ppo"], "--estimator"),
    (["--traj-agg", "median"], "--traj-agg"),
    (["--env", "alfworld", "--model", "tiny"], "--model tiny knows only the household's words"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
])
def test_bad_input_is_a_clear_error(argv, message, tmp_path):
    """Rejected before any work: no run directory."""
    result = run([*argv, "--run-dir", str(tmp_path / "runs")], tmp_path, expect=2)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_istar_on_grpo_with_the_literal_eq2_and_no_rescaling(tmp_path):
    out = run(["--iterations", "2", "--estimator", "grpo", "--traj-agg", "sum",
               "--step-reward-scale", "none", "--no-use-std", "--run-dir", str(tmp_path),
               *SMALL], tmp_path)
    assert "rl 2/2" in out.stdout
    (run_path,) = glob.glob(str(tmp_path / "istar__household__istar-grpo__1__*"))
    assert scalars(run_path).Scalars("prm/step_reward_abs_max")[1].value > 0
