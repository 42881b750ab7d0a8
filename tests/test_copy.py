"""A script copied out of the repository, as the README says: the script, common/, envs/ and the
shared start in assets/ beside each other in an empty folder run one tiny iteration; without
the asset, the error says what to copy where."""

import os
import shutil
import subprocess
import sys

import pytest

from helpers import script_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--iterations", "1", "--eval-num-tasks", "2", "--tasks-per-iteration", "2",
        "--group-size", "2", "--max-episode-steps", "4", "--minibatch-size", "8"]


def copy_out(script: str, folder, asset: bool = True) -> None:
    shutil.copy(os.path.join(ROOT, script), folder)
    for package in ("common", "envs"):
        shutil.copytree(os.path.join(ROOT, package), folder / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    if asset:
        shutil.copytree(os.path.join(ROOT, "assets", "tiny-household"),
                        folder / "assets" / "tiny-household")


@pytest.mark.parametrize("script", ["proxmo.py", "istar.py"])
def test_a_copied_script_runs_on_its_own(script, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    copy_out(script, mine)
    result = subprocess.run([sys.executable, script, *TINY, "--run-dir", str(mine / "runs")],
                            cwd=mine, env=script_env(tmp_path), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "done: test success" in result.stdout
    assert os.listdir(mine / "runs")


def test_a_copy_without_the_asset_says_what_to_copy_where(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    copy_out("proxmo.py", mine, asset=False)
    result = subprocess.run([sys.executable, "proxmo.py", *TINY], cwd=mine,
                            env=script_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    wanted = os.path.join(str(mine), "assets", "tiny-household")
    assert f"copy the repository's assets/tiny-household/ to {wanted}" in result.stderr
