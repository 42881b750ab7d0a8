"""Real ALFWorld games with no download, made from the files the alfworld wheel ships.

    python -m envs.alfworld_games --out ~/alfworld_data --per-type 20 --seed 1 [--demonstrations]
    export ALFWORLD_DATA=~/alfworld_data     # then: python proxmo.py --env alfworld ...

The alfworld package ships everything a game is made of except where the objects lie: the PDDL
domain (alfworld/data/alfred.pddl), the text grammar (alfred.twl2), the goals and their sentences
(alfworld/gen/goal_library.py), the affordance tables (alfworld/gen/constants.py) and ALFRED's 120
scene layouts (alfworld/gen/layouts/FloorPlan*: which object kinds a scene has, and each
receptacle with the point the agent stands at to reach it). This module samples the missing part,
object placements, and writes each game as alfworld's `alfworld-download` data holds it:

    json_2.1.1/<split>/<task_type>-<Object>-<Mrecep>-<Recep>-<scene>/trial_T<seed>_<n>/
        traj_data.json      task_type and pddl_params (what alfworld's expert reads)
        initial_state.pddl  the PDDL problem: objects, facts, goal
        game.tw-pddl        domain, grammar (with the goal sentence), problem, solvable and the
                            walkthrough

Only games that alfworld's hand-coded expert wins (driven by envs/alfworld_env.py, with its
pick-two fix) are kept; the expert's commands are the walkthrough. With --demonstrations the
noisy expert (mistakes, as behavior cloning plays) also plays every train game once, and its game
is kept beside it as demonstration.json, which behavior cloning plays back without the engine.

These are real ALFWorld games on the real engine (TextWorld's PDDL environment, ALFWorld's
domain, grammar and expert) in ALFRED's rooms, but NOT the benchmark's games: ALFRED placed its
objects with the THOR simulator, here they are sampled. Scores on them are not comparable with
published ALFWorld numbers; for those, fetch the real games with `alfworld-download`.

Splits by scene, as ALFRED splits them: train and valid_seen from ALFRED's training FloorPlans
(valid_seen with other placements, drawn from its own random stream), valid_unseen from the six
test FloorPlans of each room type (1-6, 201-206, 301-306, 401-406) that training never sees.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import sys
import time

from common import write_json
from common.progress import Progress
from envs.alfworld_env import PARTIAL, SPLITS, TASK_TYPES

# ALFRED's constraints on goals (its generate_trajectories.py): the object needs the affordance,
# and the target is not the appliance that changes it; pick-two avoids tiny holders.
PICKUP_AFFORDANCE = {"pick_clean_then_place_in_recep": "Cleanable",
                     "pick_heat_then_place_in_recep": "Heatable",
                     "pick_cool_then_place_in_recep": "Coolable"}
APPLIANCE = {"pick_clean_then_place_in_recep": "SinkBasin",
             "pick_heat_then_place_in_recep": "Microwave",
             "pick_cool_then_place_in_recep": "Fridge"}
INVALID_TARGETS = {**{t: {a} for t, a in APPLIANCE.items()},
                   "pick_two_obj_and_place": {"CoffeeMachine", "ToiletPaperHanger",
                                              "HandTowelHolder"}}
LAMP = "DeskLamp"  # the light of look_at_obj_in_light; it stands on one of these
LAMP_STANDS = ("Desk", "SideTable", "Dresser")
MAX_INSTANCES = 3  # copies of one object kind in a scene (ALFRED's MAX_NUM_OF_OBJ_INSTANCES)
MAX_EXPERT_STEPS = 50  # a game is kept when the expert wins it within this many steps


def wheel_paths() -> dict:
    """Where the alfworld wheel keeps the domain, the grammar and the scene layouts."""
    import alfworld

    root = os.path.dirname(alfworld.__file__)
    return {"domain": os.path.join(root, "data", "alfred.pddl"),
            "grammar": os.path.join(root, "data", "alfred.twl2"),
            "layouts": os.path.join(root, "gen", "layouts")}


def mangle(name: str) -> str:
    """An ALFRED id as a PDDL name, the way alfworld writes it (Demangler reverses it)."""
    for old, new in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"),
                     (",", "_comma_")):
        name = name.replace(old, new)
    return name


def receptacle_kind(receptacle_id: str) -> str:
    """"Cabinet|+00.68|+00.50|-02.20" -> Cabinet; "Sink|-01.90|+00.97|-01.50|SinkBasin" ->
    SinkBasin (ALFRED names a basin after its sink and ends its id with the basin's kind)."""
    parts = receptacle_id.split("|")
    return parts[-1] if parts[-1].isalpha() else parts[0]


def scene_numbers(split: str) -> list[int]:
    """ALFRED's FloorPlans of a split: its test scenes are this generator's unseen ones."""
    from alfworld.gen import constants

    if split == "valid_unseen":
        return sorted(constants.TEST_SCENE_NUMBERS)
    return sorted(constants.TRAIN_SCENE_NUMBERS)


def room_type(scene: int) -> str:
    from alfworld.gen import constants

    return next(room for room, numbers in constants.SCENE_TYPE.items() if scene in numbers)


def load_scene(scene: int, layouts: str) -> dict:
    """A FloorPlan's object kinds and receptacles ({id: (x, z, rotation, horizon)})."""
    stem = os.path.join(layouts, f"FloorPlan{scene}")
    with open(stem + "-objects.json") as f:
        kinds = json.load(f)
    with open(stem + "-openable.json") as f:
        receptacles = json.load(f)
    return {"scene": scene, "kinds": sorted(set(kinds)), "receptacles": receptacles}


def location(point) -> str:
    """An interaction point (metres, degrees) as ALFRED's grid location
    loc|x|z|rotation|horizon (quarter metres, quarter turns)."""
    x, z, rotation, horizon = point
    return "loc|%d|%d|%d|%d" % (round(x / 0.25), round(z / 0.25), round(rotation / 90), horizon)


def placeable_kinds(scene: dict) -> list[str]:
    """Object kinds of the scene that ALFRED puts in receptacles (so the agent can pick them)."""
    from alfworld.gen import constants

    held = set().union(*constants.VAL_RECEPTACLE_OBJECTS.values())
    return [k for k in scene["kinds"] if k in held and k in constants.OBJECTS]


def hosts(scene: dict, kind: str) -> list[str]:
    """Receptacle ids of the scene that may hold an object of `kind` (VAL_RECEPTACLE_OBJECTS)."""
    from alfworld.gen import constants

    return sorted(r for r in scene["receptacles"]
                  if kind in constants.VAL_RECEPTACLE_OBJECTS.get(receptacle_kind(r), ()))


def sample_goal(task_type: str, scene: dict, rng: random.Random) -> dict | None:
    """pddl_params of a plausible goal in `scene`, or None when the scene has none of this type."""
    from alfworld.gen import constants

    kinds = placeable_kinds(scene)
    recep_kinds = {receptacle_kind(r) for r in scene["receptacles"]}
    if task_type in APPLIANCE and APPLIANCE[task_type] not in recep_kinds:
        return None
    if task_type in PICKUP_AFFORDANCE:
        affordance = PICKUP_AFFORDANCE[task_type]
        kinds = [k for k in kinds if k in constants.VAL_ACTION_OBJECTS[affordance]]
    if task_type == "look_at_obj_in_light":
        if LAMP not in scene["kinds"] or not recep_kinds & set(LAMP_STANDS):
            return None
        kinds = [k for k in kinds if k not in constants.MOVABLE_RECEPTACLES_SET]
        if not kinds:
            return None
        return {"object_target": rng.choice(kinds), "parent_target": "", "toggle_target": LAMP,
                "mrecep_target": "", "object_sliced": False}
    pairs = [(k, r) for k in kinds for r in sorted(recep_kinds)
             if k in constants.VAL_RECEPTACLE_OBJECTS.get(r, ())
             and r not in INVALID_TARGETS.get(task_type, ())
             # the object must have somewhere else to start from
             and any(receptacle_kind(h) != r for h in hosts(scene, k))]
    if not pairs:
        return None
    obj, recep = rng.choice(pairs)
    return {"object_target": obj, "parent_target": recep, "toggle_target": "",
            "mrecep_target": "", "object_sliced": False}


def object_id(kind: str, receptacle_id: str, taken: set, rng: random.Random) -> str:
    """A fresh ALFRED-style id near its receptacle: Kind|x|y|z in metres."""
    x, y, z = (float(v) for v in receptacle_id.split("|")[1:4])
    while True:
        xyz = [v + rng.uniform(-0.3, 0.3) for v in (x, y, z)]
        oid = kind + "|" + "|".join(f"{v:+06.2f}" for v in xyz)
        if oid not in taken:
            taken.add(oid)
            return oid


def place_objects(scene: dict, params: dict, task_type: str,
                  rng: random.Random) -> list[tuple[str, str, str]]:
    """(object id, kind, receptacle id) of every object. The target starts outside every
    receptacle of the goal's kind, so the goal does not hold at the start."""
    target, goal_recep = params["object_target"], params["parent_target"]
    placed, taken = [], set()
    for kind in placeable_kinds(scene):
        places = hosts(scene, kind)
        if kind == target:
            places = [r for r in places if receptacle_kind(r) != goal_recep]
            count = rng.randint(2 if task_type == "pick_two_obj_and_place" else 1, MAX_INSTANCES)
        else:
            count = rng.randint(1, 2)
        for _ in range(count if places else 0):
            receptacle = rng.choice(places)
            placed.append((object_id(kind, receptacle, taken, rng), kind, receptacle))
    if params["toggle_target"]:
        stands = sorted(r for r in scene["receptacles"] if receptacle_kind(r) in LAMP_STANDS)
        stand = rng.choice(stands)
        placed.append((object_id(LAMP, stand, taken, rng), LAMP, stand))
    return placed


def start_location(scene: dict, layouts: str, rng: random.Random) -> str:
    """A reachable floor point where no receptacle is (the agent starts "in the middle of a
    room"), from the scene's layout grid."""
    import numpy as np

    points = np.load(os.path.join(layouts, f"FloorPlan{scene['scene']}-layout.npy"))
    used = {location(p) for p in scene["receptacles"].values()}
    while True:
        x, z = points[rng.randrange(len(points))]
        loc = location((float(x), float(z), rng.choice((0, 90, 180, 270)), 30))
        if loc not in used:
            return loc


def problem_pddl(scene: dict, placed: list, params: dict, task_type: str, start: str,
                 name: str) -> str:
    """The PDDL problem in the layout of alfworld's initial_state.pddl files. Every type name
    the domain mentions (SinkBasinType, KnifeType, ...) is declared: Fast Downward needs it."""
    from alfworld.gen import constants
    from alfworld.gen import goal_library

    static = sorted(set(constants.RECEPTACLES) - constants.MOVABLE_RECEPTACLES_SET)
    otypes = sorted(constants.OBJECTS_SET - set(static))
    receptacles = sorted(scene["receptacles"])
    recep_loc = {r: location(p) for r, p in scene["receptacles"].items()}
    locations = sorted(set(recep_loc.values()) | {start})
    declared = (["agent1 - agent"] + [f"{o}Type - otype" for o in otypes]
                + [f"{r}Type - rtype" for r in static]
                + [f"{oid} - object" for oid, _, _ in placed]
                + [f"{r} - receptacle" for r in receptacles]
                + [f"{loc} - location" for loc in locations])
    facts = [f"(atLocation agent1 {start})"]
    for r in receptacles:
        kind = receptacle_kind(r)
        facts += [f"(receptacleType {r} {kind}Type)", f"(receptacleAtLocation {r} {recep_loc[r]})"]
        if kind in constants.OPENABLE_CLASS_SET:
            facts.append(f"(openable {r})")
    for oid, kind, r in placed:
        facts += [f"(objectType {oid} {kind}Type)", f"(objectAtLocation {oid} {recep_loc[r]})",
                  f"(inReceptacle {oid} {r})"]
        if kind == LAMP:
            facts.append(f"(toggleable {oid})")
            continue
        facts.append(f"(pickupable {oid})")
        for affordance, predicate in (("Cleanable", "cleanable"), ("Heatable", "heatable"),
                                      ("Coolable", "coolable"), ("Sliceable", "sliceable")):
            if kind in constants.VAL_ACTION_OBJECTS[affordance]:
                facts.append(f"({predicate} {oid})")
        if kind in constants.MOVABLE_RECEPTACLES_SET:
            facts.append(f"(isReceptacleObject {oid})")
    for rtype in static:
        for otype in sorted(constants.VAL_RECEPTACLE_OBJECTS.get(rtype, ())):
            if otype in otypes:
                facts.append(f"(canContain {rtype}Type {otype}Type)")
    goal = goal_library.gdict[task_type]["pddl"].format(
        obj=params["object_target"], recep=params["parent_target"],
        toggle=params["toggle_target"], mrecep=params["mrecep_target"]).replace("#", "-")
    # goal_library's goal closes the (define ...) as well.
    text = (f"(define (problem {name})\n    (:domain alfred)\n    (:objects\n        "
            + "\n        ".join(declared) + "\n    )\n    (:init\n        "
            + "\n        ".join(facts) + "\n    )\n" + goal.strip() + "\n")
    # Ids carry ALFRED's characters; the " - " of declarations and goal variables stay.
    return re.sub(r"[A-Za-z]+\|[^\s()]+", lambda m: mangle(m[0]), text)


def goal_sentence(task_type: str, params: dict, rng: random.Random) -> str:
    """One of goal_library's two templated sentences (alfworld's templated goals)."""
    from alfworld.gen import goal_library

    template = rng.choice(goal_library.gdict[task_type]["templates"])
    return template.format(obj=params["object_target"].lower(),
                           recep=params["parent_target"].lower(),
                           toggle=params["toggle_target"].lower(),
                           mrecep=params["mrecep_target"].lower())


def play_expert(game_file: str, seed: int, noise: float = 0.0,
                max_steps: int = MAX_EXPERT_STEPS) -> dict:
    """The hand-coded expert's game with envs.noisy_expert's mistakes (as behavior cloning
    plays it): {"noise", "max_steps", "observation" (after reset), "task_description", "won",
    "steps": [{"admissible", "label", "command", "observation", "valid", "won", "done"}]}.
    `seed` seeds the expert's rare random choices, and the mistakes' own stream. It ends when
    the game does, or before the step whose label is None (the expert gave up)."""
    import envs
    from envs.alfworld_env import AlfworldEnv

    game = AlfworldEnv(game_file, max_steps=max_steps, expert=True, seed=seed)
    rng = random.Random(f"{seed}/{noise}")
    observation = game.reset()
    played = {"noise": noise, "max_steps": max_steps, "observation": observation,
              "task_description": game.task_description, "won": game.won, "steps": []}
    history, done = [], game.won  # a goal true at the start: nothing to play
    while not done:
        admissible = game.admissible_actions()
        label, command = envs.noisy_expert(game, history, noise, rng)
        if label is None:
            break
        next_observation, _, done, info = game.step(command)
        played["steps"].append({"admissible": admissible, "label": label, "command": command,
                                "observation": next_observation, "valid": info["valid"],
                                "won": info["won"], "done": done})
        history.append((observation, command))
        observation, played["won"] = next_observation, info["won"]
    return played


def expert_walkthrough(game_file: str, seed: int) -> list[str] | None:
    """The hand-coded expert's commands when it wins the game within MAX_EXPERT_STEPS, else
    None. `seed` seeds the expert's rare random choices."""
    played = play_expert(game_file, seed)
    if not played["won"] or not played["steps"]:
        return None
    return [step["command"] for step in played["steps"]]


def make_game(out: str, split: str, task_type: str, index: int, seed: int,
              paths: dict) -> str | None:
    """Sample, write and solve one game; its game file, or None when the draw gave no game the
    expert wins (the written files are then removed). Deterministic in (seed, split, type,
    index)."""
    from alfworld.gen import constants

    rng = random.Random(f"{seed}/{split}/{task_type}/{index}")
    scenes = [s for s in scene_numbers(split)
              if room_type(s) in constants.GOALS_VALID[task_type]]
    rng.shuffle(scenes)
    for scene_number in scenes:  # the first scene of the shuffled order that has such a goal
        scene = load_scene(scene_number, paths["layouts"])
        params = sample_goal(task_type, scene, rng)
        if params is not None:
            break
    else:
        return None
    placed = place_objects(scene, params, task_type, rng)
    start = start_location(scene, paths["layouts"], rng)
    trial = f"trial_T{seed}_{index:05d}"
    folder = "-".join([task_type, params["object_target"], params["mrecep_target"] or "None",
                       params["parent_target"] or params["toggle_target"], str(scene_number)])
    final = os.path.join(out, "json_2.1.1", split, folder, trial)
    # Written under another name and renamed once the expert has won it: a game folder is whole,
    # and a kill leaves only a .partial folder, which the next run removes (clear_partial).
    root = final + PARTIAL
    shutil.rmtree(root, ignore_errors=True)
    problem = problem_pddl(scene, placed, params, task_type, start, f"plan_{trial}")
    with open(paths["grammar"]) as f:
        grammar = f.read().replace("UNKNOWN GOAL", goal_sentence(task_type, params, rng))
    with open(paths["domain"]) as f:
        domain = f.read()
    # The expert is stochastic (it breaks ties at random): it wins a kept game with this seed,
    # and most games with any other (measured: docs/environments.md, "ALFWorld without the
    # download").
    expert_seed = rng.randrange(2**32)
    traj = {"task_id": trial, "task_type": task_type, "pddl_params": params,
            "scene": {"floor_plan": f"FloorPlan{scene_number}", "scene_num": scene_number,
                      "random_seed": seed},
            "expert_seed": expert_seed,
            "generator": "envs/alfworld_games.py: sampled placements, not ALFRED's"}
    os.makedirs(root, exist_ok=True)
    game_file = os.path.join(root, "game.tw-pddl")
    _write_json(os.path.join(root, "traj_data.json"), traj)
    with open(os.path.join(root, "initial_state.pddl"), "w") as f:
        f.write(problem)
    game = {"pddl_domain": domain, "grammar": grammar, "pddl_problem": problem,
            "solvable": None, "walkthrough": None}
    _write_json(game_file, game)
    walkthrough = None
    try:
        walkthrough = expert_walkthrough(game_file, expert_seed)
    finally:  # a lost game, or an interrupted run, leaves no half-written game behind
        if walkthrough is None:
            shutil.rmtree(root)
            if not os.listdir(os.path.dirname(root)):
                os.rmdir(os.path.dirname(root))
    if walkthrough is None:
        return None
    _write_json(game_file, {**game, "solvable": True, "walkthrough": walkthrough})
    os.replace(root, final)
    return os.path.join(final, "game.tw-pddl")


def clear_partial(out: str, seed: int, split: str, task_type: str) -> list[int]:
    """Removes what an interrupted run left of a cell (its .partial folders, and a game folder of
    an older version that never got its walkthrough) and returns the indices of its whole games,
    sorted: a run goes on from the draw after the last."""
    cell = os.path.join(out, "json_2.1.1", split, f"{task_type}-*")
    for folder in glob.glob(os.path.join(cell, f"trial_T{seed}_*{PARTIAL}")):
        shutil.rmtree(folder)
    indices = []
    for folder in glob.glob(os.path.join(cell, f"trial_T{seed}_*")):
        game_file = os.path.join(folder, "game.tw-pddl")
        try:
            with open(game_file) as f:
                whole = json.load(f).get("walkthrough") is not None
        except (OSError, ValueError):
            whole = False
        if not whole:
            shutil.rmtree(folder)
            continue
        indices.append(int(folder.rsplit("_", 1)[1]))
    for parent in glob.glob(cell):  # a task folder emptied above
        if not os.listdir(parent):
            os.rmdir(parent)
    return sorted(indices)


def record_demonstrations(game_files: list[str], noise: float, max_steps: int,
                          workers: int) -> None:
    """Play the noisy expert once on every game without a recording of this noise and at least
    this step limit (play_expert, seeded by the game's expert_seed: the same game, noise and
    limit write the same file) and keep it beside the game (alfworld_env.DEMONSTRATION), for
    behavior cloning to play back (alfworld_env.RecordedGame). On `workers` processes."""
    from envs.alfworld_env import demonstration_file, load_demonstration

    recorded = [load_demonstration(f, max_steps) for f in game_files]
    todo = [f for f, r in zip(game_files, recorded) if r is None or r["noise"] != noise]
    replaced = sum(os.path.exists(demonstration_file(f)) for f in todo)
    print(f"demonstrations: {len(game_files) - len(todo)} of {len(game_files)} games already "
          f"recorded; the expert plays the other {len(todo)} ({replaced} of them recorded with "
          f"another --bc-noise or a shorter step limit, replaced) at --bc-noise {noise}, "
          f"--max-episode-steps {max_steps}", flush=True)
    if not todo:
        return
    progress = Progress(len(todo), "demonstrations (games)")
    steps = 0
    # spawn: a worker inherits no threads; each keeps its own engine caches
    with multiprocessing.get_context("spawn").Pool(min(workers, len(todo)),
                                                    initializer=_ignore_interrupts) as pool:
        for played in pool.imap_unordered(_record, [(f, noise, max_steps) for f in todo]):
            steps += played
            progress.update(1, steps=steps)
    progress.close()


def _record(job: tuple[str, float, int]) -> int:
    """One game of record_demonstrations, in a worker: its steps."""
    from envs.alfworld_env import demonstration_file, recording_digest

    game_file, noise, max_steps = job
    with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
        seed = json.load(f)["expert_seed"]
    played = play_expert(game_file, seed, noise, max_steps)
    write_json(demonstration_file(game_file), {**played, "sha256": recording_digest(played)})
    return len(played["steps"])


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def generate(out: str, per_type: int, seed: int, splits=SPLITS, task_types=TASK_TYPES,
             workers: int = 1, max_draws: int = 5) -> dict:
    """per_type games the expert wins for each split and task type; {(split, type): [files]}.
    A draw the expert loses is skipped; at most max_draws * per_type draws per cell. The cells
    go to `workers` processes, each cell's draws in order, so the games are the same for any
    number of workers; a cell already begun goes on after its last whole game. A progress line
    every 30 s (the games on disk)."""
    whole = {(split, task_type): clear_partial(out, seed, split, task_type)
             for split in splits for task_type in task_types}  # each cell's whole games
    cells = [(out, per_type, seed, split, task_type, max_draws, indices)
             for (split, task_type), indices in whole.items()]
    had = {cell: len(indices) for cell, indices in whole.items()}
    total = per_type * len(cells)
    begun = sum(min(n, per_type) for n in had.values())
    if begun:
        print(f"{begun} of the {total} games are already there: going on from them", flush=True)
    progress = Progress(total, "games", initial=begun)
    # spawn: no inherited threads; a worker ignores Ctrl-C, which this process handles
    with multiprocessing.get_context("spawn").Pool(min(workers, len(cells)),
                                                    initializer=_ignore_interrupts) as pool:
        pending = pool.map_async(_generate_cell, cells)
        while not pending.ready():
            pending.wait(timeout=5)
            done = sum(min(len(glob.glob(os.path.join(out, "json_2.1.1", split,
                                                      f"{task_type}-*", f"trial_T{seed}_?????"))),
                           per_type) for split, task_type in had)
            progress.update(done - progress.count)
        made = dict(pending.get())
    progress.close()
    return made


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _generate_cell(cell: tuple) -> tuple[tuple[str, str], list[str]]:
    """One (split, task type) of generate, in a worker: its game files, draws in order, going on
    after the cell's whole games (`indices`, clear_partial's)."""
    out, per_type, seed, split, task_type, max_draws, indices = cell
    paths = wheel_paths()
    files = [glob.glob(os.path.join(out, "json_2.1.1", split, f"{task_type}-*",
                                    f"trial_T{seed}_{i:05d}", "game.tw-pddl"))[0]
             for i in indices][:per_type]
    index = indices[-1] + 1 if indices else 0
    while len(files) < per_type and index < max_draws * per_type:
        game_file = make_game(out, split, task_type, index, seed, paths)
        index += 1
        if game_file:
            files.append(game_file)
    return (split, task_type), files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m envs.alfworld_games", description=__doc__.split("\n\n")[0],
        epilog="These are real ALFWorld games on the real engine in ALFRED's scene layouts, but "
               "not the benchmark's games (ALFRED placed its objects with the THOR simulator): "
               "scores on them are not comparable with published ALFWorld numbers, for which "
               "fetch the games with alfworld-download.")
    parser.add_argument("--out", required=True,
                        help="data root to write json_2.1.1/<split>/... under (set ALFWORLD_DATA "
                             "to it)")
    parser.add_argument("--per-type", type=int, default=None,
                        help="games per task type and split (default 20: 360 games, about 11 "
                             "minutes; 100: about an hour; 3 minutes per 100 games)")
    parser.add_argument("--seed", type=int, default=1, help="seeds every draw (default 1)")
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=SPLITS,
                        metavar="SPLIT", help=f"splits to write (default all: {' '.join(SPLITS)})")
    parser.add_argument("--task-types", nargs="+", default=list(TASK_TYPES), choices=TASK_TYPES,
                        metavar="TYPE", help="task types to write (default all six: "
                                             f"{', '.join(TASK_TYPES)})")
    parser.add_argument("--demonstrations", action="store_true",
                        help="then play the expert once on every train game of --seed and "
                             "--task-types under --out, kept beside each game for behavior "
                             "cloning to play back; on a set already made, only this")
    parser.add_argument("--bc-noise", type=float,
                        help="with --demonstrations: the share of steps that execute a mistake, "
                             "as the scripts' --bc-noise (default 0.2)")
    parser.add_argument("--max-episode-steps", type=int,
                        help="with --demonstrations: the step limit, as the scripts' flag "
                             "(default 50; a recording serves any limit up to its own)")
    parser.add_argument("--workers", type=int,
                        help="processes making games (one (split, task type) each at a time) "
                             "and playing demonstrations (default: the cores, at most 16)")
    args = parser.parse_args(argv)
    if args.per_type is not None and args.per_type < 1:
        parser.error("--per-type must be >= 1")
    if not 0 <= args.seed < 2**32:
        parser.error("--seed must be in [0, 2**32)")
    from envs import default_env_workers
    from envs.alfworld_env import game_files, task_type_of

    given = [name for name in ("bc_noise", "max_episode_steps")
             if getattr(args, name) is not None]
    if given and not args.demonstrations:
        parser.error(f"--{given[0].replace('_', '-')} is for --demonstrations")
    noise = 0.2 if args.bc_noise is None else args.bc_noise
    max_steps = 50 if args.max_episode_steps is None else args.max_episode_steps
    workers = default_env_workers("alfworld") if args.workers is None else args.workers
    if not 0 <= noise <= 1:
        parser.error("--bc-noise must be in [0, 1]")
    if max_steps < 1 or workers < 1:
        parser.error("--max-episode-steps and --workers must be >= 1")
    try:
        os.makedirs(args.out, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise PermissionError(f"{args.out} is not writable")
    except OSError as e:
        parser.error(f"--out {args.out}: cannot write there ({e})")
    # Only the cells asked for: two processes may write other task types of one set at once.
    existing = [path for split in args.splits for task_type in args.task_types
                for path in glob.glob(os.path.join(args.out, "json_2.1.1", split,
                                                   f"{task_type}-*", f"trial_T{args.seed}_*"))]
    try:
        if existing and args.demonstrations and args.per_type is None:
            print(f"{args.out} already holds games of seed {args.seed}: recording their "
                  "demonstrations only (give --per-type to make more games first)")
        else:  # games already there are kept, and a cell goes on after its last one
            per_type = args.per_type or 20
            made = generate(args.out, per_type, args.seed, args.splits, args.task_types, workers)
            short = {cell: len(files) for cell, files in made.items() if len(files) < per_type}
            print(f"{sum(len(f) for f in made.values())} games of seed {args.seed} under "
                  f"{os.path.join(args.out, 'json_2.1.1')}")
            for (split, task_type), count in short.items():
                print(f"  only {count} {task_type} games in {split}: the expert lost the other "
                      "draws", file=sys.stderr)
        if args.demonstrations:
            train = [f for f in game_files("train", args.out)
                     if f"/trial_T{args.seed}_" in f and task_type_of(f) in args.task_types]
            record_demonstrations(train, noise, max_steps, workers)
    except KeyboardInterrupt:
        print("\ninterrupted: every game written so far is whole and kept; the same command "
              "goes on from them", file=sys.stderr)
        return 130
    except OSError as e:  # a full disk, a folder that became read-only
        print(f"error: writing under {args.out}: {e}; the games written so far are kept, and "
              "the same command goes on from them", file=sys.stderr)
        return 2
    print(f"to use them, type:\n  export ALFWORLD_DATA={os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
