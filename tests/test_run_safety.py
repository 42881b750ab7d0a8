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
import shutil
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
    assert os.path.basename(first.path) == "proxmo__household__proxmo__1__19700112-134640"  # UTC
    assert second.path == first.path + "-2" and os.path.isdir(second.path)
    for r in (first, second):
        r.writer.close()
        assert json.load(open(r.file("config.json")))["args"]["run_dir"] == str(tmp_path)


@pytest.mark.parametrize("make, argv, message", [
    (lambda p: p.write_text("a file"), ["--run-dir", "{p}"], "is a file, not a directory"),
    (None, ["--lora-target-modules", "nonsense"], "no module named nonsense"),
    (None, ["--exp-name", "../../escaped"], "a name, not a path"),
    # Values no machine can run: refused before work, not as an overflow or allocation error.
    (None, ["--learning-rate", "1e308"], "--learning-rate must be in (0, 1]"),
    (None, ["--group-size", "1000000000"], "--group-size must be in [1, 1024]"),
    (None, ["--max-new-tokens", "1000000000"], "--max-new-tokens must be in [1, 32768]"),
    (None, ["--lora-r", "100000000"], "--lora-r must be in [1, 1024]"),
    (None, ["--process-timeout-minutes", "1e13"], "--process-timeout-minutes must be in"),
    (None, ["--process-timeout-minutes", "inf"], "--process-timeout-minutes must be finite"),
])
def test_bad_run_settings_are_refused_before_a_directory_exists(make, argv, message, tmp_path):
    target = tmp_path / "place"
    if make is not None:
        make(target)
    argv = [a.format(p=target) for a in argv]
    if "--run-dir" not in argv:
        argv += ["--run-dir", str(target)]
    result = run(["--iterations", "1", *SMALL, *argv], tmp_path, expect=2)  # argv's values win
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
    assert "trainer_state.pt differs from what was saved" in damaged.stderr
    os.remove(os.path.join(run_path, "checkpoint", "checksums.json"))  # as saved before checksums
    unread = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
    assert "trainer_state.pt cannot be read" in unread.stderr
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


def test_a_run_stopped_before_its_summary_resumes_to_finish_it(tmp_path):
    """Stopped after its last checkpoint and before summary.json (the same state as a summary
    deleted, or one left truncated): --resume writes the summary the run would have written, and
    then the run is finished, so a second resume is refused. The lock is on the directory: no
    file stays."""
    run(["--iterations", "1", "--run-dir", str(tmp_path / "runs"), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "runs" / "*"))
    summary_file = os.path.join(run_path, "summary.json")
    with open(summary_file) as f:
        whole = json.load(f)
    assert not [p for p in os.listdir(run_path) if p.endswith(".lock")]
    os.remove(summary_file)
    run(["--resume", run_path], tmp_path)
    with open(summary_file) as f:
        again = json.load(f)
    assert again["evaluations"] == whole["evaluations"]
    assert again["final_success"] == whole["final_success"]
    done = run(["--resume", run_path], tmp_path, expect=2)
    assert "already did 1 iterations" in done.stderr
    with open(summary_file, "r+") as f:  # truncated, as a disk fault leaves it: written again
        f.truncate(100)
    run(["--resume", run_path], tmp_path)
    with open(summary_file) as f:
        assert json.load(f)["evaluations"] == whole["evaluations"]


