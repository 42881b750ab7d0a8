"""How fast the real ALFWorld engine plays: seconds to load and to reset a game, milliseconds per
step of one game, and steps per second of a batch stepped in lock-step (common/envbatch.py), in
this process or in worker processes (--workers, the scripts' --env-workers).

    python -m envs.alfworld_games --out /tmp/aw --per-type 10 && export ALFWORLD_DATA=/tmp/aw
    python benchmarks/alfworld_speed.py --games 32 --workers 0 2
    python benchmarks/alfworld_speed.py --games 8 --no-engine-cache    # TextWorld as shipped

Every game replays its stored walkthrough (the expert's commands), so each configuration plays
the same steps; the admissible commands are read after every step, as a rollout does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import envs  # noqa: E402
from common import UsageError  # noqa: E402
from common.envbatch import EnvBatch  # noqa: E402
from envs import alfworld_env  # noqa: E402


def walkthrough(game_file: str) -> list[str]:
    with open(game_file) as f:
        return json.load(f)["walkthrough"]


def one_game(game_file: str) -> dict:
    """Load, reset and step one game in this process: seconds and milliseconds."""
    start = time.perf_counter()
    game = alfworld_env.AlfworldEnv(game_file, max_steps=1000)
    loaded = time.perf_counter()
    game.reset()
    reset = time.perf_counter()
    commands = walkthrough(game_file)
    for command in commands:
        game.step(command)
        game.admissible_actions()
    done = time.perf_counter()
    return {"load_s": loaded - start, "reset_s": reset - loaded,
            "step_ms": 1000 * (done - reset) / len(commands), "steps": len(commands)}


def batch(files: list[str], workers: int) -> dict:
    """All games made, reset and stepped in lock-step through their walkthroughs."""
    start = time.perf_counter()
    games = [envs.make_game("alfworld", f, 1000, workers=workers) for f in files]
    lock_step = EnvBatch(games)
    lock_step.reset()
    ready = time.perf_counter()
    plans = [walkthrough(f) for f in files]
    steps, t = 0, 0
    while True:
        actions = {i: plan[t] for i, plan in enumerate(plans) if t < len(plan)}
        if not actions:
            break
        lock_step.step(actions)
        for i in actions:
            games[i].admissible_actions()
        steps, t = steps + len(actions), t + 1
    done = time.perf_counter()
    return {"games": len(files), "workers": workers, "make_and_reset_s": ready - start,
            "steps": steps, "step_phase_s": done - ready,
            "batch_steps_per_s": steps / (done - ready)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="train", choices=alfworld_env.SPLITS)
    parser.add_argument("--games", type=int, default=32, help="games in the batch (default 32)")
    parser.add_argument("--single", type=int, default=4,
                        help="games timed one by one in this process (default 4)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0],
                        help="worker counts to time the batch with (0: this process)")
    parser.add_argument("--no-engine-cache", action="store_true",
                        help="TextWorld as shipped: no cache of its parses and translations "
                             "(--workers 0)")
    args = parser.parse_args(argv)
    if args.games < 1 or args.single < 0 or min(args.workers) < 0:
        parser.error("--games must be >= 1, --single and --workers >= 0")
    if args.no_engine_cache and max(args.workers) > 0:
        parser.error("--no-engine-cache times this process only: use --workers 0")
    try:
        files = alfworld_env.game_files(args.split)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = (files * (args.games // len(files) + 1))[:args.games]
    if args.no_engine_cache:
        from textworld.envs.pddl import textgen

        if getattr(textgen._parse_and_convert, "memoized", False):
            parser.error("--no-engine-cache: this process already caches the engine's work")
        alfworld_env.memoize_engine = lambda: None
    rows = [one_game(f) for f in files[:args.single]]
    if rows:
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        cache = "off" if args.no_engine_cache else "on"
        print(f"one game ({len(rows)} games, engine cache {cache}): load {mean['load_s']:.2f} s, "
              f"reset {mean['reset_s']:.2f} s, step {mean['step_ms']:.1f} ms "
              f"({1000 / mean['step_ms']:.0f} steps/s)")
    for workers in args.workers:
        r = batch(files, workers)
        print(f"batch of {r['games']} games, workers {workers}: made and reset in "
              f"{r['make_and_reset_s']:.1f} s, {r['steps']} steps in {r['step_phase_s']:.1f} s "
              f"({r['batch_steps_per_s']:.0f} steps/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
