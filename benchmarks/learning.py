"""The learning protocol: does a method beat its own baseline? Runs a method script for several
training seeds, pairs each method with its baseline seed by seed, and writes tables and pictures.

Every run starts from the same shipped model (--model tiny), trains with the protocol's budget
and evaluates on every task of --split at temperature 0.4 before and after RL. A seed fixes the
first task draws and the evaluation draws, so the method and its baseline are evaluated on the
same draws (paired); with keyed draws (--sampler keyed, ALFWorld's default) every sampled token is
fixed by where it stands, so the arms share their draws wherever their policies agree. The gain
of a run is its end minus its start; the paired difference of a seed is the method's gain minus
its baseline's. Tables give means +- standard errors (sample std
/ sqrt(seeds)); a method "beats" its baseline only when the paired difference exceeds two
standard errors over at least 6 seeds, anything less is "not distinguishable".

Resumable: each finished run leaves a small record (evaluations with every task's outcome,
per-iteration training success, minutes) under --results, and a run whose record or summary
exists is read, not run again, so a table of many runs can be built over several sittings (commit
the records); a run cut off goes on from its last checkpoint. Runs go seed by seed (each seed's
arms together), and two processes on one results folder share the work: each run is locked while
it runs, and the other process takes the next. The arms of a seed share one start evaluation
(--start-evaluations of the scripts, kept beside the records in starts/).

Choose hyperparameters with --split valid; the test split is for the final tables only.

    python benchmarks/learning.py                                   # ProxMO, GRPO, GiGPO x 6 seeds
    python benchmarks/learning.py --script spa.py                   # SPA and its PPO baseline
    python benchmarks/learning.py --estimators proxmo --split valid -- --learning-rate 1e-3
    python benchmarks/learning.py --estimators oracle grpo --iterations 60 --eval-every 20
    python benchmarks/learning.py --env alfworld --estimators grpo --seeds 1 2 3  # $ALFWORLD_DATA
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import numpy as np  # noqa: E402

import envs  # noqa: E402
from common import (UsageError, folder_error, write_json, write_text,  # noqa: E402
                    written_whole)
from common.run import try_lock  # noqa: E402
from envs import alfworld_env  # noqa: E402
RESULTS = os.path.join(ROOT, "benchmarks", "results", "learning")  # the committed records
# The protocol's training budget on top of the script's tiny defaults, fixed beforehand so that a
# run takes about 12 minutes on 2 cores; the hyperparameters themselves were not tuned.
PROTOCOL_FLAGS = ["--iterations", "20", "--tasks-per-iteration", "8"]
# On ALFWorld (--env alfworld), the same on top of the shipped tiny-alfworld and its preset (50
# steps, every game of the split): as many iterations as fit a run in 30 minutes on 2 idle cores.
ENV_FLAGS = {"household": [], "alfworld": ["--env", "alfworld"]}
ITERATIONS = {"household": 20, "alfworld": 10}
# How the protocol's runs draw their samples (the scripts' --sampler): the household's records were
# all drawn from torch's global stream; ALFWorld's protocol draws by key, so that paired arms share
# their draws (docs/running.md), its records beside the previous protocol's, under keyed/.
SAMPLER = {"household": "global", "alfworld": "keyed"}
# The keyed ALFWorld protocol's evaluations play every game 3 times (--eval-draws), the size chosen
# by measurement (docs/environments.md); the previous protocol's records, once.
EVAL_DRAWS = {("alfworld", "keyed"): 3}
# Each env's held-out splits (household: valid, test); the default is its headline one.
SPLITS = {env: tuple(s for s in envs.SPLITS[env] if s != envs.TRAIN_SPLIT[env])
          for env in envs.ENV_NAMES}
# A script's additions to the protocol: the regime chosen on the valid split (docs/spa.md: SPA
# online with grounding as a cost gained more than on its exploration rollouts, the released
# code's regime and spa.py's default).
SCRIPT_FLAGS = {"spa.py": ["--rl-data", "online"]}
# A baseline that is one run in two scripts: spa.py's and hisr.py's online PPO make the same
# update from the same start (tests/test_spa_rewards.py), and so do sspo.py's and proxmo.py's
# GRPO (tests/test_sspo_e2e.py), so spa.py's protocol reads, and runs, hisr.py's PPO and
# sspo.py's proxmo.py's GRPO (only without extra flags, which would make other runs).
SHARED = {("spa.py", "ppo"): "hisr.py", ("sspo.py", "grpo"): "proxmo.py"}
# Each script's values of --advantage: the method first, then its baselines.
ESTIMATORS = {"proxmo.py": ["proxmo", "grpo", "gigpo"], "spa.py": ["spa", "ppo"],
              "istar.py": ["istar", "rloo", "grpo"], "hisr.py": ["hisr", "ppo"],
              "sspo.py": ["sspo", "grpo"]}
# Each method's own baseline in its script, for the paired differences.
BASELINE = {"proxmo": "grpo", "gigpo": "grpo", "spa": "ppo", "istar": "rloo", "hisr": "ppo",
            "sspo": "grpo", "oracle": "grpo", "oracle-step": "grpo", "placebo": "grpo"}
MIN_SEEDS = 6  # fewer seeds: no claim, however large the difference


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std with n - 1, over sqrt(n)); nan SE if
    n < 2."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def verdict(differences: list[float]) -> str:
    """"beats" / "loses to" when the mean paired difference is more than two standard errors
    from 0 over at least MIN_SEEDS seeds; otherwise "not distinguishable"."""
    if len(differences) < MIN_SEEDS:
        return f"not distinguishable ({len(differences)} < {MIN_SEEDS} seeds)"
    mean, se = mean_and_se(differences)
    if mean > 2 * se:
        return "beats"
    if mean < -2 * se:
        return "loses to"
    return "not distinguishable"


def detectable_lead(sd: float, seeds: int, power: float = 0.8, simulations: int = 20000) -> float:
    """The smallest true mean lead that verdict() calls "beats" with probability `power` when a
    seed's paired difference is normal with this SD: the rule applied to simulated seeds (fixed
    draws, so the answer is a function of its arguments), bisected to 0.001."""
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((simulations, seeds)) * sd
    mean_noise = noise.mean(axis=1)
    se = noise.std(axis=1, ddof=1) / math.sqrt(seeds)  # a shift moves the mean, not the SE
    low, high = 0.0, 10 * sd + 1e-3
    while high - low > 1e-3:
        lead = (low + high) / 2
        passed = np.mean(lead + mean_noise > 2 * se)
        low, high = (low, lead) if passed >= power else (lead, high)
    return high


def evaluation_variance(record: dict, key: str) -> float | None:
    """The sampling variance of a record's end evaluation `key` (eval_<split>/success) when it
    played every game d > 1 times: the mean over games of the draws' variance (n - 1), over
    games x d. None with one draw a game."""
    evaluations = record["evaluations"]
    outcomes = evaluations[max(evaluations, key=int)].get(key.replace("success", "outcomes"))
    won: dict[int, list[int]] = {}
    for game, w, _ in outcomes or []:
        won.setdefault(game, []).append(w)
    draws = {len(v) for v in won.values()}
    if len(draws) != 1 or draws == {1}:  # one draw a game (or no outcomes kept)
        return None
    (d,) = draws
    return float(np.mean([np.var(v, ddof=1) for v in won.values()])) / (len(won) * d)


# ---- runs and their records ---------------------------------------------------------------------
def refuse(message: str):
    """A record, run directory or flag that cannot be used: one line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_name(estimator: str, seed: int) -> str:
    return f"{estimator}-seed{seed}"


