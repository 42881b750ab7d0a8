"""Data parallel with accelerate on CPU (two processes, gloo): two processes make the
one-process update, and a short two-process run writes one run directory."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from common.dist import my_share, process_share, whole_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two CPU processes: accelerate 1.15's `--cpu` starts several only through MPI with a hostfile;
# --multi_gpu starts them with torch.distributed.run, and proxmo.py (--device cpu) picks gloo.
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
          "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


GLOO_ABORT = "terminate called without an active exception"


def run(command: list[str], timeout: int = 300, outputs: str | None = None
        ) -> subprocess.CompletedProcess:
    """The command's completed process; `outputs`, a folder the command writes into, is emptied
    before a retry (the aborted launch's run directory would stay beside the retry's)."""
    # One thread per process: two processes share the 2 cores of CI.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    for _ in range(2):
        if done.returncode == 0 or GLOO_ABORT not in done.stderr:
            break
        # A two-process CPU launch sometimes dies in the middle of its update with this C++
        # abort and no Python error (2 of 3 full-suite runs on a 2-core machine, 0 of 5 runs
        # outside the full suite, twice in a row once; not understood). Launch it again, loudly.
        print(f"retrying after a gloo abort: {shlex.join(command)}", file=sys.stderr)
        if outputs is not None:
            shutil.rmtree(outputs)
            os.makedirs(outputs)
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_one_process_takes_the_whole_batch():
    tasks, groups = my_share(["a", "b"], 3)
    assert tasks == ["a", "a", "a", "b", "b", "b"] and groups == [0, 0, 0, 1, 1, 1]
    assert whole_batch([7, 8]) == ([7, 8], slice(0, 2))


def test_process_share_splits_contiguously_and_evenly():
    assert [list(process_share(5, i, 2)) for i in range(2)] == [[0, 1], [2, 3, 4]]
    assert [list(process_share(8, i, 4)) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(process_share(3, 0, 1)) == [0, 1, 2]


@pytest.mark.parametrize("method", ["proxmo", "spa", "istar"])
def test_two_processes_make_the_update_of_one(method, tmp_path):
    """spa.py's update adds a value loss, a mean over the mini-batch's steps of all processes;
    istar's is the PRM's DPO step, whose pairs and loss span the processes' groups."""
    script = os.path.join("tests", "data_parallel_update.py")
    run([sys.executable, script, str(tmp_path / "one.pt"), "5", method])
    one = torch.load(tmp_path / "one.pt")
    assert one["processes"] == 1
    # istar: process 0 holds group 0 (3 trajectories), then groups 0 and 1 (5), leaving process
    # 1 only group 2, which has no pair (no gradient of its own).
    if method == "istar":
        assert one["stats"]["prm/pairs"] == 3
        for share in (3, 5):
            run(LAUNCH + [script, str(tmp_path / f"two_{share}.pt"), str(share), method])
            two = torch.load(tmp_path / f"two_{share}.pt")
            assert two["processes"] == 2 and two["stats"]["prm/pairs"] == 3
            assert two["stats"]["prm/grad_norm"] == pytest.approx(
                one["stats"]["prm/grad_norm"], rel=1e-4)
            for name, weight in one["weights"].items():
                assert torch.allclose(two["weights"][name], weight, atol=1e-6), (share, name)
        return
    assert one["stats"]["train/loss"] != 0
    if method == "spa":
        assert one["stats"]["train/value_loss"] > 0
    # Process 0 holds 5 samples (4.4 response tokens each), then 1 (it sits out mini-batches).
    for share in (5, 1):
        run(LAUNCH + [script, str(tmp_path / f"two_{share}.pt"), str(share), method])
        two = torch.load(tmp_path / f"two_{share}.pt")
        assert two["processes"] == 2
        # Float tolerance: the processes' micro-batches pad differently from one process's. A
        # mean of per-process token-means is off by far more (mutation-checked: loss 0.93, not
        # 3.87).
        assert two["stats"]["train/loss"] == pytest.approx(one["stats"]["train/loss"], rel=1e-5)
        assert two["stats"]["train/grad_norm"] == pytest.approx(
            one["stats"]["train/grad_norm"], rel=1e-4)
        assert 0 <= two["stats"]["train/clip_fraction"] <= 1
        if method == "spa":  # a mean over micro-batches, which the processes cut differently
            assert two["stats"]["train/value_loss"] > 0
        moved = 0
        for name, weight in one["weights"].items():
            assert torch.allclose(two["weights"][name], weight, atol=1e-5), (share, name)
            moved += "lora_B" in name and bool(weight.abs().sum() > 0)  # lora_B starts at zero
        assert moved > 0


def test_two_process_run_writes_one_run_directory(tmp_path):
    flags = ["--device", "cpu", "--iterations", "1", "--tasks-per-iteration", "2",
             "--group-size", "2", "--eval-num-tasks", "4", "--run-dir", str(tmp_path)]
    done = run(LAUNCH + ["proxmo.py", *flags], outputs=str(tmp_path))
    (run_name,) = os.listdir(tmp_path)
    run_path = tmp_path / run_name
    assert (run_path / "checkpoint" / "adapter_model.safetensors").is_file()
    with open(run_path / "summary.json") as f:
        summary = json.load(f)
    with open(run_path / "config.json") as f:
        assert json.load(f)["num_processes"] == 2
    assert sorted(summary["evaluations"]) == ["0", "1"]
    for stats in summary["evaluations"].values():  # gathered from both processes' shares
        assert stats["eval_test/tasks"] == 4
    assert done.stdout.count("done: test success") == 1  # only the main process reports
    state = torch.load(run_path / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert len(state["streams"]) == 2
    assert not torch.equal(state["streams"][0]["torch"], state["streams"][1]["torch"])


def test_two_processes_refuse_a_batch_they_cannot_split(tmp_path):
    command = LAUNCH + ["proxmo.py", "--device", "cpu", "--tasks-per-iteration", "3",
                        "--run-dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--tasks-per-iteration 3 must be a multiple of the 2 processes" in done.stderr
    assert os.listdir(tmp_path) == []
