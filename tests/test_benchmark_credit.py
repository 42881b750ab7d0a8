"""benchmarks/credit.py: its figures worked by hand, the oracle's labels on a replayed expert
game, and the whole benchmark at a tiny size, so that the script cannot rot."""

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from credit import (ESTIMATORS, FIGURES, LABELS, Batch, collect, credit_auc,  # noqa: E402
                    figures_with_se, sign_agreement, task_counts)
from common import UsageError  # noqa: E402
from common.model import add_lora, load_model_and_tokenizer  # noqa: E402
from envs import label_progress  # noqa: E402
from envs.household import HouseholdEnv, generate_task  # noqa: E402


def test_credit_auc_by_hand():
    credit, progress = [3.0, 1.0, 2.0, 2.0], [1, 0, 1, -1]
    # better steps (progress > 0): credits 3 and 2; the others: 1 and 2. Pairs: 3 > 1, 3 > 2,
    # 2 > 1, and 2 = 2 counts one half: 3.5 of 4.
    assert credit_auc(credit, progress) == 0.875
    # groups [0, 0, 1, 1]: (3 vs 1) wins, (2 vs 2) ties: 1.5 of 2 pairs, pooled
    assert credit_auc(credit, progress, groups=[0, 0, 1, 1]) == 0.75
    assert math.isnan(credit_auc([1.0, 2.0], [1, 1]))            # no step without progress
    assert math.isnan(credit_auc(credit, progress, groups=[0, 1, 2, 3]))


def test_one_credit_per_trajectory_scores_exactly_one_half_within_it():
    rng = np.random.default_rng(0)
    progress = rng.integers(-1, 2, size=60)
    trajectory = np.repeat(np.arange(6), 10)
    credit = rng.normal(size=6)[trajectory]                       # GRPO's shape of credit
    assert credit_auc(credit, progress, groups=trajectory) == 0.5
    assert credit_auc(credit, progress) != 0.5                    # across trajectories it ranks


def test_sign_agreement_by_hand():
    # agree: (+, +), (0 credit, 0 progress), (-, -1); disagree: (+, 0), (-, +1)
    assert sign_agreement([0.5, 0.0, -1.0, 0.2, -0.3], [1, 0, -1, 0, 1]) == 0.6


def test_bootstrap_over_identical_tasks_has_no_spread():
    counts = np.tile(np.array([[3, 4], [6, 10], [1, 2], [0, 0], [1, 4], [0, 0]], dtype=float),
                     (5, 1, 1))
    figures = figures_with_se(counts, resamples=50)
    assert [figures[f][0] for f in (0, 1, 2, 4)] == [0.75, 0.6, 0.5, 0.25]
    assert [figures[f][1] for f in (0, 1, 2, 4)] == pytest.approx([0.0] * 4, abs=1e-12)
    for f in (3, 5):  # no pair, no step at all
        assert math.isnan(figures[f][0]) and math.isnan(figures[f][1])


def test_a_replayed_expert_game_is_progress_one_at_every_step():
    game = HouseholdEnv(generate_task(3))
    game.reset()
    actions, seen, done = [], [], False
    while not done:
        actions.append(game.expert_action())
        obs, _, done, _ = game.step(actions[-1])
        seen.append(obs)
    progress, states = label_progress("household", 3, actions, seen, max_steps=50)
    assert progress == [1] * len(actions) and len(set(states)) == len(actions)
    with pytest.raises(RuntimeError, match="the replay of"):
        label_progress("household", 3, actions, ["something else"] + seen[1:], max_steps=50)


def test_the_benchmark_runs_at_a_tiny_size(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/credit.py", "--num-tasks", "3", "--group-size", "3",
         "--max-episode-steps", "8", "--resamples", "20", "--out", str(tmp_path),
         "--explore-tasks", "2", "--collect-tasks", "3", "--hisr-tasks", "1", "--dpo-steps", "1",
         "--dpo-tasks", "1", "--search-paths", "1"],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # progress while the batch is labelled and while 3SPO searches; no library loading bars
    assert re.search(r"^labelling \d+ steps with the oracle", result.stdout, re.MULTILINE)
    for reading in ("literal", "new"):
        assert f"3SPO search ({reading} reading), tasks 3/3" in result.stdout
    assert "Loading weights" not in result.stderr
    by_wins = re.search(r"groups by wins 0-3: (\d+) (\d+) (\d+) (\d+)\)", result.stdout)
    assert sum(int(n) for n in by_wins.groups()) == 3  # each of the 3 groups counted once
    assert sorted(os.listdir(tmp_path)) == ["credit.png", "table.md"]
    table = (tmp_path / "table.md").read_text()
    for name in ESTIMATORS:
        row = re.search(rf"^\| {re.escape(LABELS[name])} \| (.*) \|$", table, re.MULTILINE)
        cells = row.group(1).split(" | ")[:len(FIGURES)]
        for cell in cells:
            value, se = cell.split(" +- ")
            assert value == "nan" or 0 <= float(value) <= 1


