"""Nothing lost, nothing silently wrong: a run killed at any moment, a save included, resumes to
exactly where an uninterrupted run ends; a run directory belongs to one run; a disk that fills
during a save stops the run with one line and the last checkpoint intact; bad input is one line
and exit status 2 before any work, leaving no directory."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from helpers import run_script, script_env  # noqa: E402
from learning import training_curve  # noqa: E402

SMALL = ["--eval-num-tasks", "4", "--tasks-per-iteration", "2", "--group-size", "2",
         "--max-episode-steps", "5", "--eval-every", "1", "--save-every", "1",
         "--minibatch-size", "8"]
# proxmo.py, with torch.save changed for the save of iteration HOLD_AT: "hold" writes half of
# trainer_state.pt (the adapter is already written), says so in a file and waits to be killed;
# "full" fails as torch.save failed on a full tmpfs (seen: a RuntimeError that names no cause);
# "enospc" as a plain write does.
WRAPPER = """
import errno, os, runpy, sys, time
import torch
save, mode, at, said = torch.save, *os.environ["HOLD"].split(":")
def held(obj, file, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("iteration") == int(at):
        if mode == "full":
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 "
                               "vs 534")
        if mode == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        save(obj, file, *args, **kwargs)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
        open(said, "w").close()
        time.sleep(600)
    return save(obj, file, *args, **kwargs)
torch.save = held
sys.argv = ["proxmo.py", *sys.argv[1:]]
runpy.run_path("proxmo.py", run_name="__main__")
"""


def run(args, tmp_path, expect=0, script="proxmo.py"):
    return run_script(script, args, tmp_path, expect)


def scalars(run_path: str) -> dict:
    """Every logged scalar but timings, as TensorBoard reads the run: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_path, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag))
            for tag in events.Tags()["scalars"]
            if not tag.startswith("time/") and "per_second" not in tag}