def read_json(path: str, remedy: str, needs: tuple[str, ...] = ()) -> dict:
    """A record, summary or config; a missing or damaged one (not a JSON object, or without a
    key of `needs`) is refused by name, with `remedy`."""
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        refuse(f"{path} is missing; {remedy}")
    except OSError as e:  # unreadable, or a folder
        refuse(f"{path} cannot be read ({e.strerror or e}); {remedy}")
    except ValueError as e:  # json.JSONDecodeError
        refuse(f"{path} is damaged ({e}); {remedy}")
    if not isinstance(value, dict):
        refuse(f"{path} is damaged (not a JSON object); {remedy}")
    missing = [key for key in needs if key not in value]
    if missing:
        refuse(f"{path} is damaged (no {', '.join(missing)}); {remedy}")
    return value


def check_record(record: dict, split: str, where: str) -> None:
    """A record the tables can read: evaluations at "0" and later, each with a success, grounding
    and episode length of `split` that are finite numbers in range; refused by name otherwise."""
    evaluations = record.get("evaluations")
    damaged = f"{where} is damaged"
    if not isinstance(evaluations, dict) or "0" not in evaluations:
        refuse(f"{damaged}: no start evaluation (\"0\"); delete it and run it again")
    if not all(k.isdigit() for k in evaluations) or len(evaluations) < 2:
        refuse(f"{damaged}: its evaluations are {sorted(evaluations)}, not the start and later "
               "iterations; delete it and run it again")
    def in_range(value, top: float) -> bool:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and 0 <= value <= top)

    limits = {"success": 1.0, "grounding": 1.0, "episode_length": float("inf")}
    for iteration, stats in evaluations.items():
        if not isinstance(stats, dict):
            refuse(f"{damaged}: iteration {iteration}'s evaluation is {stats!r}, not a table; "
                   "delete it and run it again")
        per_type = [k.split("/", 1)[1] for k in stats if k.startswith(f"eval_{split}/success_")]
        for name, top in {**limits, **{k: 1.0 for k in per_type}}.items():
            value = stats.get(f"eval_{split}/{name}")
            if not in_range(value, top):
                refuse(f"{damaged}: iteration {iteration}'s eval_{split}/{name} is {value!r} "
                       "(not a number in range); delete it and run it again")
    train = record.get("train_success", [])
    if not isinstance(train, list) or not all(in_range(v, 1.0) for v in train):
        refuse(f"{damaged}: its train_success is {train!r}, not successes in [0, 1]; delete it "
               "and run it again")
    if not isinstance(record.get("minutes"), (int, float)) or not math.isfinite(record["minutes"]):
        refuse(f"{damaged}: minutes is {record.get('minutes')!r}; delete it and run it again")


