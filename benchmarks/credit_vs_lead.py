"""Does credit accuracy predict what a method gains? Each method's same-state AUC at the start on
ALFWorld (benchmarks/credit.py's table) against its paired lead over GRPO at the end of the keyed
ALFWorld protocol (benchmarks/learning.py's records), one point per method that has run, the
oracle marked, the placebo's lead (the previous protocol's records) a dashed line.

A method's lead over GRPO is paired seed by seed: its end success minus GRPO's (the frame's
records in the proxmo.py folder), over the seeds both ran; the runs share their start, so that is
the difference of the gains. Reads the committed results; writes credit-vs-lead.md and .png.

    python benchmarks/credit_vs_lead.py
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from common import write_text  # noqa: E402
from credit import LABELS  # noqa: E402
from learning import (RESULTS, check_record, gain_differences, mean_and_se,  # noqa: E402
                      read_json, refuse, save_png)

SPLIT = "valid_unseen"
# (name, the estimator's row in credit.py's table, the folder of its records in the keyed
# records, the estimator in them); PPO's records are hisr.py's, which spa.py shares; a method
# run at another setting than the protocol's has its folder named by that flag (learning.py);
# GRPO's lead is 0
POINTS = [("oracle", "oracle", "proxmo.py", "oracle"), ("GRPO", "grpo", "proxmo.py", "grpo"),
          ("GiGPO", "gigpo", "proxmo.py", "gigpo"),
          ("ProxMO", "proxmo", "proxmo.py", "proxmo"), ("PPO", "ppo", "hisr.py", "ppo"),
          ("SPA", "spa", "spa.py", "spa"), ("HISR", "hisr", "hisr.py", "hisr"),
          ("RLOO", "rloo", "istar.py", "rloo"), ("iStar", "istar", "istar.py", "istar"),
          ("3SPO, N = 3", "sspo", "sspo.py/tasks-per-iteration-3", "sspo"),
          ("3SPO, N = 8", "sspo", "sspo.py/tasks-per-iteration-8", "sspo")]


def credit_rows(path: str) -> dict[str, tuple[float, float]]:
    """credit.py's table.md -> {row label: (same-state AUC, its SE)}: the first figure column,
    which credit.py writes first."""
    rows = {}
    with open(path) as f:
        for line in f:
            match = re.match(r"^\| (.+?) \| ([0-9.]+|nan) \+- ([0-9.]+|nan) \|", line)
            if match:
                rows[match.group(1)] = (float(match.group(2)), float(match.group(3)))
    return rows


def records(folder: str, estimator: str) -> dict[int, dict]:
    """{seed: record} of one estimator in a learning.py records folder, each checked as
    learning.py checks it."""
    out = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        match = re.fullmatch(rf"{re.escape(estimator)}-seed(\d+)\.json", name)
        if match:
            path = os.path.join(folder, name)
            record = read_json(path, "run benchmarks/learning.py again for it")
            check_record(record, SPLIT, path)
            out[int(match.group(1))] = record
    return out


def points(credit_table: str, learning: str, placebo_folder: str) -> tuple[list[dict], dict]:
    """(one dict per method that has run: name, auc, auc_se, differences (its lead over GRPO per
    seed both ran); the placebo's, from its own folder and that folder's GRPO)."""
    aucs = credit_rows(credit_table)
    grpo = records(os.path.join(learning, "proxmo.py"), "grpo")
    if not grpo:
        refuse(f"no GRPO records in {os.path.join(learning, 'proxmo.py')}: the frame runs first")
    out = []
    for name, row, folder, estimator in POINTS:
        if LABELS[row] not in aucs:
            continue
        runs = records(os.path.join(learning, folder), estimator)
        _, differences = gain_differences(SPLIT, runs, grpo)
        if differences:
            auc, auc_se = aucs[LABELS[row]]
            out.append({"name": name, "auc": auc, "auc_se": auc_se, "differences": differences})
    _, placebo = gain_differences(SPLIT, records(placebo_folder, "placebo"),
                                  records(placebo_folder, "grpo"))
    return out, {"name": "placebo", "differences": placebo}


def table(rows: list[dict], placebo: dict) -> str:
    oracle = next((r for r in rows if r["name"] == "oracle"), None)
    oracle_lead = mean_and_se(oracle["differences"])[0] if oracle else float("nan")

    def share(lead: float) -> str:  # of the oracle's lead, where it has one
        return f"{lead / oracle_lead:.2f}" if oracle_lead > 0 else "-"

    lines = ["| method | same-state AUC at the start | seeds | lead over GRPO +- SE | "
             "share of the oracle's lead |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        mean, se = mean_and_se(row["differences"])
        lines.append(f"| {row['name']} | {row['auc']:.3f} +- {row['auc_se']:.3f} | "
                     f"{len(row['differences'])} | {mean:+.3f} +- {se:.3f} | {share(mean)} |")
    if placebo["differences"]:
        mean, se = mean_and_se(placebo["differences"])
        lines.append(f"| placebo (the previous protocol: not a share of this one) | not "
                     f"measured | {len(placebo['differences'])} | {mean:+.3f} +- {se:.3f} | - |")
    return "\n".join(lines)


def plot(rows: list[dict], placebo: dict, path: str) -> None:
    """x: same-state AUC at the start (+- SE); y: paired lead over GRPO (+- SE), seeds named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    leads = [mean_and_se(row["differences"]) for row in rows]  # (mean, se) a row
    for row, (mean, se) in zip(rows, leads):
        auc_se = 0 if math.isnan(row["auc_se"]) else row["auc_se"]
        oracle = row["name"] == "oracle"
        ax.errorbar([row["auc"]], [mean], xerr=[auc_se], yerr=[0 if math.isnan(se) else se],
                    fmt="*" if oracle else "o", capsize=3, markersize=10 if oracle else 6)
        crowded = any(abs(other["auc"] - row["auc"]) < 0.03 and 0 < other_mean - mean < 0.03
                      for other, (other_mean, _) in zip(rows, leads))  # a label just above
        ax.annotate(f"{row['name']} ({len(row['differences'])})",
                    (row["auc"] + auc_se, mean) if crowded else (row["auc"], mean),
                    textcoords="offset points", xytext=(4, -3) if crowded else (6, 4), fontsize=8)
    ax.axhline(0, color="black", linewidth=0.8, label="GRPO")
    if placebo["differences"]:
        ax.axhline(mean_and_se(placebo["differences"])[0], color="grey", linestyle="--",
                   linewidth=0.8, label="placebo (previous protocol)")
    ax.axvline(0.5, color="grey", linewidth=0.5, linestyle=":")
    ax.set_xlabel("same-state AUC at the start (credit.py, ALFWorld)")
    ax.set_ylabel(f"lead over GRPO at the end, {SPLIT}")
    ax.set_title("does credit accuracy predict the gain? mean +- SE (seeds)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    save_png(fig, path)


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--credit-table", default=os.path.join(
        ROOT, "benchmarks", "results", "credit", "alfworld", "table.md"),
        help="credit.py --env alfworld's table.md (default the committed one)")
    parser.add_argument("--learning", default=os.path.join(RESULTS, "alfworld", "keyed", SPLIT),
                        help="the keyed ALFWorld records, one folder per script (default the "
                             "committed ones)")
    parser.add_argument("--placebo", default=None,
                        help="the placebo's and its GRPO's records (default the previous "
                             "protocol's, benchmarks/results/learning/alfworld/valid_unseen/"
                             "oracle-vs-grpo)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "credit",
                                                      "alfworld"),
                        help="where credit-vs-lead.md and .png go (default benchmarks/results/"
                             "credit/alfworld, beside the credit table)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.credit_table):
        parser.error(f"--credit-table {args.credit_table}: no such file (run benchmarks/credit.py "
                     "--env alfworld)")
    placebo_folder = args.placebo or os.path.join(RESULTS, "alfworld", SPLIT, "oracle-vs-grpo")
    rows, placebo = points(args.credit_table, args.learning, placebo_folder)
    if args.placebo and not placebo["differences"]:
        parser.error(f"--placebo {args.placebo}: no placebo-seed*.json there with a "
                     "grpo-seed*.json of the same seed")
    markdown = table(rows, placebo)
    os.makedirs(args.out, exist_ok=True)
    write_text(os.path.join(args.out, "credit-vs-lead.md"), markdown + "\n")
    plot(rows, placebo, os.path.join(args.out, "credit-vs-lead.png"))
    print(markdown)
    return markdown


if __name__ == "__main__":
    main(sys.argv[1:])