def test_a_kill_during_a_save_resumes_to_the_uninterrupted_run(tmp_path):
    """Killed (SIGKILL) while trainer_state.pt of iteration 2 is half written, after its adapter:
    the run's checkpoint is still iteration 1's, a resume while the run is still going is
    refused, and --resume after the kill ends with the uninterrupted run's adapter bytes, logged
    numbers, evaluations and training curve (one point per iteration)."""
    whole = run(["--iterations", "3", "--run-dir", str(tmp_path / "whole"), *SMALL], tmp_path)
    said = tmp_path / "holding"
    held = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, "--iterations", "3", "--run-dir",
         str(tmp_path / "killed"), *SMALL], cwd=ROOT,
        env=script_env(tmp_path, HOLD=f"hold:2:{said}"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if said.exists() or held.poll() is not None:
                break
            time.sleep(0.5)
        assert said.exists(), "the wrapped run never reached the save of iteration 2"
        (killed_path,) = glob.glob(str(tmp_path / "killed" / "*"))
        busy = run(["--resume", killed_path], tmp_path, expect=2)
        assert "still going" in busy.stderr and "Traceback" not in busy.stderr
    finally:
        held.send_signal(signal.SIGKILL)
        held.wait()
    assert os.readlink(os.path.join(killed_path, "checkpoint")) == "checkpoint-1"
    resumed = run(["--resume", killed_path], tmp_path)
    assert "at iteration 1" in resumed.stdout
    with open(os.path.join(killed_path, "config.json")) as f:
        (resume,) = json.load(f)["resumed_by"]  # the resume's own command, commit, torch, threads
    assert resume["command"].endswith(f"--resume {killed_path}") and resume["commit"]
    assert sorted(p for p in os.listdir(killed_path) if p.startswith("checkpoint")) == [
        "checkpoint", "checkpoint-3"]
    (whole_path,) = glob.glob(str(tmp_path / "whole" / "*"))
    a, b = (load_file(os.path.join(p, "checkpoint", "adapter_model.safetensors"))
            for p in (whole_path, killed_path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summaries = [json.load(open(os.path.join(p, "summary.json"))) for p in (whole_path,
                                                                             killed_path)]
    assert summaries[0]["evaluations"] == summaries[1]["evaluations"]
    assert scalars(whole_path) == scalars(killed_path)
    assert len(training_curve(killed_path)) == 3
    assert training_curve(killed_path) == training_curve(whole_path)
    final = [re.search(r"\[eval test @ iter 3\].*", o.stdout).group() for o in (whole, resumed)]
    assert final[0].split("(")[0] == final[1].split("(")[0]


@pytest.mark.parametrize("mode, says", [("full", "RuntimeError: [enforce fail"),
                                        ("enospc", "No space left on device")])
def test_a_full_disk_during_a_save_stops_with_one_line_and_the_last_checkpoint(mode, says,
                                                                              tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", WRAPPER, "--iterations", "2", "--run-dir", str(tmp_path), *SMALL],
        cwd=ROOT, env=script_env(tmp_path, HOLD=f"{mode}:2:-"), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "the checkpoint could not be written" in result.stderr and says in result.stderr
    assert "bytes free there" in result.stderr
    (run_path,) = glob.glob(str(tmp_path / "*"))
    assert sorted(p for p in os.listdir(run_path) if p.startswith("checkpoint")) == [
        "checkpoint", "checkpoint-1"]
    assert os.readlink(os.path.join(run_path, "checkpoint")) == "checkpoint-1"
    state = torch.load(os.path.join(run_path, "checkpoint", "trainer_state.pt"),
                       weights_only=False)
    assert state["iteration"] == 1


def test_two_runs_started_in_one_second_get_a_directory_each(tmp_path, monkeypatch):
    import common.run
    import proxmo

    monkeypatch.setattr(common.run.time, "time", lambda: 1_000_000.0)
    args = proxmo.Args(run_dir=str(tmp_path))
    first, second = common.run.Run(args, "proxmo.py"), common.run.Run(args, "proxmo.py")
    first.open()
    second.open()
    assert os.path.basename(first.path) == "proxmo__household__proxmo__1__1000000"
    assert second.path == first.path + "-2" and os.path.isdir(second.path)
    for r in (first, second):
        r.writer.close()
        assert json.load(open(r.file("config.json")))["args"]["run_dir"] == str(tmp_path)


@pytest.mark.parametrize("make, argv, message", [
    (lambda p: p.write_text("a file"), ["--run-dir", "{p}"], "is a file, not a directory"),
    (None, ["--lora-target-modules", "nonsense"], "no module named nonsense"),
])
def test_bad_run_settings_are_refused_before_a_directory_exists(make, argv, message, tmp_path):
    target = tmp_path / "place"
    if make is not None:
        make(target)
    argv = [a.format(p=target) for a in argv]
    if "--run-dir" not in argv:
        argv += ["--run-dir", str(target)]
    result = run([*argv, "--iterations", "1", *SMALL], tmp_path, expect=2)
    assert message in result.stderr and "Traceback" not in result.stderr
    assert make is not None or not target.exists()


def test_a_damaged_run_is_refused_by_name_on_resume(tmp_path):
    """A damaged config.json, a damaged trainer_state.pt, and a run of another script: one line
    each, exit status 2."""
    run(["--iterations", "1", "--run-dir", str(tmp_path / "runs"), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "runs" / "*"))
    other = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2, script="spa.py")
    assert "a run of proxmo.py, not of spa.py" in other.stderr
    state = os.path.join(run_path, "checkpoint", "trainer_state.pt")
    with open(state, "r+b") as f:
        f.truncate(100)
    damaged = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
    assert "trainer_state.pt cannot be read" in damaged.stderr
    assert "Traceback" not in damaged.stderr
    config = os.path.join(run_path, "config.json")
    with open(config, "a") as f:
        f.write("}{")
    broken = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
    assert "config.json is damaged" in broken.stderr and "Traceback" not in broken.stderr


def test_a_save_killed_between_its_renames_resumes_from_its_whole_checkpoint(tmp_path):
    """Killed after checkpoint-1/ was renamed whole and before the link pointed to it (the link
    gone): --resume links the newest whole checkpoint-<iteration>/ and goes on; a .partial
    folder is never taken."""
    run(["--iterations", "1", "--run-dir", str(tmp_path / "runs"), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "runs" / "*"))
    os.remove(os.path.join(run_path, "checkpoint"))
    os.makedirs(os.path.join(run_path, "checkpoint-2.partial"))
    resumed = run(["--resume", run_path, "--iterations", "2"], tmp_path)
    assert "at iteration 1" in resumed.stdout
    assert os.readlink(os.path.join(run_path, "checkpoint")) == "checkpoint-2"
    assert sorted(p for p in os.listdir(run_path) if p.startswith("checkpoint")) == [
        "checkpoint", "checkpoint-2"]