def training_curve(run_path: str, tag: str = "rollout/success") -> list[float]:
    """The per-iteration values of `tag` that the run logged to TensorBoard, by iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_path, size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)]


def make_record(summary_file: str, script: str, estimator: str, seed: int, split: str,
                eval_num_tasks: int, flags: list[str]) -> dict:
    """What the tables read of a finished run: its evaluations, training success per iteration,
    minutes (the run's own clock, from its model loaded to its end, over a resume too), the
    commit, torch version and threads it ran with. The run's config.json must show the run asked
    for: a run directory is never taken on trust."""
    run_path = os.path.dirname(summary_file)
    again = "delete the run directory to run it again"
    summary = read_json(summary_file, f"python {script} --resume {run_path} writes it again",
                        needs=("evaluations",))
    config = read_json(os.path.join(run_path, "config.json"), again, needs=("args", "command"))
    ran = config["args"]
    wanted = {"advantage": estimator, "seed": seed, "eval_splits": [split],
              "eval_num_tasks": eval_num_tasks}
    for key, value in wanted.items():
        if ran.get(key) != value:
            refuse(f"{run_path} ran {key} {ran.get(key)!r}, not {value!r}")
    if os.path.basename(script) not in config["command"]:
        refuse(f"{run_path} is a run of {config['command']!r}, not of {script}")
    if shlex.join(flags) not in config["command"]:
        refuse(f"{run_path} ran {config['command']!r}, not with the flags {shlex.join(flags)!r}")
    now = resolved_args(script, config["command"])
    changed = [f"--{k.replace('_', '-')} {ran.get(k)!r} (now {now[k]!r})" for k in sorted(now)
               if k not in MACHINE and json.dumps(now[k]) != json.dumps(ran.get(k))]
    if changed:
        refuse(f"{run_path} ran with {', '.join(changed)}: {script} resolves the same command "
               "differently today (a default changed since). Delete the run directory to run it "
               "again.")
    if "minutes" in summary:  # the run's own clock: the work a resume kept, not the waiting
        minutes = summary["minutes"]
    else:  # a run from before the clock: its config written, after the model loaded, to its end
        seconds = os.path.getmtime(summary_file) - os.path.getmtime(os.path.join(run_path,
                                                                                  "config.json"))
        minutes = seconds / 60
    record = {"script": script, "estimator": estimator, "seed": seed, "split": split,
              "eval_num_tasks": eval_num_tasks, "flags": flags, "command": config["command"],
              **{key: config.get(key, "not recorded") for key in ("commit", "torch", "threads")},
              "sampler": ran.get("sampler", "global"), "minutes": minutes,
              "evaluations": summary["evaluations"], "train_success": training_curve(run_path)}
    if ran.get("env") == "alfworld":  # the generated games' seed and the engine's version
        record["game_set"] = alfworld_env.game_set(("train", split))
        record["task_set"] = config.get("task_set")  # the games' digest, as the run saw them
    return record


# Settings that depend on the machine or on a resume, or change no number of a run, not on the
# script's defaults.
MACHINE = ("resume", "iterations", "device", "env_workers", "process_timeout_minutes",
           "deterministic", "save_every", "start_evaluations")


def script_module(script: str):
    """The method script as a module: its parse_args, validate_args and Args."""
    import importlib

    return importlib.import_module(os.path.splitext(os.path.basename(script))[0])


def resolved_args(script: str, command: str) -> dict:
    """The settings `script` gives a run's command line today, as its config.json stores them."""
    import dataclasses

    argv = shlex.split(command)
    argv = argv[next(i for i, a in enumerate(argv) if a.endswith(os.path.basename(script))) + 1:]
    return json.loads(json.dumps(dataclasses.asdict(script_module(script).parse_args(argv))))


def flag_errors(script: str, estimators: list[str], seeds: list[int], split: str,
                flags: list[str]) -> list[str]:
    """What the script would refuse in any of the runs, found before the first starts: an
    estimator that is not a value of its --advantage, a bad seed, a bad flag after --."""
    from common.config import choices

    module = script_module(script)
    allowed = choices(module.Args, "advantage")
    errors = [f"--estimators {e}: {script}'s --advantage takes {', '.join(allowed)}"
              for e in estimators if e not in allowed]
    errors += [f"--seeds {s}: a seed is in [0, 2**32)" for s in seeds if not 0 <= s < 2 ** 32]
    for estimator in estimators:  # an estimator may have presets of its own
        if estimator in allowed:
            try:
                args = module.parse_args(["--advantage", estimator, "--eval-splits", split,
                                          *flags])
            except UsageError as e:  # e.g. --resume, which a protocol run never takes
                errors.append(f"{script} {' '.join(flags)}: {e}")
                continue
            errors += [f"{script} {' '.join(flags)}: {e}" for e in module.validate_args(args)]
    return list(dict.fromkeys(errors))


def protocol_flags(env: str, sampler: str, iterations: int) -> list[str]:
    """Every run's flags of the protocol on `env`, drawing by `sampler`."""
    flags = ["--iterations", str(iterations), *PROTOCOL_FLAGS[2:], *ENV_FLAGS[env]]
    draws = EVAL_DRAWS.get((env, sampler), 1)
    return flags + (["--eval-draws", str(draws)] if draws > 1 else [])


def run_one(script: str, estimator: str, seed: int, split: str, eval_num_tasks: int,
            runs_dir: str, records_dir: str, flags: list[str], eval_every: int | None = None,
            starts: str | None = None, sampler: str = "global") -> dict | None:
    """One training run's record: read from records_dir, else made from a finished run in
    runs_dir, else the run is started there, or resumed from its last checkpoint (its log beside
    it), and then recorded. None when another process is running it now. `sampler`: the
    protocol's draws (--sampler of the scripts); a record drawn otherwise is refused."""
    record_file = os.path.join(records_dir, run_name(estimator, seed) + ".json")
    if os.path.isfile(record_file):
        record = read_json(record_file, "delete it: the run's directory makes it again, or the "
                           "run is run again")
        wanted = {"script": script, "estimator": estimator, "seed": seed, "split": split,
                  "eval_num_tasks": eval_num_tasks, "flags": flags}
        for key, value in wanted.items():
            if record.get(key) != value:
                refuse(f"{record_file} was run with {key} {record.get(key)!r}, not {value!r}: a "
                       "record filed in the wrong place, or another --results")
        command = shlex.split(record.get("command", ""))
        if (_last_value(command, "--advantage"), _last_value(command, "--seed")) != (
                estimator, str(seed)):
            refuse(f"{record_file}: its command {record.get('command')!r} is not {estimator} "
                   f"seed {seed}'s")
        if record.get("sampler", "global") != sampler:  # before keyed draws: torch's stream
            refuse(f"{record_file} drew its samples by {record.get('sampler', 'global')!r}, not "
                   f"{sampler!r}: a record of another protocol (--sampler), or another --results")
        check_record(record, split, record_file)
        print(f"  {run_name(estimator, seed)}: recorded", flush=True)
        return record
    run_dir = os.path.join(runs_dir, run_name(estimator, seed))
    command = [sys.executable, os.path.join(ROOT, script), "--advantage", estimator,
               "--seed", str(seed), "--eval-splits", split,
               "--eval-num-tasks", str(eval_num_tasks), "--sampler", sampler,
               "--run-dir", run_dir, *flags]
    iterations = _last_value(command, "--iterations")
    if iterations is not None:  # evaluate at the start, every eval_every and at the end
        command += ["--eval-every", str(eval_every or iterations)]
    if starts:
        command += ["--start-evaluations", starts]
    os.makedirs(run_dir, exist_ok=True)
    lock = try_lock(run_dir)  # held while this process runs it: two processes share the runs
    if lock is None:
        print(f"  {run_name(estimator, seed)}: running in another process; skipped", flush=True)
        return None
    try:
        summaries = sorted(glob.glob(os.path.join(run_dir, "*", "summary.json")))
        if summaries:  # finished, with no record yet
            print(f"  {run_name(estimator, seed)}: finished in {run_dir}", flush=True)
        else:
            summaries = [start_or_resume(command, run_dir, runs_dir, run_name(estimator, seed))]
        record = make_record(summaries[-1], script, estimator, seed, split, eval_num_tasks, flags)
        check_record(record, split, summaries[-1])
        try:
            os.makedirs(records_dir, exist_ok=True)
            write_json(record_file, record)  # whole or not at all
        except OSError as e:  # a full disk, say: the finished run is recorded at the next sitting
            raise SystemExit(f"error: cannot write {record_file} ({e}); the run is kept in "
                             f"{run_dir}, and the next sitting records it") from None
    finally:
        os.close(lock)
    evaluations = record["evaluations"]
    start, end = evaluations["0"], evaluations[max(evaluations, key=int)]
    print(f"  start {start[f'eval_{split}/success']:.3f} -> end {end[f'eval_{split}/success']:.3f}"
          f" ({record['minutes']:.1f} min)", flush=True)
    return record


def start_or_resume(command: list[str], run_dir: str, runs_dir: str, name: str) -> str:
    """Runs `command`, or resumes the newest unfinished run in run_dir that kept a checkpoint
    (the rest of its command is its config.json's); returns the summary.json it leaves."""
    unfinished = sorted(glob.glob(os.path.join(run_dir, "*", "checkpoint", "trainer_state.pt")),
                        key=os.path.getmtime)
    if unfinished:
        path = os.path.dirname(os.path.dirname(unfinished[-1]))
        command = [*command[:2], "--resume", path, "--iterations",
                   _last_value(command, "--iterations")]
    log_file = os.path.join(runs_dir, name + ".log")
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(command)}", flush=True)
    with open(log_file, "a" if unfinished else "w") as log:
        run = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            returncode = run.wait()
        except KeyboardInterrupt:
            # Ctrl-C reaches the run too (one process group): it stops, and logs how to resume.
            try:
                run.wait(timeout=30)
            except subprocess.TimeoutExpired:  # the signal was this process's alone
                run.send_signal(signal.SIGINT)
                run.wait()
            raise
    if returncode != 0:
        with open(log_file) as f:
            tail = f.read()[-2000:]
        raise SystemExit(f"run failed (exit {returncode}), log {log_file}:\n{tail}")
    summaries = sorted(glob.glob(os.path.join(run_dir, "*", "summary.json")),
                       key=os.path.getmtime)
    return summaries[-1]


