"""How noisy is a paired end evaluation? Two fixed policies (the start, or a run's checkpoint)
each play every game of a split under several evaluation seeds, once with the draws of every run
before keyed sampling (--sampler global: torch's stream, the same seed for both, as the protocol
paired its arms) and once with keyed draws (--sampler keyed: both policies on the same keys).
The SD over seeds of the difference B - A is the evaluation's share of a seed's paired SD; each
evaluation is kept (one JSON file), so a cut sitting goes on where it stopped.

    export ALFWORLD_DATA=...   # the game set the runs were trained on
    python benchmarks/eval_sizing.py --a start --b RUN_DIR --seeds 1 2 3 4 5 \\
        --out benchmarks/results/eval-sizing
    python benchmarks/eval_sizing.py ... --shard 0/2 &    # two processes share the evaluations
    python benchmarks/eval_sizing.py ... --shard 1/2

Draws per game beyond one (--draws) are keyed draws 1, 2, ... of the same games.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the scripts
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from common import UsageError, write_json  # noqa: E402

SAMPLERS = ("global", "keyed")


def evaluation(policy_path: str, sampler: str, seed: int, draws: int, split: str) -> dict:
    """One evaluation of a policy ("start", or a run directory: its checkpoint on its start) as
    proxmo.py's evaluate plays it with the ALFWorld preset: per game and draw, won and steps."""
    import torch

    import proxmo
    from common.generation import Policy
    from common.model import load_lora, load_model_and_tokenizer
    from common.run import quiet_libraries, seed_everything

    quiet_libraries()
    args = proxmo.preset_args("tiny-alfworld", "alfworld")
    args.seed, args.sampler, args.eval_draws = seed, sampler, draws
    seed_everything(seed, args.deterministic)
    model, tokenizer = load_model_and_tokenizer(args.model)
    if policy_path != "start":
        model = load_lora(model, os.path.join(policy_path, "checkpoint"))
    model.requires_grad_(False)
    tasks = proxmo.envs.list_tasks("alfworld", split)
    began = time.time()
    with torch.no_grad():
        stats = proxmo.evaluate(args, Policy(args, model, tokenizer), split, tasks)
    return {"policy": policy_path, "sampler": sampler, "seed": seed, "draws": draws,
            "split": split, "success": stats[f"eval_{split}/success"],
            "outcomes": stats[f"eval_{split}/outcomes"], "seconds": time.time() - began}


def job_file(out: str, name: str, sampler: str, seed: int, draws: int) -> str:
    return os.path.join(out, f"{name}-{sampler}-seed{seed}-draws{draws}.json")


def sd(values: list[float]) -> float:
    if len(values) < 2:
        return float("nan")
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def pooled_sd(a: list[dict], b: list[dict]) -> float:
    """The SD of one evaluation's B - A, from each game's variance over the seeds: with G games,
    sqrt(mean over games of Var_seeds(b_g - a_g) / G) (d draws per game divide it by sqrt(d)).
    a, b: the two policies' evaluations, one per seed, each with outcomes [game, won, steps]."""
    def won(evaluation: dict) -> np.ndarray:
        return np.array([w for _, w, _ in sorted(evaluation["outcomes"])], dtype=float)

    differences = np.stack([won(y) - won(x) for x, y in zip(a, b)])  # (seeds, games)
    return math.sqrt(differences.var(axis=0, ddof=1).mean() / differences.shape[1])


def table(out: str, seeds: list[int], draws: int) -> str:
    """The paired differences B - A by sampler and seed, their mean and SD over seeds, the SD
    pooled over games (pooled_sd, a steadier estimate of the same) and at 2 and 3 draws a game."""
    rows = ["| sampler | B - A per seed | mean | SD over seeds | SD pooled over games "
            "(2, 3 draws) | minutes per evaluation |", "| --- | --- | --- | --- | --- | --- |"]
    for sampler in SAMPLERS:
        found = {}
        for name in ("a", "b"):
            for seed in seeds:
                path = job_file(out, name, sampler, seed, draws)
                if os.path.isfile(path):
                    with open(path) as f:
                        found[name, seed] = json.load(f)
        both = [s for s in seeds if ("a", s) in found and ("b", s) in found]
        if not both:
            continue
        diffs = [found["b", s]["success"] - found["a", s]["success"] for s in both]
        minutes = np.mean([r["seconds"] / 60 for r in found.values()])
        # One draw a game only: several draws' outcomes are sorted, which draw was which lost.
        pooled = (pooled_sd([found["a", s] for s in both], [found["b", s] for s in both])
                  if len(both) > 1 and draws == 1 else float("nan"))
        rows.append(f"| {sampler} | {', '.join(f'{d:+.3f}' for d in diffs)} | "
                    f"{np.mean(diffs):+.4f} | {sd(diffs):.4f} | {pooled:.4f} ("
                    f"{pooled / math.sqrt(2):.4f}, {pooled / math.sqrt(3):.4f}) | {minutes:.1f} |")
    return "\n".join(rows)


def main(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="start", help="policy A: start, or a run directory")
    parser.add_argument("--b", required=True, help="policy B: start, or a run directory")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5],
                        help="evaluation seeds (default 1-5)")
    parser.add_argument("--draws", type=int, default=1, help="episodes per game (default 1)")
    parser.add_argument("--split", default="valid_unseen", help="ALFWorld split (valid_unseen)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "eval-sizing"),
                        help="one JSON per evaluation, and table.md")
    parser.add_argument("--shard", default="0/1",
                        help="i/n: this process plays every n-th evaluation from the i-th")
    args = parser.parse_args(argv)
    for name in ("a", "b"):
        path = getattr(args, name)
        if path != "start" and not os.path.isdir(os.path.join(path, "checkpoint")):
            parser.error(f"--{name} {path}: not 'start' nor a run directory with a checkpoint")
    try:
        index, count = (int(x) for x in args.shard.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        parser.error(f"--shard {args.shard}: i/n with 0 <= i < n")
    if args.draws < 1:
        parser.error("--draws must be >= 1")
    os.makedirs(args.out, exist_ok=True)
    jobs = [(sampler, seed, name) for seed in args.seeds for sampler in SAMPLERS
            for name in ("a", "b")]
    for sampler, seed, name in jobs[index::count]:
        path = job_file(args.out, name, sampler, seed, args.draws)
        if os.path.isfile(path):
            continue
        try:
            result = evaluation(getattr(args, name), sampler, seed, args.draws, args.split)
        except UsageError as e:
            parser.error(str(e))
        write_json(path, {**result, "which": name})
        print(f"{name} {sampler} seed {seed}: success {result['success']:.3f} "
              f"({result['seconds'] / 60:.1f} min)", flush=True)
    markdown = table(args.out, args.seeds, args.draws)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(f"A: {args.a}\nB: {args.b}\nsplit {args.split}, draws {args.draws}\n\n"
                f"{markdown}\n")
    print(markdown)
    return markdown


if __name__ == "__main__":
    main(sys.argv[1:])