def test_task_counts_of_a_hand_built_batch():
    # task 0: a won and a lost episode whose first steps leave one state; task 1: one step that
    # the estimator did not score (NaN), left out
    def steps(*valid):
        return [{"valid": v} for v in valid]
    batch = Batch(args=None, model=None, tokenizer=None,
                  trajs=[{"won": True, "steps": steps(True, True)},
                         {"won": False, "steps": steps(True, False)},
                         {"won": False, "steps": steps(False)}], tasks=[7, 7, 9],
                  task_ids=[7, 9], task_index=[0, 0, 1], progress=[[1, 0], [0, 1], [-1]],
                  same_state=[(0, [(0, 0), (1, 0)])])
    credit = [torch.tensor([2.0, 1.0]), torch.tensor([-1.0, 3.0]), torch.tensor([float("nan")])]
    counts = task_counts(batch, credit)
    # same state: 2 (progress 1) > -1 (progress 0); signs: 3 of 4 agree (step 2 of episode 0
    # has credit 1 and no progress); within: 2 > 1 and 3 > -1; within failed: episode 1 only.
    # Admissible steps alone: the same-state pair is admissible; signs: of episode 0's two steps
    # one agrees, episode 1's first (credit -1, progress 0) agrees, its second is inadmissible.
    assert counts[0].tolist() == [[1, 1], [3, 4], [2, 2], [1, 1], [1, 1], [2, 3]]
    assert counts[1].tolist() == [[0, 0]] * 6
    assert [v for v, _ in figures_with_se(counts)] == pytest.approx([1.0, 0.75, 1.0, 1.0, 1.0,
                                                                     2 / 3])


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "nan"], "--temperature must be finite and > 0"),
    (["--temperature", "inf"], "--temperature must be finite and > 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--adapter", "no-such-checkpoint"], "--adapter no-such-checkpoint: no LoRA adapter there"),
    (["--adapter", "assets/tiny-household"], "no LoRA adapter there"),
    (["--adapter", "tests"], "holds adapter_config.json"),
])
def test_bad_flags_are_refused_before_any_rollout(argv, message, tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/credit.py", *argv, "--out",
                             str(tmp_path / "out")], cwd=ROOT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_an_adapter_plays_the_batch(tmp_path):
    """--adapter folds a run's checkpoint into the start: a LoRA adapter as RL starts it (B = 0)
    plays the start's batch step for step; one with B set to 0.5 moves the weights it targets."""
    model, _ = load_model_and_tokenizer("tiny")
    adapted = add_lora(model, 8, 16, 0.0, "all-linear")
    adapted.save_pretrained(str(tmp_path / "zero"))
    for name, weight in adapted.named_parameters():
        if "lora_B" in name:
            weight.data.fill_(0.5)
    adapted.save_pretrained(str(tmp_path / "moved"))

    def actions(batch):
        return [[s["action"] for s in t["steps"]] for t in batch.trajs]

    start = collect(2, 2, seed=1, max_episode_steps=6)
    zero = collect(2, 2, seed=1, max_episode_steps=6, adapter=str(tmp_path / "zero"))
    assert actions(zero) == actions(start) and zero.progress == start.progress
    moved = collect(2, 2, seed=1, max_episode_steps=6, adapter=str(tmp_path / "moved"))
    before = dict(start.model.named_parameters())
    after = dict(moved.model.named_parameters())
    assert sorted(after) == sorted(before)  # folded in: no adapter left
    changed = {n for n in before if not torch.equal(after[n], before[n])}
    linear = {n for n in before if n.endswith("proj.weight")}  # all-linear's targets
    assert len(linear) == 14 and changed == linear
    assert actions(moved) != actions(start)
    # an adapter that trained on other weights (its trainer_state.pt says which) is refused
    torch.save({"base_weights": "0" * 64}, tmp_path / "moved" / "trainer_state.pt")
    with pytest.raises(UsageError, match="trained on other weights than --model tiny"):
        collect(2, 2, seed=1, max_episode_steps=6, adapter=str(tmp_path / "moved"))
    # one whose trainer_state.pt is damaged: named with its error's type and first line
    (tmp_path / "moved" / "trainer_state.pt").write_bytes(b"not a torch file")
    with pytest.raises(UsageError, match=r"trainer_state.pt cannot be read \(\w+Error: \S"):
        collect(2, 2, seed=1, max_episode_steps=6, adapter=str(tmp_path / "moved"))


def test_an_out_that_cannot_be_written_is_refused_before_the_work(tmp_path):
    """--out under a file: one line, exit status 2, before any rollout (on ALFWorld the work
    before the table is 88 minutes)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = subprocess.run([sys.executable, "benchmarks/credit.py", "--out",
                             str(blocked / "out")], cwd=ROOT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 2 and "cannot write there" in result.stderr
    assert "Traceback" not in result.stderr and "labelling" not in result.stdout
