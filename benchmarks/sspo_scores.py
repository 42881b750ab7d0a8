"""3SPO's score statistics of finished sspo.py runs: how graded the scores are and whether Eq. 2's
score difference ranks the trained groups (the valid-split choice of lambda in docs/sspo.md).

For each run directory (as given to --run-dir), the means over iterations --first to --last of
the logged sspo/* figures, and from its final state table the states on 8-12 finished paths with
at least one win: their mean score and actions (the paper's case study: S about 0.3, n = 3 at
the 10th visit). The run's own configuration (config.json) scores the table.

    python sspo.py --iterations 8 --tasks-per-iteration 8 --eval-splits valid \\
        --eval-num-tasks 4 --score-alpha 0.25 --run-dir runs/scores/alpha0.25
    python benchmarks/sspo_scores.py runs/scores/*
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sspo  # noqa: E402

TAGS = {"sspo/score_difference_varies": "trained groups whose score difference varies",
        "sspo/trained_w": "their mean w", "sspo/expanded_score": "mean S of the states searched",
        "sspo/rollouts_per_step": "actions per state",
        "sspo/untrained_share": "states stepped without an update",
        "sspo/score_difference_share": "its share of the rewards' spread",
        "rollout/episode_length": "length of the paths the game ended"}


def run_row(run_dir: str, first: int, last: int) -> list[str]:
    """The table's cells of one run directory (its newest run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_path = sorted(glob.glob(os.path.join(run_dir, "*", "config.json")))[-1]
    run_path = os.path.dirname(run_path)
    with open(os.path.join(run_path, "config.json")) as f:
        args = sspo.Args(**{**json.load(f)["args"], "eval_splits": ()})
    events = EventAccumulator(run_path, size_guidance={"scalars": 0}).Reload()
    cells = []
    logged = events.Tags()["scalars"]
    for tag in TAGS:
        steps = events.Scalars(tag) if tag in logged else []
        values = [e.value for e in steps if first <= e.step <= last]
        cells.append(f"{np.mean(values):.3f}" if values else "-")
    state = torch.load(os.path.join(run_path, "checkpoint", "trainer_state.pt"),
                       weights_only=False)["table"]
    table = sspo.StateTable({k: sspo.Counts(*c) for k, c in state["counts"].items()}, state["t"])
    scores = [sspo.score_of(args, table, key) for key, c in table.counts.items()
              if 8 <= c.n_total <= 12 and c.n_success > 0]
    if scores:
        actions = np.mean([sspo.rollout_count(s, args.max_rollouts) for s in scores])
        cells.append(f"{np.mean(scores):.3f} (n {actions:.2f}, {len(scores)} states)")
    else:
        cells.append("-")
    return cells


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories of sspo.py (its --run-dir)")
    parser.add_argument("--first", type=int, default=5, help="first iteration averaged (5)")
    parser.add_argument("--last", type=int, default=8, help="last iteration averaged (8)")
    args = parser.parse_args(argv)
    if not 1 <= args.first <= args.last:
        parser.error("--first and --last must satisfy 1 <= first <= last")
    for run_dir in args.runs:
        if not glob.glob(os.path.join(run_dir, "*", "checkpoint", "trainer_state.pt")):
            parser.error(f"{run_dir}: no run with a checkpoint in it (an --run-dir of sspo.py?)")
    header = ["run", *TAGS.values(), "S of states on 8-12 paths with a win"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for run_dir in args.runs:
        lines.append(f"| {os.path.basename(run_dir.rstrip('/'))} | "
                     + " | ".join(run_row(run_dir, args.first, args.last)) + " |")
    print("\n".join(lines))
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
