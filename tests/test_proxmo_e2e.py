"""proxmo.py end to end on the tiny model: the CLI, every --advantage, checkpoints and --resume,
and clean errors (exit 2, no traceback) for bad input."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small enough for seconds on 2 CPU cores; still BC -> eval -> rollouts -> update -> eval -> checkpoint.
SMALL = ["--bc-num-tasks", "8", "--bc-epochs", "1", "--eval-num-tasks", "6", "--tasks-per-iteration", "2",
         "--group-size", "3", "--max-episode-steps", "6", "--eval-every", "1", "--save-every", "1",
         "--minibatch-size", "16"]


def run(args, tmp_path, expect=0):
    env = dict(os.environ, HF_HUB_OFFLINE="1", ALFWORLD_DATA=str(tmp_path / "no_alfworld"))
    result = subprocess.run([sys.executable, "proxmo.py", *args], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("advantage", ["proxmo", "grpo", "gigpo"])
def test_two_iterations_then_resume(advantage, tmp_path):
    out = run(["--advantage", advantage, "--iterations", "2", "--run-dir", str(tmp_path), *SMALL], tmp_path)
    assert "[eval test @ iter 0]" in out.stdout and "[eval test @ iter 2]" in out.stdout
    (run_path,) = glob.glob(str(tmp_path / f"proxmo__household__{advantage}__1__*"))
    for name in ("checkpoint/adapter_config.json", "checkpoint/trainer_state.pt", "bc_model/config.json"):
        assert os.path.isfile(os.path.join(run_path, name)), name
    assert glob.glob(os.path.join(run_path, "events.out.tfevents.*"))
    if advantage != "proxmo":
        return
    resumed = run(["--resume", run_path, "--iterations", "3", *SMALL], tmp_path)
    assert "resumed from" in resumed.stdout and "at iteration 2" in resumed.stdout
    assert "[eval test @ iter 3]" in resumed.stdout and "[eval test @ iter 1]" not in resumed.stdout


def test_same_seed_same_run(tmp_path):
    outs = [run(["--iterations", "1", "--run-dir", str(tmp_path / str(k)), *SMALL], tmp_path).stdout
            for k in range(2)]
    evals = [re.findall(r"\[eval test @ iter (\d+)\] success (\S+) grounding (\S+) \(([^)]*)\)", o) for o in outs]
    assert len(evals[0]) == 2 and evals[0] == evals[1]
    losses = [re.findall(r"final loss (\S+)\)", o) for o in outs]
    assert losses[0] and losses[0] == losses[1]


def test_help_lists_the_flags(tmp_path):
    out = run(["--help"], tmp_path).stdout
    for flag in ("--advantage", "--psc-alpha", "--proximity-temperature", "--bc-epochs", "--backend", "--resume"):
        assert flag in out


@pytest.mark.parametrize("argv, message", [
    (["--env", "webshop"], "webshop"),
    (["--model", "Qwen-no-such-model-0B", "--bc-epochs", "0"], "cannot load model"),
    (["--env", "alfworld"], "alfworld-download"),
    (["--backend", "vllm", "--device", "cpu"], "needs a CUDA GPU"),
    (["--resume", "/nonexistent/run"], "no checkpoint"),
    (["--rollout-temperature", "0"], "must be > 0"),
])
def test_bad_input_is_a_clear_error(argv, message, tmp_path):
    result = run([*argv, "--run-dir", str(tmp_path)], tmp_path, expect=2)
    assert message in result.stderr and "Traceback" not in result.stderr


def test_unknown_flag_is_rejected(tmp_path):
    result = run(["--no-such-flag", "1"], tmp_path, expect=2)
    assert "Traceback" not in result.stderr