def test_a_checkpoint_or_start_not_as_saved_is_refused_by_name(tmp_path):
    """What a resume would otherwise take silently or as a traceback: a byte of the adapter
    changed (its checksum), the start a cloned run kept missing, changed, or truncated, and,
    in a checkpoint saved before checksums, a trainer state of another run or a broken adapter
    config. One line each, exit status 2, nothing changed."""
    run(["--model", "tiny-scratch", "--bc-epochs", "1", "--bc-num-tasks", "2", "--iterations", "1",
         "--run-dir", str(tmp_path / "runs"), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "runs" / "*"))
    checkpoint = os.path.realpath(os.path.join(run_path, "checkpoint"))

    def refused(says):
        result = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
        assert says in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert os.path.realpath(os.path.join(run_path, "checkpoint")) == checkpoint

    def flip(path, at):
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))

    adapter = os.path.join(checkpoint, "adapter_model.safetensors")
    flip(adapter, os.path.getsize(adapter) - 5)
    refused("adapter_model.safetensors differs from what was saved")
    flip(adapter, os.path.getsize(adapter) - 5)  # back as saved
    base = os.path.join(run_path, "base_model")
    os.rename(base, base + ".away")
    refused("its base_model/ (the start it cloned) is missing")
    os.rename(base + ".away", base)
    weights = os.path.join(base, "model.safetensors")
    flip(weights, os.path.getsize(weights) - 5)  # one weight of the start changed
    refused("is not the one the run trained on")
    flip(weights, os.path.getsize(weights) - 5)
    saved = open(weights, "rb").read()
    with open(weights, "r+b") as f:
        f.truncate(len(saved) // 2)
    refused("its base_model/ cannot be loaded")
    open(weights, "wb").write(saved)
    os.remove(os.path.join(checkpoint, "checksums.json"))  # as saved before checksums:
    state_file = os.path.join(checkpoint, "trainer_state.pt")
    state = torch.load(state_file, weights_only=False)
    del state["base_weights"]  # nor the start's digest
    torch.save({**state, "optimizer": {"state": {}, "param_groups": []}}, state_file)
    refused("its checkpoint's optimizer does not fit this run")
    torch.save(state, state_file)
    with open(os.path.join(checkpoint, "adapter_config.json"), "w") as f:
        f.write('{"peft_type": "LORA", "r": "sixteen"}')
    refused("cannot be loaded")


def test_a_hand_edited_configuration_is_refused_as_damage_not_as_a_flag(tmp_path):
    run(["--iterations", "1", "--run-dir", str(tmp_path / "runs"), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "runs" / "*"))
    config_file = os.path.join(run_path, "config.json")
    config = json.load(open(config_file))
    config["args"].update(seed="abc", eval_every=None, learning_rate=float("nan"))
    json.dump(config, open(config_file, "w"))
    result = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
    assert "config.json is damaged (seed is 'abc'; learning_rate is nan; eval_every is None)" in (
        result.stderr)
    assert "Traceback" not in result.stderr


def test_a_deleted_setting_or_a_command_that_is_not_text_is_damage(tmp_path):
    """A key deleted from config.json (the run would resume on today's default: 8 became 30),
    a value edited within its type, `command: null` (shlex would read stdin: a hang) or a number:
    each refused as damage, one line, exit status 2."""
    run(["--iterations", "1", "--run-dir", str(tmp_path / "runs"), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "runs" / "*"))
    config_file = os.path.join(run_path, "config.json")
    saved = json.load(open(config_file))
    for change, says in ((lambda c: c["args"].pop("max_episode_steps"), "their digest differs"),
                         (lambda c: c["args"].update(learning_rate=0.1), "their digest differs"),
                         (lambda c: c.update(command=None), "its command is None"),
                         (lambda c: c.update(command=7), "its command is 7"),
                         (lambda c: c.update(resumed_by="x"), "its resumed_by is 'x'")):
        config = json.loads(json.dumps(saved))
        change(config)
        json.dump(config, open(config_file, "w"))
        result = subprocess.run([sys.executable, "proxmo.py", "--resume", run_path,
                                 "--iterations", "2"], cwd=ROOT, env=script_env(tmp_path),
                                capture_output=True, text=True, timeout=120,
                                stdin=subprocess.PIPE)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert "config.json is damaged" in result.stderr and "Traceback" not in result.stderr
    json.dump(saved, open(config_file, "w"))
    run(["--resume", run_path, "--iterations", "2"], tmp_path)  # as written: it resumes


def test_another_runs_checkpoint_is_refused(tmp_path):
    """A whole checkpoint of another run (another seed), copied in with its own checksums: the
    checkpoint names the run that saved it, so the resume is refused, naming what differs."""
    for seed in ("1", "2"):
        run(["--iterations", "1", "--seed", seed, "--run-dir", str(tmp_path / seed), *SMALL],
            tmp_path)
    (mine,) = glob.glob(str(tmp_path / "1" / "*"))
    (other,) = glob.glob(str(tmp_path / "2" / "*"))
    shutil.rmtree(os.path.realpath(os.path.join(mine, "checkpoint")))
    shutil.copytree(os.path.realpath(os.path.join(other, "checkpoint")),
                    os.path.join(mine, "checkpoint-1"))
    result = run(["--resume", mine, "--iterations", "2"], tmp_path, expect=2)
    assert "its checkpoint was saved by another run (seed 2 (this run: 1))" in result.stderr
    assert "Traceback" not in result.stderr


def test_ctrl_c_says_how_to_resume(tmp_path):
    """SIGINT (what Ctrl-C sends) mid-run: no traceback, exit status 130, and the command that
    goes on from the last checkpoint, which then finishes the run."""
    runs = tmp_path / "runs"
    process = subprocess.Popen(
        [sys.executable, "proxmo.py", "--iterations", "6", "--run-dir", str(runs), *SMALL],
        cwd=ROOT, env=script_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for _ in range(600):
        if glob.glob(str(runs / "*" / "checkpoint-2")) or process.poll() is not None:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stderr = process.communicate(timeout=600)[1]
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    command = re.search(r"Resume with: python proxmo.py (--resume \S+)", stderr)
    assert command, stderr[-2000:]
    run(command.group(1).split(), tmp_path)


def test_a_full_disk_at_the_first_write_leaves_no_directory(tmp_path, monkeypatch):
    import errno

    import common.run
    import proxmo
    from common import RunStopped

    def full(path, value):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(common.run, "write_json", full)
    run_ = common.run.Run(proxmo.Args(run_dir=str(tmp_path)), "proxmo.py")
    with pytest.raises(RunStopped, match="No space left on device.*nothing was kept"):
        run_.open()
    assert os.listdir(tmp_path) == []


def test_a_full_disk_at_the_logs_or_the_summary_stops_with_one_line(tmp_path, monkeypatch,
                                                                     capsys):
    """After the first write: TensorBoard's log or summary.json that cannot be written stops the
    run (RunStopped: one line, exit 1, --resume finishes it), no half-written summary; a start
    evaluation that cannot be kept is a warning, the run goes on. --start-evaluations under a
    file is refused before the model loads."""
    import errno

    import common
    import common.run
    import proxmo
    from common import RunStopped, UsageError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="--start-evaluations .*is a file, not a directory"):
        common.run.Run(proxmo.Args(run_dir=str(tmp_path / "runs"),
                                   start_evaluations=str(tmp_path / "file" / "starts")),
                       "proxmo.py")
    args = proxmo.Args(run_dir=str(tmp_path / "runs"), start_evaluations=str(tmp_path / "starts"))
    run_ = common.run.Run(args, "proxmo.py")
    run_.open()
    run_.start_weights = "the start's digest"
    monkeypatch.setattr(common.run, "write_json", full)
    stats = {f"eval_{args.eval_splits[0]}/success": 0.5}
    assert run_._evaluation(args.eval_splits[0], 0, lambda: stats) == stats
    assert "warning: cannot keep the start evaluation" in capsys.readouterr().err
    monkeypatch.setattr(run_.writer, "add_scalar", full)
    with pytest.raises(RunStopped, match="iteration 3: the TensorBoard log cannot be written"):
        run_.log({"loss": 1.0}, 3)
    monkeypatch.undo()
    monkeypatch.setattr(os, "fsync", full)  # write_json's own write fails
    run_.history = {0: stats}
    with pytest.raises(RunStopped, match="the run's summary cannot be written .*No space"):
        run_.finish()
    assert not [name for name in os.listdir(run_.path) if name.startswith("summary")]


def test_a_run_stopped_before_its_first_checkpoint_names_the_parts_it_kept(tmp_path,
                                                                           monkeypatch):
    """SPA's progress model or HISR's reward models saved, then the run stopped before its first
    checkpoint: Ctrl-C's message names the flag that reuses them, and --resume, refused, names
    them too."""
    import common.run
    import proxmo
    from common import UsageError

    monkeypatch.setattr(common.run.Run, "opened", None)
    run_ = common.run.Run(proxmo.Args(run_dir=str(tmp_path)), "proxmo.py")
    run_.open()
    part = os.path.join(run_.path, "progress_model")

    def write(folder):
        os.makedirs(folder)
        torch.save({"w": torch.zeros(2)}, os.path.join(folder, "head.pt"))

    common.run.save_part(part, write, reuse="--progress-model")
    assert (f"start the run again (--progress-model {part} reuses what it kept; or save sooner"
            in common.run.interrupted())
    run_.release()
    with pytest.raises(UsageError, match="its own saved progress_model can start a new run"):
        common.run.Run(proxmo.Args(resume=run_.path), "proxmo.py")


def test_a_checkpoint_whose_checksums_were_removed_or_emptied_is_refused(tmp_path):
    """Deleting checksums.json, or emptying it, does not turn the check off for a checkpoint
    that was saved with one."""
    run(["--iterations", "1", "--run-dir", str(tmp_path / "runs"), *SMALL], tmp_path)
    (run_path,) = glob.glob(str(tmp_path / "runs" / "*"))
    listed = os.path.join(run_path, "checkpoint", "checksums.json")
    with open(listed, "w") as f:
        f.write("{}")
    emptied = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
    assert "adapter_model.safetensors is not in checksums.json" in emptied.stderr
    os.remove(listed)
    removed = run(["--resume", run_path, "--iterations", "2"], tmp_path, expect=2)
    assert "saved with checksums.json, which is gone" in removed.stderr
