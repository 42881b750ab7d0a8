"""sspo.py end to end on the tiny model: the search with post-step updates, the GRPO baseline
(proxmo.py's numbers), the ablations, checkpoints and --resume, and clean errors (exit 2, no
traceback) for bad input."""

import glob
import os
import re
import sys

import pytest
import torch

from helpers import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds on 2 CPU cores; still eval -> search rounds with updates -> eval -> checkpoint.
HARNESS = ["--eval-num-tasks", "6", "--tasks-per-iteration", "2", "--max-episode-steps", "6",
           "--eval-every", "1", "--save-every", "1"]
SMALL = [*HARNESS, "--generations-per-task", "24", "--max-rollouts", "4"]


def run(args, tmp_path, script="sspo.py", expect=0):
    return run_script(script, args, tmp_path, expect)


def scalars(run_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(os.path.join(run_path, "events.out.tfevents.*"))
    return EventAccumulator(events).Reload()


def adapter_weights(run_path):
    from safetensors.torch import load_file

    return load_file(os.path.join(run_path, "checkpoint", "adapter_model.safetensors"))


def test_two_iterations_then_resume_match_one_run(tmp_path):
    """2 iterations in one go log the search's counters; 1 + --resume (the state table and the
    random streams reloaded) ends with the same evaluation, table and adapter bits."""
    whole = run(["--iterations", "2", "--run-dir", str(tmp_path / "whole"), *SMALL], tmp_path)
    assert "[eval test @ iter 0]" in whole.stdout and "[eval test @ iter 2]" in whole.stdout
    (whole_path,) = glob.glob(str(tmp_path / "whole" / "sspo__household__sspo__1__*"))
    logged = scalars(whole_path)
    for name in ("sspo/states_tracked", "sspo/mean_score", "sspo/rollouts_per_step",
                 "sspo/truncated_share", "sspo/paths", "sspo/t", "train/loss"):
        assert len(logged.Scalars(name)) == 2, name
    tracked = [e.value for e in logged.Scalars("sspo/states_tracked")]
    paths = [e.value for e in logged.Scalars("sspo/paths")]
    t = [e.value for e in logged.Scalars("sspo/t")]
    assert 0 < tracked[0] <= tracked[1] and t == [1 + paths[0], 1 + paths[0] + paths[1]]
    assert 0 < logged.Scalars("sspo/rollouts_per_step")[0].value <= 4
    assert logged.Scalars("sspo/updates")[0].value >= 1
    for name in ("sspo/score_difference_varies", "sspo/trained_w", "rollout/episode_length"):
        assert 0 <= logged.Scalars(name)[1].value, name
    # benchmarks/sspo_scores.py reads the run: one row, iterations 1-2 averaged
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from sspo_scores import main as scores_table

    row = scores_table([str(tmp_path / "whole"), "--first", "1", "--last", "2"]).split("\n")[2]
    assert row.startswith("| whole | ") and row.count(" | ") == 8
    run(["--iterations", "1", "--run-dir", str(tmp_path / "split"), *SMALL], tmp_path)
    (split_path,) = glob.glob(str(tmp_path / "split" / "*"))
    resumed = run(["--resume", split_path, "--iterations", "2"], tmp_path)
    assert "at iteration 1" in resumed.stdout
    final = [re.search(r"\[eval test @ iter 2\].*", o.stdout).group() for o in (whole, resumed)]
    assert [re.sub(r"\[\d+s\]", "", f) for f in final[:1]] == [
        re.sub(r"\[\d+s\]", "", f) for f in final[1:]]
    states = [torch.load(os.path.join(p, "checkpoint", "trainer_state.pt"),
                         weights_only=False)["table"] for p in (whole_path, split_path)]
    assert states[0] == states[1] and states[0]["t"] == t[1]
    a, b = adapter_weights(whole_path), adapter_weights(split_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_grpo_baseline_is_proxmos(tmp_path):
    """--advantage grpo plays and updates as proxmo.py --advantage grpo, at its learning rate
    (sspo.py's preset for grpo): the same adapter."""
    flags = ["--iterations", "1", "--advantage", "grpo", "--group-size", "3", *HARNESS]
    run([*flags, "--run-dir", str(tmp_path / "sspo")], tmp_path)
    run([*flags, "--run-dir", str(tmp_path / "proxmo")], tmp_path, script="proxmo.py")
    (mine,), (theirs,) = (glob.glob(str(tmp_path / d / "*")) for d in ("sspo", "proxmo"))
    a, b = adapter_weights(mine), adapter_weights(theirs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ablations_run(tmp_path):
    """Every ablation flag of the paper's Table 2 at once, and states shared across tasks.
    Without backtracking a search never runs out of states, and with uniform rollouts every
    expansion samples K_max = 4: each of the 2 tasks uses its 24 actions exactly (8 finished
    paths would need more than the 6 expansions a 6-step path takes)."""
    run(["--iterations", "1", "--no-novelty-reward", "--fixed-novelty-weight", "0.25",
         "--uniform-rollouts", "--no-backtracking", "--share-states-across-tasks",
         "--no-use-std", "--run-dir", str(tmp_path), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "*"))
    logged = scalars(run_path)
    assert logged.Scalars("rollout/step_samples")[0].value == 2 * 24
    assert logged.Scalars("sspo/rollouts_per_step")[0].value == 4


def test_help_lists_the_flags(tmp_path):
    out = run(["--help"], tmp_path).stdout
    for flag in ("--advantage", "--score-alpha", "--fail-threshold", "--success-threshold",
                 "--novelty-decay", "--max-rollouts", "--step-invalid-penalty", "--max-paths",
                 "--generations-per-task", "--share-states-across-tasks", "--novelty-reward",
                 "--score-difference-reward", "--fixed-novelty-weight", "--uniform-rollouts",
                 "--backtracking", "--resume"):
        assert flag in out, flag


@pytest.mark.parametrize("argv, message", [
    (["--max-rollouts", "0"], "--max-rollouts must be >= 1"),
    (["--fixed-novelty-weight", "0.7"], "--fixed-novelty-weight must be in [0, 0.5]"),
    (["--success-threshold", "1.5"], "--success-threshold must be in [0, 1]"),
    (["--score-alpha", "nan"], "--score-alpha must be finite"),
    (["--generations-per-task", "0"], "--generations-per-task must be >= 1"),
    (["--advantage", "gigpo"], "gigpo"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--env", "alfworld", "--model", "tiny"], "--model tiny knows only the household's words"),
])
def test_bad_input_is_a_clear_error(argv, message, tmp_path):
    """Rejected before any work: no run directory."""
    result = run([*argv, "--run-dir", str(tmp_path / "runs")], tmp_path, expect=2)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()
