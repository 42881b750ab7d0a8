"""A training run's directory and everything written to it (docs/running.md, "The run
directory"): config.json, the TensorBoard logs, base_model/, checkpoint/ and summary.json. The
main process alone writes, but every process holds a Run and calls each method: Run(), keep_base
and save wait for the others (a call on one process only would hang).

    run, train_tasks, eval_tasks = start_run(args, "proxmo.py", validate_args(args))
    model, tokenizer = run.load_model()    # --model, or the start a resumed run kept
    run.open()                             # only now a directory: a bad flag leaves nothing
    start_path = run.keep_base(model, tokenizer)  # the start's directory or hub id
    start_iteration = run.restore(optimizer=optimizer, generator=generator)  # --resume
    run.evaluate(iteration, eval_tasks, evaluate)  # evaluate(split, tasks): logged, in history
    run.log(stats, iteration)
    run.save(model, start_path, iteration, optimizer=optimizer, generator=generator)
    summary = run.finish()                 # summary.json, the lock released, the processes ended
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict

import numpy as np
import torch

try:
    import fcntl  # the run directory's lock (POSIX); without it a run directory is not locked
except ImportError:
    fcntl = None
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object
from safetensors import SafetensorError

import envs
from common import RunStopped, UsageError, error_line, folder_error, write_json
from common.config import settings_digest
from common.dist import launch_errors, start_processes
from common.model import (TINY_NAMES, check_lora_targets, check_model,
                          load_model_and_tokenizer, resolve_model_name)
from common.progress import write_evaluation
from envs.text import PROMPT_WORDS


def seed_everything(seed: int, deterministic: bool = True) -> None:
    """Seeds python, numpy and torch; with `deterministic`, asks torch for deterministic kernels
    where it has them (and a warning where not). On CPU that costs nothing measurable; on CUDA it
    takes slower scatter/index kernels (benchmarks/gpu_check.py measures it)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)


def random_streams() -> dict:
    """This process's python, numpy, torch (and CUDA) random states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_random_streams(streams: dict) -> None:
    random.setstate(streams["python"])
    np.random.set_state(streams["numpy"])
    torch.set_rng_state(streams["torch"])
    if torch.cuda.is_available() and streams["cuda"]:
        torch.cuda.set_rng_state_all(streams["cuda"])


def try_lock(path: str) -> int | None:
    """A descriptor of `path` (a file or directory) that holds an exclusive lock on it until it
    is closed or the process ends, whatever the way out (kill -9 included; no lock file); None
    while another process holds the lock. Without fcntl (not POSIX) nothing is locked: a
    descriptor of os.devnull."""
    if fcntl is None:
        return os.open(os.devnull, os.O_RDONLY)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


def rollout_stats(batch: list[dict], advantages: list) -> dict:
    """What the log shows of an iteration's batch (every process's summarized trajectories and
    their per-step advantages): success, grounding (admissible steps), well-formed replies,
    episode length, step samples, the share of mixed groups (neither all won nor all lost: the
    groups a group baseline learns from) and the mean |advantage|."""
    steps = [s for tr in batch for s in tr["steps"]]
    abs_advantages = [abs(float(a)) for adv in advantages for a in adv]
    wins = defaultdict(list)
    for t in batch:
        wins[t["group"]].append(t["won"])
    return {"rollout/success": float(np.mean([t["won"] for t in batch])),
            "rollout/mixed_groups": float(np.mean([0 < sum(w) < len(w) for w in wins.values()])),
            "rollout/grounding": float(np.mean([s["valid"] for s in steps])),
            "rollout/well_formed": float(np.mean([s["well_formed"] for s in steps])),
            "rollout/episode_length": float(np.mean([len(t["steps"]) for t in batch])),
            "rollout/step_samples": len(steps),
            "train/advantage_abs_mean": float(np.mean(abs_advantages))}


def check_finite(where: str, **values: float) -> None:
    """Stop the run, before the optimizer step, when a loss or gradient norm is NaN or inf."""
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        found = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise FloatingPointError(f"{where}: non-finite {found}; stopped before the optimizer "
                                 "step, the weights are unchanged")


def code_version() -> str:
    """The git commit of the code that runs, "+changes" appended when a tracked file outside the
    docs and the benchmark records differs from it; "unknown" outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = ["git", "-C", root]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--",
                                  ".", ":(exclude)benchmarks/results", ":(exclude)docs",
                                  ":(exclude)*.md"], capture_output=True, text=True,
                                 check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if changed else "")


# The code this process runs, read when it is imported: a commit made while a long run goes on
# is not the code it runs.
CODE_VERSION = code_version()
# What, besides the start's weights, decides a start evaluation (--start-evaluations).
EVALUATION_SETTINGS = ("env", "seed", "eval_num_tasks", "eval_draws", "eval_temperature",
                       "eval_top_p", "max_episode_steps", "max_new_tokens", "max_prompt_tokens",
                       "history_length", "reasoning", "backend", "sampler", "device",
                       "deterministic")