def finished(records_dir: str, runs_dir: str, estimator: str, seed: int) -> bool:
    """Whether the run has a record, or a finished run directory to make one from."""
    name = run_name(estimator, seed)
    return (os.path.isfile(os.path.join(records_dir, name + ".json"))
            or bool(glob.glob(os.path.join(runs_dir, name, "*", "summary.json"))))


def as_taken(flags: list[str]) -> list[str]:
    """The flags as a run takes them: each flag once, with the values it was given last, in the
    order flags were first given (a flag repeated after -- overrides the protocol's)."""
    taken: dict[str, list[str]] = {}
    name = None
    for token in flags:
        if token.startswith("--"):
            name = token
            taken[name] = []  # given again: the last values win
        elif name is not None:
            taken[name].append(token)
    first = list(dict.fromkeys(f for f in flags if f.startswith("--")))
    return [t for f in first for t in [f, *taken[f]]]


def _last_value(command: list[str], flag: str) -> str | None:
    values = [command[i + 1] for i, c in enumerate(command[:-1]) if c == flag]
    return values[-1] if values else None


# ---- tables -------------------------------------------------------------------------------------
def gain(record: dict, key: str) -> tuple[float, float]:
    """(start, end) of an evaluation key: the first and the last evaluation."""
    evaluations = record["evaluations"]
    return evaluations["0"][key], evaluations[max(evaluations, key=int)][key]


