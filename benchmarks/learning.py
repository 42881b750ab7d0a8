"""The learning protocol: does RL beat its start? Runs a method script for several training seeds
and prints one markdown table.

Every run starts from the same shipped model (--model tiny), trains with the protocol's budget
and evaluates on every task of --split at temperature 0.4 before and after RL, with the same
evaluation seed at both ends (paired draws). The gain of a seed is its end minus its start; the
table gives the mean gain over seeds +- its standard error (sample std / sqrt(seeds)).

Choose hyperparameters with --split valid; the test split is for the final table only.

    python benchmarks/learning.py                                   # ProxMO, GRPO, GiGPO x 3 seeds
    python benchmarks/learning.py --script spa.py                   # SPA and its PPO baseline
    python benchmarks/learning.py --estimators proxmo --split valid -- --learning-rate 1e-3
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The protocol's training budget on top of the script's tiny defaults, fixed beforehand so that a
# run takes about 12 minutes on 2 cores; the hyperparameters themselves were not tuned.
PROTOCOL_FLAGS = ["--iterations", "20", "--tasks-per-iteration", "8"]
# Each script's values of --advantage: the method first, then its baselines.
ESTIMATORS = {"proxmo.py": ["proxmo", "grpo", "gigpo"], "spa.py": ["spa", "ppo"],
              "istar.py": ["istar", "rloo", "grpo"], "hisr.py": ["hisr", "ppo"],
              "sspo.py": ["sspo", "grpo"]}


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std with n - 1, over sqrt(n)); nan SE if
    n < 2."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def run_one(script: str, estimator: str, seed: int, split: str, eval_num_tasks: int,
            out_dir: str, flags: list[str]) -> dict:
    """One training run; its summary.json with the run's wall-clock minutes added."""
    run_dir = os.path.join(out_dir, f"{estimator}-seed{seed}")
    command = [sys.executable, os.path.join(ROOT, script), "--advantage", estimator,
               "--seed", str(seed), "--eval-splits", split,
               "--eval-num-tasks", str(eval_num_tasks),
               "--run-dir", run_dir, *flags]
    iterations = _last_value(command, "--iterations")
    if iterations is not None:  # evaluate only at the start and the end
        command += ["--eval-every", iterations]
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(command)}", flush=True)
    began = time.time()
    log_file = os.path.join(out_dir, f"{estimator}-seed{seed}.log")
    with open(log_file, "w") as log:
        result = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    minutes = (time.time() - began) / 60
    if result.returncode != 0:
        with open(log_file) as f:
            tail = f.read()[-2000:]
        raise SystemExit(f"run failed (exit {result.returncode}), log {log_file}:\n{tail}")
    (summary_file,) = glob.glob(os.path.join(run_dir, "*", "summary.json"))
    with open(summary_file) as f:
        summary = json.load(f)
    summary["minutes"] = minutes
    evaluations = summary["evaluations"]
    start, end = evaluations["0"], evaluations[max(evaluations, key=int)]
    print(f"  start {start[f'eval_{split}/success']:.3f} -> end {end[f'eval_{split}/success']:.3f}"
          f" ({minutes:.1f} min)", flush=True)
    return summary


def _last_value(command: list[str], flag: str) -> str | None:
    values = [command[i + 1] for i, c in enumerate(command[:-1]) if c == flag]
    return values[-1] if values else None


def table(script: str, split: str, results: dict[str, list[dict]]) -> str:
    """Markdown: one row per estimator, then one per estimator and task type."""
    lines = ["| script | estimator | seeds | start success | after RL | gain +- SE | "
             "grounding start -> end | minutes per run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    per_type = []
    for estimator, runs in results.items():
        starts = [r["evaluations"]["0"] for r in runs]
        ends = [r["evaluations"][max(r["evaluations"], key=int)] for r in runs]

        def cell(key: str) -> tuple[str, str, str]:
            start, _ = mean_and_se([s[key] for s in starts])
            end, _ = mean_and_se([e[key] for e in ends])
            gain, se = mean_and_se([e[key] - s[key] for s, e in zip(starts, ends)])
            return f"{start:.3f}", f"{end:.3f}", f"{gain:+.3f} +- {se:.3f}"

        start, end, gain = cell(f"eval_{split}/success")
        g_start, g_end, _ = cell(f"eval_{split}/grounding")
        minutes, _ = mean_and_se([r["minutes"] for r in runs])
        lines.append(f"| {script} | {estimator} | {len(runs)} | {start} | {end} | {gain} | "
                     f"{g_start} -> {g_end} | {minutes:.1f} |")
        types = sorted(k.rsplit("_", 1)[1] for k in starts[0]
                       if k.startswith(f"eval_{split}/success_"))
        for task_type in types:
            start, end, gain = cell(f"eval_{split}/success_{task_type}")
            per_type.append(f"| {estimator} | {task_type} | {start} | {end} | {gain} |")
    lines += ["", "| estimator | task type | start | after RL | gain +- SE |",
              "| --- | --- | --- | --- | --- |", *per_type]
    return "\n".join(lines)


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Flags after -- go to every run of the script, after "
                                            "the protocol's: " + " ".join(PROTOCOL_FLAGS))
    parser.add_argument("--script", default="proxmo.py", help="method script (default proxmo.py)")
    parser.add_argument("--estimators", nargs="+", default=None,
                        help="values of the script's --advantage (default: the script's method "
                             "and baselines, " + "; ".join(f"{k}: {' '.join(v)}"
                                                           for k, v in ESTIMATORS.items()) + ")")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3],
                        help="training seeds (default 1 2 3)")
    parser.add_argument("--split", default="test", choices=["valid", "test"],
                        help="evaluation split, every task of it (default test; tune on valid)")
    parser.add_argument("--eval-num-tasks", type=int, default=0,
                        help="first tasks of --split to evaluate (default 0 = all: the protocol)")
    parser.add_argument("--out", default=os.path.join("runs", "benchmark-learning"),
                        help="where the runs, their logs and table.md go")
    own, flags = argv, []
    if "--" in argv:
        own, flags = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(own)
    if not os.path.isfile(os.path.join(ROOT, args.script)):
        parser.error(f"--script {args.script}: no such file in {ROOT}")
    if args.estimators is None:
        if args.script not in ESTIMATORS:
            parser.error(f"--script {args.script}: name its --advantage values with --estimators")
        args.estimators = ESTIMATORS[args.script]
    out_dir = os.path.join(args.out, time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for estimator in args.estimators:
        for seed in args.seeds:
            summary = run_one(args.script, estimator, seed, args.split, args.eval_num_tasks,
                              out_dir, PROTOCOL_FLAGS + flags)
            results.setdefault(estimator, []).append(summary)
            markdown = table(args.script, args.split, results)
            with open(os.path.join(out_dir, "table.md"), "w") as f:  # rewritten after each run
                f.write(f"flags: {' '.join(PROTOCOL_FLAGS + flags)}; seeds {args.seeds}; split "
                        f"{args.split}\n\n{markdown}\n")
    print(markdown)
    print(f"(runs, logs and table.md in {out_dir})")
    return markdown


if __name__ == "__main__":
    main(sys.argv[1:])