def weights_digest(model) -> str:
    """sha256 of a model's weights (every state_dict entry's name and bytes, sorted by name)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


_CLOCKS: defaultdict[str, float] = defaultdict(float)  # this process's, since timings()
_INNER: list[float] = []  # per open timer block: the seconds of the timers inside it


@contextlib.contextmanager
def timer(name: str):
    """Adds the seconds the `with` block takes to the clock `name`, less those of the timers
    inside it: each second counts on one clock."""
    began = time.perf_counter()
    _INNER.append(0.0)
    try:
        yield
    finally:
        elapsed = time.perf_counter() - began
        _CLOCKS[name] += elapsed - _INNER.pop()
        if _INNER:
            _INNER[-1] += elapsed


def timings() -> dict[str, float]:
    """{"time/<name>_seconds": seconds} of every clock since the last call; sets them to 0."""
    out = {f"time/{name}_seconds": seconds for name, seconds in _CLOCKS.items()}
    _CLOCKS.clear()
    return out


def _state_of(thing):
    """What a checkpoint keeps of `thing`: the state of an optimizer or module (state_dict), of a
    torch.Generator or of a random.Random; plain data (or None) as it is."""
    if isinstance(thing, torch.Generator):
        return thing.get_state()
    if isinstance(thing, random.Random):
        return thing.getstate()
    if hasattr(thing, "state_dict"):
        return thing.state_dict()
    return thing


def _set_state(thing, state) -> None:
    """The inverse of _state_of, in place, for all but plain data (read it from Run.state)."""
    if isinstance(thing, torch.Generator):
        thing.set_state(state)
    elif isinstance(thing, random.Random):
        thing.setstate(state)
    else:
        thing.load_state_dict(state)


CHECKSUMS = "checksums.json"  # a checkpoint's files and their sha256, written last


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    """The paths of every file under `folder`, relative to it, but the checksums file."""
    found = [os.path.relpath(os.path.join(root, name), folder)
             for root, _, names in os.walk(folder) for name in names]
    return sorted(f for f in found if f != CHECKSUMS)


def checksums(folder: str) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256), but the checksums file."""
    return {relative: _sha256(os.path.join(folder, relative)) for relative in _files(folder)}


def checksum_errors(folder: str) -> list[str]:
    """What in `folder` differs from its checksums file: a file missing or changed since the
    save; [] when all agree or when there is no checksums file (a checkpoint saved before
    checksums)."""
    listed = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(listed):
        return []
    try:
        with open(listed) as f:
            expected = json.load(f)
    except ValueError:
        expected = None
    if not isinstance(expected, dict):
        return [f"{CHECKSUMS} cannot be read"]
    errors = []
    for relative, digest in sorted(expected.items()):
        path = os.path.join(folder, relative)
        if not os.path.isfile(path):
            errors.append(f"{relative} is missing")
        elif _sha256(path) != digest:
            errors.append(f"{relative} differs from what was saved")
    errors += [f"{relative} is not in {CHECKSUMS}" for relative in _files(folder)
               if relative not in expected]
    return errors


def seal(path: str) -> None:
    """Records what a method's own saved part holds (a folder: its CHECKSUMS file; a file: a
    `.sha256` beside it), for seal_errors on --resume."""
    if os.path.isdir(path):
        write_json(os.path.join(path, CHECKSUMS), checksums(path))
    else:
        write_json(f"{path}.sha256", {os.path.basename(path): _sha256(path)})


def save_part(path: str, write, reuse: str = "") -> None:
    """A method's own part saved at `path` (a file or folder) by write(path) on the main process,
    then sealed; a write that fails (a full disk) removes what it wrote and stops the run on
    every process (RunStopped). `reuse`: the flag by which a new run reuses it, said when the
    run stops before its first checkpoint."""
    failed = None
    if PartialState().is_main_process:
        try:
            write(path)
            seal(path)
            if reuse and Run.opened is not None:
                Run.opened.kept.append(f"{reuse} {path}")
        except (OSError, RuntimeError, SafetensorError) as e:  # torch.save's full disk: Runtime
            shutil.rmtree(path, ignore_errors=True)
            for leftover in (path, f"{path}.sha256"):
                if os.path.isfile(leftover):
                    os.remove(leftover)
            failed = f"{path} could not be written ({error_line(e)})"
    failed = broadcast_object_list([failed])[0]  # every process stops, or none
    if failed:
        raise RunStopped(failed)


def seal_errors(path: str) -> list[str]:
    """What in a sealed folder or file differs from its seal ([] without a seal: saved before
    seals, or never sealed)."""
    if os.path.isdir(path):
        return checksum_errors(path)
    listed = f"{path}.sha256"
    if not os.path.isfile(listed):
        return []
    if not os.path.isfile(path):
        return [f"{os.path.basename(path)} is missing"]
    try:
        with open(listed) as f:
            expected = json.load(f).get(os.path.basename(path))
    except (ValueError, AttributeError):
        return [f"{os.path.basename(listed)} cannot be read"]
    return [] if expected == _sha256(path) else [f"{os.path.basename(path)} differs from what "
                                                 "was saved"]