def table(script: str, split: str, results: dict[str, dict[int, dict]]) -> str:
    """Markdown: one row per estimator, one per estimator and task type."""
    lines = ["| script | estimator | seeds | start success | after RL | gain +- SE | "
             "grounding start -> end | episode length start -> end | minutes per run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    per_type = []
    for estimator, runs in results.items():
        records = list(runs.values())

        def cell(key: str) -> tuple[str, str, str]:
            pairs = [gain(r, key) for r in records]
            start, _ = mean_and_se([s for s, _ in pairs])
            end, _ = mean_and_se([e for _, e in pairs])
            mean, se = mean_and_se([e - s for s, e in pairs])
            return f"{start:.3f}", f"{end:.3f}", f"{mean:+.3f} +- {se:.3f}"

        start, end, change = cell(f"eval_{split}/success")
        g_start, g_end, _ = cell(f"eval_{split}/grounding")
        steps = [gain(r, f"eval_{split}/episode_length") for r in records]
        s_start, s_end = (mean_and_se([pair[k] for pair in steps])[0] for k in (0, 1))
        minutes, _ = mean_and_se([r["minutes"] for r in records])
        lines.append(f"| {script} | {estimator} | {len(records)} | {start} | {end} | {change} | "
                     f"{g_start} -> {g_end} | {s_start:.1f} -> {s_end:.1f} | {minutes:.1f} |")
        types = sorted(k.rsplit("_", 1)[1] for k in records[0]["evaluations"]["0"]
                       if k.startswith(f"eval_{split}/success_"))
        for task_type in types:
            start, end, change = cell(f"eval_{split}/success_{task_type}")
            per_type.append(f"| {estimator} | {task_type} | {start} | {end} | {change} |")
    lines += ["", "| estimator | task type | start | after RL | gain +- SE |",
              "| --- | --- | --- | --- | --- |", *per_type]
    return "\n".join(lines)


def gain_differences(split: str, runs: dict[int, dict],
                     baseline_runs: dict[int, dict]) -> tuple[list[int], list[float]]:
    """({seed: record} of a method and of its baseline) -> (the seeds both ran, ascending; per
    seed the method's success gain on `split` minus the baseline's)."""
    key = f"eval_{split}/success"
    seeds = sorted(set(runs) & set(baseline_runs))
    differences = []
    for seed in seeds:
        m_start, m_end = gain(runs[seed], key)
        b_start, b_end = gain(baseline_runs[seed], key)
        differences.append((m_end - m_start) - (b_end - b_start))
    return seeds, differences


def paired_differences(split: str, results: dict[str, dict[int, dict]]) -> dict[str, dict]:
    """For each method whose baseline ran too: the seeds both ran, and per seed the method's gain
    minus the baseline's."""
    key = f"eval_{split}/success"
    out = {}
    for method, runs in results.items():
        baseline = BASELINE.get(method)
        if baseline not in results:
            continue
        seeds, differences = gain_differences(split, runs, results[baseline])
        noise = [[evaluation_variance(r, key) for r in (runs[seed], results[baseline][seed])]
                 for seed in seeds]
        if seeds:
            known = [a + b for a, b in noise if a is not None and b is not None]
            out[method] = {"baseline": baseline, "seeds": seeds, "differences": differences,
                           "evaluation_variance": (float(np.mean(known))
                                                   if len(known) == len(seeds) else None)}
    return out


def curve_table(split: str, results: dict[str, dict[int, dict]]) -> str:
    """Markdown: at every evaluation all runs share, each estimator's mean success and gain, and
    each method's paired difference to its baseline with its verdict."""
    key = f"eval_{split}/success"
    records = [r for runs in results.values() for r in runs.values()]
    common = sorted(set.intersection(*(set(r["evaluations"]) for r in records)), key=int)[1:]
    lines = ["| iteration | estimator | seeds | success | gain +- SE | paired with baseline +- SE "
             "| verdict |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for iteration in common:
        for estimator, runs in results.items():
            gains = {seed: r["evaluations"][iteration][key] - r["evaluations"]["0"][key]
                     for seed, r in runs.items()}
            success, _ = mean_and_se([r["evaluations"][iteration][key] for r in runs.values()])
            mean, se = mean_and_se(list(gains.values()))
            paired, judged = "", ""
            baseline = BASELINE.get(estimator)
            if baseline in results:
                base = results[baseline]
                differences = [gains[seed] - (base[seed]["evaluations"][iteration][key]
                                              - base[seed]["evaluations"]["0"][key])
                               for seed in sorted(set(runs) & set(base))]
                if differences:
                    d_mean, d_se = mean_and_se(differences)
                    paired = f"{d_mean:+.3f} +- {d_se:.3f} ({len(differences)} seeds)"
                    judged = verdict(differences)
            lines.append(f"| {iteration} | {estimator} | {len(runs)} | {success:.3f} | "
                         f"{mean:+.3f} +- {se:.3f} | {paired} | {judged} |")
    return "\n".join(lines)


def paired_table(pairs: dict[str, dict]) -> str:
    """Markdown: one row per method and its baseline, with the SD of a seed's difference, split
    (with several draws a game) into its two end evaluations' part, as if their draws were
    independent (shared keys only lower it), and the rest, training's; and the leads 6, 9 and 12
    seeds detect at 80 % power with that SD."""
    lines = ["| method | baseline | seeds | difference per seed | mean difference +- SE | "
             "verdict | SD per seed (evaluations, training) | lead seen at 80 % by 6 / 9 / 12 "
             "seeds |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method, pair in pairs.items():
        mean, se = mean_and_se(pair["differences"])
        per_seed = " / ".join(f"{d:+.3f}" for d in pair["differences"])
        spread, seen = "", ""
        if len(pair["differences"]) > 1:
            sd = se * math.sqrt(len(pair["differences"]))
            spread = f"{sd:.3f}"
            if pair.get("evaluation_variance") is not None:
                evaluations = pair["evaluation_variance"]
                training = math.sqrt(max(sd ** 2 - evaluations, 0.0))
                spread += f" ({math.sqrt(evaluations):.3f}, {training:.3f})"
            seen = " / ".join(f"{detectable_lead(sd, n):+.3f}" for n in (6, 9, 12))
        lines.append(f"| {method} | {pair['baseline']} | {len(pair['seeds'])} | {per_seed} | "
                     f"{mean:+.3f} +- {se:.3f} | {verdict(pair['differences'])} | {spread} | "
                     f"{seen} |")
    return "\n".join(lines)


# ---- pictures -----------------------------------------------------------------------------------
def plot(script: str, split: str, results: dict[str, dict[int, dict]], pairs: dict[str, dict],
         path: str) -> None:
    """Left: training success per iteration, mean over seeds with a band of +- one SE. Right:
    each method's paired difference to its baseline, every seed a dot, the mean +- 2 SE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for runs in results.values() for r in runs.values()]
    steps = sorted(set.intersection(*(set(r["evaluations"]) for r in records)), key=int)
    if len(steps) > 2:  # a curve of evaluations too (--eval-every)
        fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 3.6),
                                                  gridspec_kw={"width_ratios": [3, 2, 2]})
        key = f"eval_{split}/success"
        for estimator, runs in results.items():
            stats = [mean_and_se([r["evaluations"][k][key] for r in runs.values()])
                     for k in steps]
            middle.errorbar([int(k) for k in steps], [m for m, _ in stats],
                            yerr=[0 if math.isnan(e) else e for _, e in stats], capsize=3,
                            marker="o", label=f"{estimator} ({len(runs)} seeds)")
        middle.set_xlabel("iteration")
        middle.set_ylabel(f"{split} success (all tasks)")
        middle.set_title("evaluations, mean +- SE over seeds", fontsize=9)
        middle.legend(fontsize=7)
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6),
                                          gridspec_kw={"width_ratios": [3, 2]})
    for estimator, runs in results.items():
        curves = [r["train_success"] for r in runs.values() if r["train_success"]]
        if not curves:
            continue
        length = min(len(c) for c in curves)
        stats = [mean_and_se([c[i] for c in curves]) for i in range(length)]
        means = [m for m, _ in stats]
        ses = [0.0 if math.isnan(s) else s for _, s in stats]
        xs = list(range(1, length + 1))
        left.plot(xs, means, label=f"{estimator} ({len(curves)} seeds)")
        left.fill_between(xs, [m - s for m, s in zip(means, ses)],
                          [m + s for m, s in zip(means, ses)], alpha=0.2)
    left.set_xlabel("iteration")
    left.set_ylabel("training success (rollouts)")
    left.set_title(f"{script}: training success, mean +- SE over seeds", fontsize=9)
    left.legend(fontsize=7)
    for k, (method, pair) in enumerate(pairs.items()):
        mean, se = mean_and_se(pair["differences"])
        right.scatter([k] * len(pair["differences"]), pair["differences"], s=12, color="grey")
        right.errorbar([k + 0.15], [mean], yerr=[0 if math.isnan(se) else 2 * se], fmt="o",
                       capsize=4)
    if not pairs:
        right.text(0.5, 0.5, "no baseline run to pair with", ha="center", va="center",
                   transform=right.transAxes, fontsize=9)
    right.axhline(0, color="black", linewidth=0.8)
    right.set_xlim(-0.5, max(len(pairs), 1) - 0.5)
    right.set_xticks(range(len(pairs)), [f"{m} - {p['baseline']}\n({len(p['seeds'])} seeds)"
                                         for m, p in pairs.items()], fontsize=8)
    right.set_ylabel(f"paired difference of {split} gains")
    right.set_title("per seed (dots), mean +- 2 SE", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)


def save_png(fig, path: str) -> None:
    """Write a matplotlib figure to `path` whole (a failure leaves no partial picture), then
    close it."""
    import matplotlib.pyplot as plt

    try:
        with written_whole(path) as partial:
            fig.savefig(partial, dpi=120, format="png")
    finally:
        plt.close(fig)


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Flags after -- go to every run of the script, after "
                                            "the protocol's: " + " ".join(PROTOCOL_FLAGS) +
                                            ". Runs already recorded under --results, or "
                                            "finished under --runs, are read, not run again.")
    parser.add_argument("--script", default="proxmo.py", help="method script (default proxmo.py)")
    parser.add_argument("--env", default="household", choices=list(SPLITS),
                        help="environment (default household; alfworld reads $ALFWORLD_DATA)")
    parser.add_argument("--estimators", nargs="+", default=None,
                        help="values of the script's --advantage (default: the script's method "
                             "and baselines, " + "; ".join(f"{k}: {' '.join(v)}"
                                                           for k, v in ESTIMATORS.items()) + ")")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6],
                        help="training seeds (default 1-6: a claim needs 6)")
    parser.add_argument("--split", default=None, choices=[s for v in SPLITS.values() for s in v],
                        help="evaluation split, every task of it (default test, on alfworld "
                             "valid_unseen; tune on valid, valid_seen)")
    parser.add_argument("--eval-num-tasks", type=int, default=0,
                        help="first tasks of --split to evaluate (default 0 = all: the protocol)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="training iterations of every run (default the protocol's: 20, "
                             "on alfworld 10)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="evaluate every this many iterations too (default: at the end only)")
    parser.add_argument("--sampler", default=None, choices=["keyed", "global"],
                        help="how every run draws its samples (default: household global, its "
                             "records'; alfworld keyed, each held-out game played 3 times); "
                             "keyed records go under keyed/")
    parser.add_argument("--results", default=None,
                        help="records, table.md and learning.png (default benchmarks/results/"
                             "learning/[alfworld/][keyed/]<split>/<script>, with the extra flags "
                             "in the name)")
    parser.add_argument("--runs", default=os.path.join("runs", "learning"),
                        help="where the run directories and their logs go (default "
                             "runs/learning)")
    parser.add_argument("--finished-only", action="store_true",
                        help="tables and pictures of the finished runs alone; start none")
    own, extra = argv, []
    if "--" in argv:
        own, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(own)
    if not os.path.isfile(os.path.join(ROOT, args.script)):
        parser.error(f"--script {args.script}: no such file in {ROOT}")
    if args.estimators is None:
        if args.script not in ESTIMATORS:
            parser.error(f"--script {args.script}: name its --advantage values with --estimators")
        args.estimators = ESTIMATORS[args.script]
    args.split = args.split or envs.EVAL_SPLITS[args.env][0]
    if args.split not in SPLITS[args.env]:
        parser.error(f"--split {args.split} is not a split of {args.env}: "
                     f"{', '.join(SPLITS[args.env])}")
    if args.iterations is None:
        args.iterations = ITERATIONS[args.env]
    if args.eval_num_tasks or not args.finished_only:  # tables from records need no games
        try:
            split_size = len(envs.list_tasks(args.env, args.split))
        except UsageError as e:  # no games where ALFWORLD_DATA points
            parser.error(str(e))
        if not 0 <= args.eval_num_tasks <= split_size:
            parser.error(f"--eval-num-tasks must be in [0, {split_size}] (0 = all {split_size} "
                         f"{args.split} tasks)")
    if not 1 <= args.iterations <= 100_000:
        parser.error("--iterations must be in [1, 100000]")
    if args.eval_every is not None and not 1 <= args.eval_every <= args.iterations:
        parser.error(f"--eval-every must be in [1, --iterations {args.iterations}]")
    if "--eval-every" in extra:
        parser.error("--eval-every is learning.py's own flag: give it before --")
    owned = ["--advantage", "--seed", "--eval-splits", "--eval-num-tasks", "--run-dir",
             "--resume", "--start-evaluations", "--sampler", "--eval-draws"]
    taken = [flag for flag in owned if flag in extra]
    if taken:  # e.g. --run-dir elsewhere: the run would finish where no record is made
        parser.error(f"{', '.join(taken)} after --: the protocol sets them for each run "
                     "(--estimators, --seeds, --split, --eval-num-tasks, --runs, --sampler; "
                     "--eval-draws follows the sampler)")
    args.sampler = args.sampler or SAMPLER[args.env]
    protocol = protocol_flags(args.env, args.sampler, args.iterations)
    results_root = RESULTS if args.env == "household" else os.path.join(RESULTS, args.env)
    sampled = "keyed" if args.sampler == "keyed" else ""  # keyed runs' records and runs apart
    results_root = os.path.join(results_root, sampled)

    def places(script: str) -> tuple[list[str], str, str]:
        """A script's protocol flags, records directory and runs directory."""
        named = ([f"iterations{args.iterations}"] if args.iterations != ITERATIONS[args.env]
                 else []) + extra
        named += [f"eval{args.eval_num_tasks}"] if args.eval_num_tasks else []
        where = os.path.join(args.split, script)
        if named:  # runs with other flags are other runs
            where = os.path.join(where, "-".join(re.sub(r"[^\w.=-]+", "", e.lstrip("-"))
                                                 for e in named))
        records = args.results or os.path.join(results_root, where)
        return (protocol + SCRIPT_FLAGS.get(script, []) + extra, records,
                os.path.abspath(os.path.join(args.runs, sampled, where)))

    flags, records_dir, runs_dir = places(args.script)
    errors = flag_errors(args.script, args.estimators, args.seeds, args.split, flags)
    errors += [e for e in (folder_error("--results", args.results or records_dir),
                           folder_error("--runs", args.runs)) if e]
    if errors:
        parser.error("\n".join(errors))
    # The arms of a seed share one start evaluation, kept beside the records.
    starts = os.path.abspath(os.path.join(args.results, "starts") if args.results
                             else os.path.join(results_root, args.split, "starts"))
    scripts = {}
    for estimator in args.estimators:
        scripts[estimator] = args.script
        if (args.script, estimator) in SHARED and not extra and args.results is None:
            scripts[estimator] = SHARED[args.script, estimator]
            print(f"{estimator}: {scripts[estimator]}'s runs (the same update)", flush=True)
    results: dict[str, dict[int, dict]] = {estimator: {} for estimator in args.estimators}
    for seed in args.seeds:  # seed by seed: a sitting cut short leaves whole pairs
        for estimator in args.estimators:
            script = scripts[estimator]
            run_flags, run_records, run_runs = places(script)
            if args.finished_only and not finished(run_records, run_runs, estimator, seed):
                continue
            record = run_one(script, estimator, seed, args.split, args.eval_num_tasks, run_runs,
                             run_records, run_flags, args.eval_every, starts, args.sampler)
            if record is not None:
                results[estimator][seed] = record
    for estimator in args.estimators:  # runs another process finished meanwhile
        run_flags, run_records, run_runs = places(scripts[estimator])
        for seed in args.seeds:
            if seed not in results[estimator] and os.path.isfile(
                    os.path.join(run_records, run_name(estimator, seed) + ".json")):
                results[estimator][seed] = run_one(
                    scripts[estimator], estimator, seed, args.split, args.eval_num_tasks,
                    run_runs, run_records, run_flags, args.eval_every, starts, args.sampler)
    results = {estimator: runs for estimator, runs in results.items() if runs}
    if not results:
        raise SystemExit(f"no finished run in {records_dir} or {runs_dir}")
    pairs = paired_differences(args.split, results)
    for method, pair in pairs.items():  # a comparison's arms run at one code version
        for seed in pair["seeds"]:
            commits = {results[arm][seed].get("commit", "not recorded")
                       for arm in (method, pair["baseline"])}
            if len(commits) > 1 or "not recorded" in commits:
                shown = sorted(c if c == "not recorded" else c[:7] for c in commits)
                print(f"note: {method} - {pair['baseline']} seed {seed}: the arms' commits are "
                      f"{', '.join(shown)}; rerun the older arm (delete its record) before a "
                      "claim", file=sys.stderr)
    markdown = table(args.script, args.split, results)
    if pairs:
        markdown += "\n\n" + paired_table(pairs)
    if args.eval_every:
        markdown += "\n\n" + curve_table(args.split, results)
    seeds = sorted({seed for runs in results.values() for seed in runs})
    try:
        os.makedirs(records_dir, exist_ok=True)
        write_text(os.path.join(records_dir, "table.md"), f"flags: {' '.join(as_taken(flags))}; "
                   f"seeds {seeds}; split {args.split}\n\n{markdown}\n")
        plot(args.script, args.split, results, pairs, os.path.join(records_dir, "learning.png"))
    except OSError as e:  # a full disk, say: the records are kept, the table is printed
        print(markdown)
        raise SystemExit(f"error: cannot write in {records_dir} ({e}); the table is above")
    print(markdown)
    print(f"(records, table.md and learning.png in {records_dir}; runs and logs in {runs_dir})")
    return markdown


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:  # the runs are kept: a run resumes from its last checkpoint
        print("\ninterrupted; the same command goes on from the records and each unfinished "
              "run's last checkpoint", file=sys.stderr)
        sys.exit(130)
