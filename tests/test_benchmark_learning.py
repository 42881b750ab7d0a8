"""benchmarks/learning.py: its statistics by hand, and the whole protocol at a tiny size (two
estimators x two seeds, a few tasks) so that the script cannot rot."""

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from learning import PROTOCOL_FLAGS, mean_and_se, table  # noqa: E402


def test_mean_and_standard_error_by_hand():
    # gains 0.02, 0.04, 0.09: mean 0.05; deviations -0.03, -0.01, 0.04; sample variance
    # (0.0009 + 0.0001 + 0.0016) / 2 = 0.0013; SE = sqrt(0.0013 / 3) = 0.020817
    mean, se = mean_and_se([0.02, 0.04, 0.09])
    assert mean == pytest.approx(0.05) and se == pytest.approx(math.sqrt(0.0013 / 3))
    mean, se = mean_and_se([0.3])
    assert mean == 0.3 and math.isnan(se)


def test_table_pairs_each_seed_start_with_its_end():
    def run(start, end, minutes):
        return {"minutes": minutes, "evaluations": {
            "0": {"eval_test/success": start, "eval_test/grounding": 0.5,
                  "eval_test/success_heat": start},
            "10": {"eval_test/success": end, "eval_test/grounding": 0.7,
                   "eval_test/success_heat": end}}}

    markdown = table("proxmo.py", "test",
                     {"proxmo": [run(0.30, 0.35, 10.0), run(0.40, 0.41, 12.0)]})
    # gains 0.05 and 0.01: mean 0.03, SE = |0.05 - 0.01| / 2 = 0.02
    assert ("| proxmo.py | proxmo | 2 | 0.350 | 0.380 | +0.030 +- 0.020 | 0.500 -> 0.700 | 11.0 |"
            in markdown)
    assert "| proxmo | heat | 0.350 | 0.380 | +0.030 +- 0.020 |" in markdown


def test_the_protocol_runs_at_a_tiny_size(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--estimators", "proxmo", "grpo",
         "--seeds", "1", "2",
         "--split", "valid", "--eval-num-tasks", "4", "--out", str(tmp_path), "--",
         "--iterations", "1", "--tasks-per-iteration", "2", "--group-size", "2",
         "--max-episode-steps", "5"],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = re.findall(r"^\| proxmo\.py \| (\w+) \| 2 \| ([\d.]+) \| ([\d.]+) \| "
                      r"([+-][\d.]+) \+- ([\d.]+) \|",
                      result.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["proxmo", "grpo"]
    for _, start, end, gain, se in rows:
        assert float(gain) == pytest.approx(float(end) - float(start), abs=1.5e-3)
    (table_file,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files
                     if f == "table.md"]
    with open(table_file) as f:
        assert " ".join(PROTOCOL_FLAGS + ["--iterations", "1"]) in f.read()
    logs = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".log")]
    assert sorted(logs) == ["grpo-seed1.log", "grpo-seed2.log", "proxmo-seed1.log",
                            "proxmo-seed2.log"]


def test_spa_runs_its_own_estimators_by_default(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--script", "spa.py", "--seeds", "1",
         "--split", "valid", "--eval-num-tasks", "3", "--out", str(tmp_path), "--",
         "--iterations", "1", "--tasks-per-iteration", "2", "--group-size", "2",
         "--max-episode-steps", "4", "--explore-num-tasks", "3", "--explore-rollouts", "2"],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = re.findall(r"^\| spa\.py \| (\w+) \| 1 \|", result.stdout, re.MULTILINE)
    assert rows == ["spa", "ppo"]