def _flush_tree(path: str, files: bool = True) -> None:
    """Every file under `path` (with files) and the directory itself on disk, not only in the
    page cache: what a rename then points to survives a crash of the machine too."""
    if files:
        for folder, _, names in os.walk(path):
            for name in names:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # a filesystem that cannot sync a directory; its files are synced
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _quiet_log_thread(hook):
    """threading.excepthook, but silent on the OSError (a full disk) of TensorBoard's writer
    thread: the next Run.log stops the run with one line naming it."""
    def quiet(failed) -> None:
        writer = type(failed.thread).__name__ == "_AsyncWriterThread"
        if not (writer and issubclass(failed.exc_type, OSError)):
            hook(failed)
    return quiet


def interrupted(what: str = "interrupted") -> str:
    """What to say when a run stops (Ctrl-C, or `what` else): how to go on from its last
    checkpoint."""
    run = Run.opened
    if run is None:
        return f"{what} before the run directory was made; nothing was kept"
    command = f"python {run.script} --resume {run.path}"
    if not os.path.exists(run.checkpoint):
        kept = "".join(f"{flag} reuses what it kept; " for flag in run.kept)
        return (f"{what} before the first checkpoint of {run.path}; start the run again "
                f"({kept}or save sooner with --save-every)")
    try:
        state = torch.load(os.path.join(run.checkpoint, "trainer_state.pt"), weights_only=False)
        iteration = state.get("iteration", "?")
    except Exception:  # unreadable: --resume says what is wrong with it
        iteration = "?"
    return f"{what}; the last checkpoint is iteration {iteration}. Resume with: {command}"


def start_run(args, script: str, errors: list[str], method: str | None = None,
              also: str = "", one_process: list[str] = ()) -> tuple[Run, list, dict]:
    """Every script's start, before its model: the processes, every flag error at once as one
    UsageError (the script's `errors`, launch_errors with `also`, and with several processes
    `one_process`), the seeds, the Run and the tasks. Returns (run, train_tasks,
    {split: its first --eval-num-tasks tasks}); run.dist is this process's PartialState."""
    if any(e.startswith("--process-timeout-minutes") for e in errors):
        raise UsageError("\n".join(errors))  # no process group can start with that timeout
    dist = start_processes(args)  # one process, or one of those `accelerate launch` started
    script = os.path.basename(script)
    errors = errors + launch_errors(args, dist, script, also)
    if dist.num_processes > 1:
        errors += list(one_process)
    if errors:
        raise UsageError("\n".join(errors))
    if not dist.is_main_process:  # one process reports; errors and warnings still reach stderr
        sys.stdout = open(os.devnull, "w")
    seed_everything(args.seed, args.deterministic)
    run = Run(args, script, method)
    if not args.resume:  # the model first: a run that cannot load it says so before the games
        check_model(args.model, args.env)
    train_split = envs.TRAIN_SPLIT[args.env]
    try:
        train_tasks = envs.list_tasks(args.env, train_split)
    except UsageError:
        if args.iterations > 0 or args.bc_epochs > 0:
            raise
        train_tasks = []  # an evaluation alone (--iterations 0) needs no training games
    if train_tasks and args.tasks_per_iteration > len(train_tasks):
        raise UsageError(f"--tasks-per-iteration {args.tasks_per_iteration} exceeds the "
                         f"{len(train_tasks)} training tasks")
    eval_tasks = {split: envs.list_tasks(args.env, split, args.eval_num_tasks or None)
                  for split in args.eval_splits}
    run.check_task_set(envs.task_set(args.env, {train_split: train_tasks, **eval_tasks}))
    print(describe(args, script, run.path))
    quiet_libraries()
    return run, train_tasks, eval_tasks


def describe(args, script: str, path: str) -> str:
    """What a run will do, in a few lines (every setting goes to its config.json)."""
    def count(n: int, noun: str) -> str:
        return f"{n} {noun}" if n == 1 else f"{n} {noun}s"

    tasks = f"first {args.eval_num_tasks}" if args.eval_num_tasks else "all"
    played = f" x {args.eval_draws} draws" if args.eval_draws > 1 else ""
    lines = [f"{script} --advantage {args.advantage} --env {args.env} --model {args.model} "
             f"({args.device}, {args.backend} backend, seed {args.seed})",
             f"  RL: {count(args.iterations, 'iteration')} x "
             f"{count(args.tasks_per_iteration, 'task')} x "
             f"{count(args.group_size, 'episode')}, <= {args.max_episode_steps} steps of <= "
             f"{args.max_new_tokens} new tokens, lr {args.learning_rate:g}",
             f"  evaluation: {tasks} {'/'.join(args.eval_splits)} tasks{played} "
             f"(T={args.eval_temperature:g}, {args.sampler} draws) at 0, "
             f"every {count(args.eval_every, 'iteration')} and at the end",
             f"  {'resumes' if args.resume else 'run directory'}: {path}"]
    if args.bc_epochs > 0 and not args.resume:
        lines.insert(2, f"  behavior cloning first: {args.bc_epochs} epochs on "
                        f"{args.bc_num_tasks} expert-played training tasks")
    if args.device == "cpu" and args.model not in TINY_NAMES and args.iterations > 20:
        lines += [f"note: --model {args.model} takes the real presets above: hours per "
                  "iteration on a CPU.", "  A small run: --iterations 2 --tasks-per-iteration 2 "
                  "--max-new-tokens 64, or --model tiny"]
    return "\n".join(lines)


