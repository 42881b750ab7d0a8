"""A start that learns on ALFWorld: behavior-cloning candidates for a tiny ALFWorld model, chosen
on valid_seen by the rule written before their runs (docs/environments.md, "A start that learns on
ALFWorld").

Each candidate clones tiny-scratch on the game set's expert demonstrations (proxmo.py
--iterations 0: behavior cloning, then one evaluation; record the demonstrations first with
`python -m envs.alfworld_games --demonstrations`, or the expert plays them in every run) and plays
every valid_seen game at temperature 0.4, at most 50 steps. Its record (the commit, command,
minutes, cloning stats, the game set, every game's outcome) goes to --results; a recorded
candidate is read, not run again, and two processes share the candidates (each is locked while it
runs). The table compares the candidates in CANDIDATES' order, game by game: a costlier candidate
replaces the chosen one only if it wins more games by more than 2 SE of the per-game paired
difference; otherwise the cheaper one stays.

    export ALFWORLD_DATA=~/alfworld_data   # a game set: python -m envs.alfworld_games ...
    python benchmarks/alfworld_start.py --candidates h1 h3 h5
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common import UsageError, write_json  # noqa: E402
from common.run import try_lock  # noqa: E402
from envs import alfworld_env  # noqa: E402
from learning import mean_and_se, read_json, refuse, training_curve  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "alfworld-start")
SPLIT = "valid_seen"
# Every candidate: tiny-scratch cloned for 3 epochs at seed 1, then valid_seen's every game.
START_FLAGS = ["--env", "alfworld", "--model", "tiny-scratch", "--seed", "1", "--bc-epochs", "3",
               "--max-episode-steps", "50", "--iterations", "0", "--eval-splits", SPLIT,
               "--eval-num-tasks", "0", "--eval-temperature", "0.4"]
CANDIDATES = {  # name -> its flags on top of START_FLAGS; cheapest first, as the rule orders them
    "h1": ["--history-length", "1", "--bc-num-tasks", "500"],
    "h3": ["--history-length", "3", "--bc-num-tasks", "500"],
    "h5": ["--history-length", "5", "--bc-num-tasks", "500"],
    # then the chosen history on every demonstration of the set (2,040 train games)
    "h1-all": ["--history-length", "1", "--bc-num-tasks", "2040"],
    "h3-all": ["--history-length", "3", "--bc-num-tasks", "2040"],
    "h5-all": ["--history-length", "5", "--bc-num-tasks", "2040"],
}


def paired(chosen: list, candidate: list) -> tuple[float, float]:
    """Mean and SE of candidate - chosen over the games both played: outcomes are
    [game index, won 0/1, steps] lists, as evaluations store them."""
    won = {game: w for game, w, _ in chosen}
    differences = [w - won[game] for game, w, _ in candidate if game in won]
    if len(differences) != len(chosen):
        refuse(f"the candidates played different games ({len(chosen)} and {len(differences)} "
               "in common): records of another game set?")
    return mean_and_se(differences)


def run_candidate(name: str, runs_dir: str, records_dir: str) -> dict | None:
    """The candidate's record: read, or made from its finished run, or run now and recorded.
    None when another process is running it."""
    record_file = os.path.join(records_dir, f"{name}.json")
    if os.path.isfile(record_file):
        record = read_json(record_file, "delete it to run the candidate again")
        if record.get("flags") != CANDIDATES[name]:
            refuse(f"{record_file} ran {record.get('flags')}, not {CANDIDATES[name]}")
        print(f"  {name}: recorded", flush=True)
        return record
    run_dir = os.path.join(runs_dir, name)
    os.makedirs(run_dir, exist_ok=True)
    lock = try_lock(run_dir)
    if lock is None:
        print(f"  {name}: running in another process; skipped", flush=True)
        return None
    try:
        summaries = glob.glob(os.path.join(run_dir, "*", "summary.json"))
        if not summaries:
            command = [sys.executable, os.path.join(ROOT, "proxmo.py"), *START_FLAGS,
                       *CANDIDATES[name], "--run-dir", run_dir, "--exp-name", name]
            log_file = os.path.join(runs_dir, f"{name}.log")
            print(f"[{time.strftime('%H:%M:%S')}] {' '.join(command)} (log {log_file})",
                  flush=True)
            with open(log_file, "w") as log:
                result = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            if result.returncode != 0:
                with open(log_file) as f:
                    tail = f.read()[-2000:]
                raise SystemExit(f"{name} failed (exit {result.returncode}), log {log_file}:\n"
                                 f"{tail}")
            summaries = glob.glob(os.path.join(run_dir, "*", "summary.json"))
        run_path = os.path.dirname(sorted(summaries)[-1])
        summary = read_json(os.path.join(run_path, "summary.json"), "delete the run directory")
        config = read_json(os.path.join(run_path, "config.json"), "delete the run directory")
        record = {"name": name, "flags": CANDIDATES[name], "start_flags": START_FLAGS,
                  "command": config["command"], "commit": config.get("commit", "not recorded"),
                  "minutes": summary["minutes"],
                  "game_set": alfworld_env.game_set(("train", SPLIT)),
                  "behavior_cloning": {tag: training_curve(run_path, tag)[-1] for tag in
                                       ("bc/loss", "bc/steps", "bc/seconds", "bc/demo_success")},
                  "evaluation": summary["evaluations"]["0"], "run": run_path}
        os.makedirs(records_dir, exist_ok=True)
        write_json(record_file, record)
    finally:
        os.close(lock)
    return record


def table(records: dict[str, dict]) -> tuple[str, str]:
    """(the table, the chosen candidate): success, grounding and episode length of each
    candidate, and the rule's choice, each one against the candidate chosen before it."""
    lines = ["| candidate | flags | success | grounding | steps | minutes | vs chosen | choice |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    chosen = None
    for name, record in records.items():
        stats = record["evaluation"]
        outcomes = stats[f"eval_{SPLIT}/outcomes"]
        versus, choice = "", "chosen (the first)"
        if chosen is not None:
            mean, se = paired(records[chosen]["evaluation"][f"eval_{SPLIT}/outcomes"], outcomes)
            versus = f"{mean:+.3f} +- {se:.3f} vs {chosen}"
            choice = "chosen" if mean > 2 * se else f"{chosen} stays"
        if chosen is None or choice == "chosen":
            chosen = name
        lines.append(f"| {name} | {' '.join(record['flags'])} | "
                     f"{stats[f'eval_{SPLIT}/success']:.3f} ({sum(o[1] for o in outcomes)}/"
                     f"{len(outcomes)}) | {stats[f'eval_{SPLIT}/grounding']:.3f} | "
                     f"{stats[f'eval_{SPLIT}/episode_length']:.1f} | {record['minutes']:.1f} | "
                     f"{versus} | {choice} |")
    return "\n".join(lines) + "\n", chosen


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES),
                        choices=list(CANDIDATES), metavar="NAME",
                        help=f"candidates to run or read, in the rule's order (default all: "
                             f"{' '.join(CANDIDATES)})")
    parser.add_argument("--results", default=RESULTS, help="records and table.md")
    parser.add_argument("--runs", default=os.path.join(ROOT, "runs", "alfworld-start"),
                        help="the candidates' run directories and logs")
    args = parser.parse_args(argv)
    try:
        alfworld_env.game_files("train")  # no game set: the message that says how to make one
    except UsageError as e:
        refuse(str(e))
    order = [name for name in CANDIDATES if name in args.candidates]
    records = {}
    for name in order:
        record = run_candidate(name, args.runs, args.results)
        if record is not None:
            records[name] = record
    for name in order:  # those another process finished meanwhile
        if name not in records and os.path.isfile(os.path.join(args.results, f"{name}.json")):
            records[name] = run_candidate(name, args.runs, args.results)
    missing = [name for name in order if name not in records]
    text, chosen = table({name: records[name] for name in order if name in records})
    if missing:  # the rule goes in order: no choice before every candidate is in
        print(f"{text}\nstill running elsewhere: {' '.join(missing)}; no choice yet")
        return 0
    text += f"\nchosen: {chosen}\n"
    print(text)
    with open(os.path.join(args.results, "table.md"), "w") as f:
        f.write(f"{SPLIT}, every game, T=0.4, 50 steps; flags on top of: "
                f"{' '.join(START_FLAGS)}\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
