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
import glob
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from common import write_text  # noqa: E402
from learning import RESULTS, gain, mean_and_se, read_json, refuse, save_png  # noqa: E402

SPLIT = "valid_unseen"
# (name, its row in credit.py's table, the script whose records folder holds it, the estimator)
POINTS = [
    ("oracle", "oracle: GRPO + progress (reference, proxmo.py)", "proxmo.py", "oracle"),
    ("GiGPO", "GiGPO (proxmo.py)", "proxmo.py", "gigpo"),
    ("ProxMO", "ProxMO (proxmo.py)", "proxmo.py", "proxmo"),
    ("PPO", "PPO (spa.py)", "hisr.py", "ppo"),
    ("SPA", "SPA, grounding as a cost (spa.py)", "spa.py", "spa"),
    ("HISR", "HISR, as revised (hisr.py)", "hisr.py", "hisr"),
    ("RLOO", "RLOO (istar.py)", "istar.py", "rloo"),
    ("iStar", "iStar (istar.py)", "istar.py", "istar"),
    ("3SPO", "3SPO, as revised, searched counts (sspo.py)", "sspo.py", "sspo"),
]


def credit_rows(path: str) -> dict[str, tuple[float, float]]:
    """credit.py's table.md -> {row label: (same-state AUC, its SE)}."""
    rows = {}
    with open(path) as f:
        for line in f:
            match = re.match(r"^\| (.+?) \| ([0-9.]+|nan) \+- ([0-9.]+|nan) \|", line)
            if match:
                rows[match.group(1)] = (float(match.group(2)), float(match.group(3)))
    return rows


def records(folder: str, estimator: str) -> dict[int, dict]:
    """{seed: record} of one estimator in a learning.py records folder."""
    out = {}
    for path in glob.glob(os.path.join(folder, f"{estimator}-seed*.json")):
        seed = int(re.search(r"-seed(\d+)\.json$", path).group(1))
        out[seed] = read_json(path, "run benchmarks/learning.py again for it",
                              needs=("evaluations",))
    return out


def records_folder(learning: str, script: str, estimator: str) -> str | None:
    """The folder of `script`'s records that holds `estimator`'s: the script's own, or one with
    extra flags in its name (sspo.py-...); more than one is refused."""
    found = [f for f in sorted(glob.glob(os.path.join(learning, script + "*")))
             if glob.glob(os.path.join(f, f"{estimator}-seed*.json"))]
    if len(found) > 1:
        refuse(f"{estimator}: records in {len(found)} folders ({', '.join(found)}); keep one")
    return found[0] if found else None


def leads(method: dict[int, dict], grpo: dict[int, dict]) -> list[float]:
    """Per seed both ran, in seed order: the method's gain minus GRPO's."""
    key = f"eval_{SPLIT}/success"
    out = []
    for seed in sorted(set(method) & set(grpo)):
        m_start, m_end = gain(method[seed], key)
        g_start, g_end = gain(grpo[seed], key)
        out.append((m_end - m_start) - (g_end - g_start))
    return out


def points(credit_table: str, learning: str, placebo_folder: str) -> tuple[list[dict], dict]:
    """(one dict per method that has run: name, auc, auc_se, differences; the placebo's)."""
    aucs = credit_rows(credit_table)
    grpo_folder = os.path.join(learning, "proxmo.py")
    grpo = records(grpo_folder, "grpo")
    if not grpo:
        refuse(f"no GRPO records in {grpo_folder}: the frame runs first")
    out = []
    for name, label, script, estimator in POINTS:
        folder = records_folder(learning, script, estimator)
        if folder is None or label not in aucs:
            continue
        differences = leads(records(folder, estimator), grpo)
        if differences:
            out.append({"name": name, "auc": aucs[label][0], "auc_se": aucs[label][1],
                        "differences": differences})
    placebo = leads(records(placebo_folder, "placebo"), records(placebo_folder, "grpo"))
    return out, {"name": "placebo", "differences": placebo}


def table(rows: list[dict], placebo: dict) -> str:
    oracle = next((r for r in rows if r["name"] == "oracle"), None)
    oracle_lead = mean_and_se(oracle["differences"])[0] if oracle else float("nan")
    lines = ["| method | same-state AUC at the start | seeds | lead over GRPO +- SE | "
             "share of the oracle's lead |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        mean, se = mean_and_se(row["differences"])
        lines.append(f"| {row['name']} | {row['auc']:.3f} +- {row['auc_se']:.3f} | "
                     f"{len(row['differences'])} | {mean:+.3f} +- {se:.3f} | "
                     f"{mean / oracle_lead:.2f} |")
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
    for row in rows:
        mean, se = mean_and_se(row["differences"])
        ax.errorbar([row["auc"]], [mean], xerr=[row["auc_se"]],
                    yerr=[0 if math.isnan(se) else se], fmt="*" if row["name"] == "oracle"
                    else "o", capsize=3, markersize=10 if row["name"] == "oracle" else 6)
        ax.annotate(f"{row['name']} ({len(row['differences'])})", (row["auc"], mean),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
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
    parser.add_argument("--placebo", default=os.path.join(RESULTS, "alfworld", SPLIT,
                                                          "oracle-vs-grpo"),
                        help="the placebo's and its GRPO's records (default the previous "
                             "protocol's)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "credit",
                                                      "alfworld"),
                        help="where credit-vs-lead.md and .png go")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.credit_table):
        parser.error(f"--credit-table {args.credit_table}: no such file (run benchmarks/credit.py "
                     "--env alfworld)")
    rows, placebo = points(args.credit_table, args.learning, args.placebo)
    markdown = table(rows, placebo)
    os.makedirs(args.out, exist_ok=True)
    write_text(os.path.join(args.out, "credit-vs-lead.md"), markdown + "\n")
    plot(rows, placebo, os.path.join(args.out, "credit-vs-lead.png"))
    print(markdown)
    return markdown


if __name__ == "__main__":
    main(sys.argv[1:])