def quiet_libraries() -> None:
    """Keeps known library noise out of a run's output and log: transformers' weight-loading
    bars and its deprecation of the gradient-checkpointing names that peft still calls."""
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r".*(is_)?gradient_checkpointing.* is deprecated",
                            category=FutureWarning)


class Run:
    """runs/<exp-name>__<env>__<method>__<seed>__<UTC time>, or the --resume directory; with
    --resume, `state` is its checkpoint's trainer_state.pt, checked before anything is written."""

    opened = None  # this process's open Run, for the message of an interrupted run

    def __init__(self, args, script: str, method: str | None = None):
        self.args, self.script, self.dist = args, script, PartialState()
        method = method or args.advantage
        began = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time()))  # UTC
        name = f"{args.exp_name}__{args.env}__{method}__{args.seed}__{began}"
        name = broadcast_object_list([name])[0]  # the main process's clock names the run
        self.path = args.resume or os.path.join(args.run_dir, name)
        self.task_set = None  # what identifies its games (check_task_set)
        self.checkpoint = os.path.join(self.path, "checkpoint")  # the link to the last one
        self.writer, self.lock, self.began, self.seconds = None, None, None, 0.0
        self.start_weights = None  # weights_digest of the start, for --start-evaluations
        self.base_weights = None  # weights_digest of the base the adapter trains on (keep_base)
        self.config = None  # config.json's content while it waits to be written
        self.history: dict = {}  # iteration -> its evaluations' stats (summary.json's)
        self.kept: list[str] = []  # "<flag> <path>": its own parts a new run can reuse (save_part)
        if args.resume:
            self._take_lock()  # before anything is read: a run still going is not resumed
            try:
                self.state = self._resume_state()
            except UsageError:
                self.release()
                raise
        else:  # the folders it will write to, before the model loads
            self.state = None
            error = folder_error("--run-dir", args.run_dir)
            if args.start_evaluations and not error:  # read-only: its evaluations are still read
                error = folder_error("--start-evaluations", args.start_evaluations, writable=False)
            if error:
                raise UsageError(error)

    def _take_lock(self) -> None:
        """The main process holds a lock on the run directory itself until the run finishes or
        the process ends (try_lock). Every process calls it: refused on all when another
        process holds the lock."""
        if self.dist.is_main_process:
            self.lock = try_lock(self.path)
        if broadcast_object_list([self.dist.is_main_process and self.lock is None])[0]:
            raise UsageError(f"--resume {self.path}: the run is still going (another process "
                             "holds its lock); stop it first, or wait for it")

    def release(self) -> None:
        """Lets go of the run directory's lock."""
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    def _resume_state(self) -> dict:
        resume, file = self.args.resume, os.path.join(self.checkpoint, "trainer_state.pt")
        if not os.path.exists(self.checkpoint) and self.dist.is_main_process:
            self._relink()  # killed between two renames of a save: its newest whole checkpoint
        self.dist.wait_for_everyone()
        if not os.path.isfile(file):
            parts = [name for name in sorted(os.listdir(resume)) if not name.startswith(
                "checkpoint") and os.path.isfile(os.path.join(resume, name, CHECKSUMS))]
            kept = (f"; its own saved {', '.join(parts)} can start a new run (the script's "
                    "--help names the flag)" if parts else "")
            raise UsageError(f"--resume {resume}: no checkpoint/trainer_state.pt in it (stopped "
                             f"before its first save, every --save-every {self.args.save_every} "
                             f"iterations): nothing to resume, start the run again{kept}")
        if not os.path.isfile(os.path.join(self.checkpoint, "adapter_config.json")):
            raise UsageError(f"--resume {resume}: its checkpoint has no adapter_config.json")
        damaged = checksum_errors(os.path.realpath(self.checkpoint))
        if damaged:
            raise UsageError(f"--resume {resume}: its checkpoint is damaged ({'; '.join(damaged)})"
                             "; it cannot be resumed as it was saved")
        try:
            state = torch.load(file, weights_only=False)
        except Exception as e:  # a file damaged by hand or by the disk: torch's error names none
            message = f"--resume {resume}: {file} cannot be read ({error_line(e)})"
            raise UsageError(message) from None
        if "base_weights" in state and not os.path.isfile(os.path.join(self.checkpoint,
                                                                        CHECKSUMS)):
            raise UsageError(f"--resume {resume}: its checkpoint was saved with {CHECKSUMS}, "
                             "which is gone; it cannot be checked, so it is not resumed")
        missing = [k for k in ("iteration", "history", "streams") if not isinstance(state, dict)
                   or k not in state]
        if missing:
            raise UsageError(f"--resume {resume}: {file} lacks {', '.join(missing)}; it is not a "
                             "checkpoint this version of the script wrote (one saved before "
                             "data parallel has no streams) and cannot be resumed")
        saved = state.get("run")  # a checkpoint from before this record: not checked
        if isinstance(saved, dict) and saved != self.identity():
            now = self.identity()
            differ = [f"{k} {saved.get(k)!r} (this run: {now.get(k)!r})"
                      for k in sorted({*saved, *now}) if saved.get(k) != now.get(k)]
            raise UsageError(f"--resume {resume}: its checkpoint was saved by another run "
                             f"({'; '.join(differ[:4])}); a checkpoint resumes only the run "
                             "that saved it")
        try:  # a summary that cannot be read is written again
            with open(self.file("summary.json")) as f:
                finished = isinstance(json.load(f), dict)
        except (OSError, ValueError):
            finished = False
        # A run stopped after its last checkpoint and before its summary resumes to finish.
        if state["iteration"] > self.args.iterations or (
                state["iteration"] == self.args.iterations and finished):
            raise UsageError(f"--resume {resume}: the run already did {state['iteration']} "
                             "iterations; pass a larger --iterations to continue it")
        if len(state["streams"]) != self.dist.num_processes:
            raise UsageError(f"--resume {resume}: saved by {len(state['streams'])} processes, "
                             f"resumed by {self.dist.num_processes}; their random streams "
                             "continue only with as many processes")
        return state

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def device(self) -> str:
        """--device; with several processes on GPUs, each its own (cuda:<local rank>)."""
        if self.dist.num_processes > 1 and self.args.device != "cpu":
            return str(self.dist.device)
        return self.args.device

    def load_model(self):
        """(model, tokenizer): --model, or on --resume the start model the run saved
        (keep_base); bfloat16 on a GPU, float32 on a CPU."""
        args = self.args
        base = self.file("base_model")
        if args.resume and not os.path.isdir(base) and (args.bc_epochs > 0
                                                         or args.model == "tiny-scratch"):
            raise UsageError(f"--resume {self.path}: its base_model/ (the start it cloned) is "
                             "missing; the run cannot go on without it")
        name = base if args.resume and os.path.isdir(base) else args.model
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        vocabulary = None
        if args.model == "tiny-scratch":
            vocabulary = envs.vocabulary(args.env) + PROMPT_WORDS
        try:
            model, tokenizer = load_model_and_tokenizer(name, vocabulary=vocabulary,
                                                        seed=args.seed, dtype=dtype,
                                                        device=self.device)
        except UsageError as e:
            if name != base:
                raise
            reason = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
            raise UsageError(f"--resume {self.path}: its base_model/ cannot be loaded "
                             f"({reason})") from None
        check_lora_targets(model, args.lora_target_modules)  # before the directory exists
        if args.gradient_checkpointing:  # from BC on (less memory); non-reentrant: LoRA works
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return model, tokenizer

    def keep_base(self, model, tokenizer) -> str:
        """The start model's name for the adapter's config: --model's, or, when the start exists
        nowhere else (after behavior cloning, or tiny-scratch), the copy saved beside it."""
        args, base = self.args, self.file("base_model")
        if (args.bc_epochs > 0 or args.model == "tiny-scratch") and not args.resume:
            if self.dist.is_main_process:
                model.save_pretrained(base)
                tokenizer.save_pretrained(base)
            self.dist.wait_for_everyone()
        # The base is part of the checkpoint's identity: a resume on other weights is refused.
        self.base_weights = weights_digest(model)
        saved = (self.state or {}).get("base_weights")
        if saved is not None and saved != self.base_weights:
            raise UsageError(f"--resume {self.path}: the start model loaded now ("
                             f"{'its base_model/' if os.path.isdir(base) else args.model}) is "
                             "not the one the run trained on (its weights differ); restore the "
                             "run's base_model/ or the model it named")
        if args.start_evaluations and not args.resume:
            self.start_weights = self.base_weights
        return os.path.abspath(base) if os.path.isdir(base) else resolve_model_name(args.model)[0]

    def evaluate(self, iteration: int, eval_tasks: dict, evaluate) -> None:
        """evaluate(split, tasks)'s stats on each split of eval_tasks ({split: tasks}): logged,
        kept in the history (summary.json) and printed as a line."""
        for split, tasks in eval_tasks.items():
            t0 = time.time()
            stats = self._evaluation(split, iteration, lambda: evaluate(split, tasks))
            self.log(stats, iteration)
            self.history.setdefault(iteration, {}).update(stats)
            write_evaluation(stats, split, iteration, time.time() - t0)

    def _evaluation(self, split: str, iteration: int, evaluate) -> dict:
        """evaluate()'s stats. At iteration 0 with --start-evaluations: the stored evaluation of
        the same script, split, start weights and EVALUATION_SETTINGS when there is one (no game
        is played: every arm of a seed shares one start evaluation), else evaluate()'s, stored
        there for the next run."""
        args = self.args
        if iteration != 0 or not args.start_evaluations or self.start_weights is None:
            return evaluate()
        key = {"script": self.script, "split": split, "start_weights": self.start_weights,
               **{name: getattr(args, name) for name in EVALUATION_SETTINGS}}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        name = f"{os.path.splitext(self.script)[0]}-{split}-seed{args.seed}-{digest}.json"
        path = os.path.join(args.start_evaluations, name)
        stored = None
        if self.dist.is_main_process and os.path.isfile(path):
            try:
                with open(path) as f:
                    stored = json.load(f)
            except ValueError as e:
                raise UsageError(f"--start-evaluations: {path} is damaged ({e}); delete it "
                                 "and the next run evaluates its start again") from None
            if not isinstance(stored, dict) or stored.get("key") != key:
                raise UsageError(f"--start-evaluations: {path} is not this run's start "
                                 "evaluation (its key differs); delete it")
        stored = broadcast_object_list([stored])[0]
        if stored is not None:
            print(f"start evaluation of {split}: {path} (same start, seed and settings)")
            return stored["stats"]
        stats = evaluate()
        if self.dist.is_main_process:
            try:
                os.makedirs(args.start_evaluations, exist_ok=True)
                write_json(path, {"key": key, "commit": CODE_VERSION, "stats": stats})
            except OSError as e:  # a full disk, say: the run goes on, the next run evaluates
                print(f"warning: cannot keep the start evaluation in {path} ({e}); the run "
                      "goes on", file=sys.stderr)
        return stats

    def check_task_set(self, found: dict | None) -> None:
        """Keeps what identifies the run's games (envs.task_set) for its config.json; on
        --resume, a UsageError if they are not the games the run began on (another
        ALFWORLD_DATA, or a set changed since). A run from before this record is not checked."""
        self.task_set = found
        if not self.args.resume:
            return
        try:
            with open(self.file("config.json")) as f:
                saved = json.load(f).get("task_set")
        except (OSError, ValueError):  # parse_args has read it: not reached
            return
        if saved is None or saved == found:
            return
        before = saved.get("splits", {}) if isinstance(saved, dict) else {}
        now = (found or {}).get("splits", {})
        differ = [f"{split}: {before.get(split, {}).get('games')} games then, "
                  f"{now.get(split, {}).get('games')} now" for split in sorted({*before, *now})
                  if before.get(split) != now.get(split)]
        raise UsageError(f"--resume {self.path}: its games are not the ones it began on "
                         f"({'; '.join(differ) or 'another set'}); it played "
                         f"ALFWORLD_DATA={saved.get('alfworld_data')}, now "
                         f"{(found or {}).get('alfworld_data')}: set ALFWORLD_DATA to its set")

    def open(self) -> None:
        """The run directory, its config.json (a resume's command joins the first's at its first
        save: a resume that fails before it leaves the run as it was) and the loggers."""
        if self.dist.is_main_process and not self.args.resume:
            planned, self.path = self.path, self._new_directory()
            self.lock = try_lock(self.path)  # a directory made just now: no other run has it
            if self.path != planned:
                print(f"run directory: {self.path} ({os.path.basename(planned)} was taken)")
        self.path = broadcast_object_list([self.path])[0]
        self.checkpoint = self.file("checkpoint")
        self.began = time.time()  # the clock of summary.json's minutes: work, not waiting
        self.seconds = self.state.get("seconds", 0.0) if self.state else 0.0
        failed = None
        if self.dist.is_main_process:
            try:
                self._open_files()
            except RunStopped as e:
                failed = str(e)
        failed = broadcast_object_list([failed])[0]  # every process stops, or none
        if failed:
            raise RunStopped(failed)

    def _open_files(self) -> None:
        """open()'s writes, on the main process: config.json and the loggers. A disk that cannot
        take them stops the run (RunStopped), a new run's directory removed."""
        args = self.args
        config_file = self.file("config.json")
        this = {"command": shlex.join([sys.executable, *sys.argv]), "commit": CODE_VERSION,
                "torch": torch.__version__, "threads": torch.get_num_threads()}
        settings = json.loads(json.dumps(asdict(args)))  # as config.json holds them
        if args.resume:  # keep the first command; a raised --iterations holds for later resumes
            with open(config_file) as f:
                record = {**json.load(f), "args": settings,
                          "args_sha256": settings_digest(settings)}
            record["resumed_by"] = record.get("resumed_by", []) + [this]
            self.config = record  # written with the resume's first save
        else:
            try:
                write_json(config_file, {**this, "args": settings,
                                         "args_sha256": settings_digest(settings),
                                         "resumed_by": [],
                                         "num_processes": self.dist.num_processes,
                                         "task_set": self.task_set})
            except OSError as e:  # a full disk, say: no half-made run is left behind
                self._abandon()
                raise RunStopped(f"cannot write {config_file} ({e.strerror or e}); nothing was "
                                 "kept, free some space or pick another --run-dir") from None
        Run.opened = self
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project, name=os.path.basename(self.path),
                       config=asdict(args), dir=self.path, sync_tensorboard=True)
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run's events from its last checkpoint on replace those the stopped run logged
        # after it (TensorBoard's purge): every iteration keeps one value, the resumed run's.
        purge = self.state["iteration"] + 1 if self.state else None
        threading.excepthook = _quiet_log_thread(threading.excepthook)
        try:
            self.writer = SummaryWriter(self.path, purge_step=purge)
            self.writer.add_text("config", "| flag | value |\n| --- | --- |\n" + "\n".join(
                f"| --{k.replace('_', '-')} | {v} |" for k, v in asdict(args).items()))
        except OSError as e:
            if not args.resume:
                self._abandon()
            raise RunStopped(f"the TensorBoard log cannot be written ({e}); free some space "
                             "(a resumed run is as it was)") from None

    def _abandon(self) -> None:
        """A new run that could not begin: its lock let go and its directory removed."""
        self.release()
        Run.opened = None
        shutil.rmtree(self.path, ignore_errors=True)

    def _new_directory(self) -> str:
        """The run's own directory: its name, or with -2, -3, ... when a run started in the same
        second took it (mkdir is atomic: two runs never get one directory)."""
        path, k = self.path, 1
        while True:
            try:
                os.makedirs(path)
                return path
            except FileExistsError:
                k += 1
                path = f"{self.path}-{k}"

    def log(self, stats: dict, step: int) -> None:
        """`stats`' numbers in TensorBoard (the main process writes them); a log that cannot be
        written stops the run on every process (each calls log at the same points)."""
        failed = None
        try:
            for k, v in stats.items():  # per-task lists stay in the history, not in the log
                if self.writer is not None and not isinstance(v, (list, tuple)):
                    self.writer.add_scalar(k, v, step)
        except OSError as e:  # a full disk: the writer's thread says so at the next write
            failed = f"iteration {step}: the TensorBoard log cannot be written ({e})"
        failed = broadcast_object_list([failed])[0]
        if failed:
            raise RunStopped(failed)

    def identity(self) -> dict:
        """What a checkpoint belongs to: the script and every setting a resume may not change
        (common/config.py's OVERRIDABLE aside; where the run lies neither)."""
        from common.config import OVERRIDABLE

        settings = {k: v for k, v in asdict(self.args).items()
                    if k not in ("resume", "run_dir", *OVERRIDABLE)}
        return {"script": self.script, **json.loads(json.dumps(settings))}

    def restore(self, **trainer_state) -> int:
        """The iteration to go on from: 0 for a new run. On --resume, the checkpoint's (and its
        history), after every object given (an optimizer, module, generator or random.Random,
        by the name save had it; None is skipped) and this process's random streams got their
        saved states back. Plain data that save kept is in `state`."""
        if self.state is None:
            return 0
        for name, thing in trainer_state.items():
            if thing is not None:
                try:
                    _set_state(thing, self.state[name])
                except (KeyError, ValueError, TypeError, RuntimeError) as e:
                    raise UsageError(f"--resume {self.path}: its checkpoint's {name} does not "
                                     f"fit this run ({error_line(e, name)})") from None
        set_random_streams(self.state["streams"][self.dist.process_index])
        print(f"resumed from {self.checkpoint} at iteration {self.state['iteration']}")
        self.history = self.state["history"]
        return self.state["iteration"]

    def save(self, model, start_path: str, iteration: int, adapters: dict | None = None,
             **trainer_state) -> None:
        """A checkpoint: the LoRA adapter (its config naming the base model), `adapters` (name ->
        model) in subfolders, a model card, and trainer_state.pt for --resume (the state of each
        of `trainer_state`, name -> optimizer, module, generator or plain data; the iteration,
        history, every process's random streams, the run's seconds). A write that fails stops
        the run on every process (RunStopped), the last checkpoint intact."""
        streams = gather_object([random_streams()])
        failed = None
        if self.dist.is_main_process:
            try:
                self._write_checkpoint(model, start_path, iteration, adapters, trainer_state,
                                       streams)
            # A full disk, a lost mount: torch.save says so as a RuntimeError, safetensors as its
            # own error. The last complete checkpoint is intact.
            except (OSError, RuntimeError, SafetensorError) as e:
                free = shutil.disk_usage(self.path).free
                last = (f"the last complete one is {os.path.realpath(self.checkpoint)}"
                        if os.path.exists(self.checkpoint) else "it was the run's first")
                failed = (f"iteration {iteration}: the checkpoint could not be written "
                          f"({error_line(e)}; {free} bytes free there); {last}")
        failed = broadcast_object_list([failed])[0]  # every process stops, or none
        if failed:
            raise RunStopped(failed)

    def _write_checkpoint(self, model, start_path: str, iteration: int, adapters: dict | None,
                          trainer_state: dict, streams: list) -> None:
        """checkpoint-<iteration>/ written whole and flushed to disk, then made the run's by one
        rename of the checkpoint link, then the older checkpoint-*/ removed: a run killed at any
        moment, a save included, keeps its last complete checkpoint."""
        args, folder = self.args, f"checkpoint-{iteration}"
        path = self.file(folder + ".partial")  # whole, it is renamed to checkpoint-<iteration>
        if self.config is not None:  # a resume's command joins config.json with its first save
            write_json(self.file("config.json"), self.config)
            self.config = None
        shutil.rmtree(path, ignore_errors=True)  # a save of this iteration that was killed
        try:
            for name, adapter in [("", model), *(adapters or {}).items()]:
                if adapter is not None:
                    adapter.peft_config["default"].base_model_name_or_path = start_path
                    adapter.save_pretrained(os.path.join(path, name), save_embedding_layers=False)
            with open(os.path.join(path, "README.md"), "w") as f:  # PEFT's is empty
                f.write(f"""---
base_model: {start_path}
library_name: peft
---
# LoRA adapter trained by {self.script}

--advantage {args.advantage}, --env {args.env}, iteration {iteration} of {args.iterations},
seed {args.seed}. The run's configuration is in ../config.json. To load the policy:

```python
from common.model import load_lora, load_model_and_tokenizer  # this repository's common/
model, tokenizer = load_model_and_tokenizer("{start_path}")
policy = load_lora(model, "{os.path.abspath(self.checkpoint)}")
```
""")
            state = {key: _state_of(thing) for key, thing in trainer_state.items()}
            seconds = self.seconds + time.time() - self.began
            torch.save({**state, "iteration": iteration, "history": self.history,
                        "streams": streams, "seconds": seconds, "base_weights": self.base_weights,
                        "run": self.identity()},
                       os.path.join(path, "trainer_state.pt"))
            write_json(os.path.join(path, CHECKSUMS), checksums(path))  # read back on --resume
            _flush_tree(path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        shutil.rmtree(self.file(folder), ignore_errors=True)  # renamed whole, never linked
        os.rename(path, self.file(folder))
        if os.path.isdir(self.checkpoint) and not os.path.islink(self.checkpoint):
            # A run from before the links: its checkpoint/ folder becomes an older checkpoint-*.
            os.rename(self.checkpoint, self.file("checkpoint-0-before-links"))
        self._link(folder)  # the one step: the new checkpoint is the run's
        for old in os.listdir(self.path):
            if old.startswith("checkpoint-") and old != folder:
                shutil.rmtree(self.file(old), ignore_errors=True)

    def _link(self, folder: str) -> None:
        """checkpoint -> folder, by a rename over the old link."""
        link = self.file(".checkpoint.link")
        with contextlib.suppress(FileNotFoundError):
            os.remove(link)
        os.symlink(folder, link)
        os.replace(link, self.checkpoint)
        _flush_tree(self.path, files=False)

    def _relink(self) -> None:
        """The link to the newest whole checkpoint-<iteration>/, when a save was killed after
        renaming it and before linking it (a .partial folder is never whole)."""
        whole = [(int(m.group(1)), name) for name in os.listdir(self.path)
                 if (m := re.fullmatch(r"checkpoint-(\d+)(-before-links)?", name))]
        if whole:
            self._link(max(whole)[1])

    def finish(self) -> dict:
        """Closes the loggers, writes summary.json, prints the headline (start, final and best
        success on the first evaluation split) and ends the processes' group."""
        args = self.args
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as e:  # its last events: as in log()
                raise RunStopped(f"the TensorBoard log cannot be written ({e})") from None
        if args.track and self.dist.is_main_process:
            import wandb

            wandb.finish()
        headline = args.eval_splits[0]
        key = f"eval_{headline}/success"
        summary = {"start_success": self.history.get(0, {}).get(key),
                   "final_success": self.history[max(self.history)][key],
                   "best_success": max(h[key] for h in self.history.values() if key in h),
                   "run_path": self.path,
                   "minutes": (self.seconds + time.time() - self.began) / 60}
        if self.dist.is_main_process:
            evaluations = {str(k): v for k, v in sorted(self.history.items())}
            try:  # a full disk: --resume finishes a run whose last checkpoint has no summary
                if self.config is not None:  # a resume that had nothing left to save
                    write_json(self.file("config.json"), self.config)
                write_json(self.file("summary.json"), {**summary, "evaluations": evaluations})
            except OSError as e:
                raise RunStopped(f"the run's summary cannot be written ({e})") from None
        self.release()
        start = summary["start_success"]
        start = "n/a (resumed)" if start is None else f"{start:.3f}"
        print(f"done: {headline} success {start} (start) -> {summary['final_success']:.3f} "
              f"(final), best {summary['best_success']:.3f}; logs and checkpoint in {self.path} "
              f"(tensorboard --logdir {os.path.dirname(self.path)})")
        if self.dist.num_processes > 1:
            self.dist.destroy_process_group()
        return summary
