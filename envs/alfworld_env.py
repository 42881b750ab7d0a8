"""The real ALFWorld text environment (TextWorld engine, as in alfworld's AlfredTWEnv), one game
per object, behind the same small interface as envs/household.py.

Games are read from $ALFWORLD_DATA/json_2.1.1/<split>/<task>/<trial>/game.tw-pddl, which the
`alfworld-download` command of the alfworld package fetches (the wheel ships no games), or which
`python -m envs.alfworld_games` generates from the wheel's files (envs/alfworld_games.py). Like
AlfredTWEnv we skip "movable" / "Sliced" trials and games marked unsolvable.

Expert actions come from alfworld's hand-coded TextWorld expert (HandCodedTWAgent, what its
AlfredExpert wrapper runs), driven here, and only in games made with expert=True (the
behavior-cloning demonstrations): it needs the engine's `facts` at every step, which is slow.
alfworld 0.4.2's expert empties its inventory only after a command containing "put", but the
game grammar's command is "move X to Y", so in pick-two games it kept "holding" the first object
and looped until the step limit; the expert is told "put X in/on Y" for such a command instead.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import pickle
import random
import re
import sys
import weakref

from common import UsageError, error_line, written_whole
from envs.base import begin_step, normalise

SPLITS = ("train", "valid_seen", "valid_unseen")
# Game folders start with the task type, e.g. pick_cool_then_place_in_recep-Apple-None-Fridge-1.
TASK_TYPES = ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
              "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep",
              "pick_two_obj_and_place")
PARTIAL = ".partial"  # the end of a game folder being written (envs/alfworld_games.py)
DOWNLOAD_HINT = ("get games in one of two ways (keep ALFWORLD_DATA set when you run the "
                 "scripts):\n"
                 "  the benchmark's games, downloaded by the alfworld package:\n"
                 "    export ALFWORLD_DATA=~/alfworld_data && alfworld-download\n"
                 "  or games generated offline from the alfworld package's files (the real "
                 "engine, but not the benchmark's games, so not comparable with published "
                 "numbers):\n"
                 "    python -m envs.alfworld_games --out ~/alfworld_data --per-type 340 "
                 "--splits train\n"
                 "    python -m envs.alfworld_games --out ~/alfworld_data --per-type 20 "
                 "--splits valid_unseen valid_seen\n"
                 "    export ALFWORLD_DATA=~/alfworld_data\n"
                 "  (the set the README's ALFWorld numbers were measured on, about 24 minutes "
                 "on 2 cores; a smaller --per-type makes fewer train games, and different "
                 "numbers)")


def data_root() -> str:
    return os.path.expanduser(os.environ.get("ALFWORLD_DATA", "~/.cache/alfworld"))


def task_type_of(game_file: str) -> str:
    folder = os.path.basename(os.path.dirname(os.path.dirname(game_file)))
    for t in TASK_TYPES:
        if folder.startswith(t):
            return t
    raise ValueError(f"cannot tell the task type of {game_file}")


def game_files(split: str, root: str | None = None) -> list[str]:
    """Sorted solvable game files of a split (under `root`, default data_root()); a clear
    UsageError when there are none."""
    if split not in SPLITS:
        raise UsageError(f"unknown ALFWorld split {split!r}; expected one of {', '.join(SPLITS)}")
    pattern = os.path.join(root or data_root(), "json_2.1.1", split, "*", "*", "game.tw-pddl")
    files = []
    for path in sorted(glob.glob(pattern)):
        if "movable" in path or "Sliced" in path or os.path.dirname(path).endswith(PARTIAL):
            continue
        try:
            with open(path) as f:
                solvable = json.load(f).get("solvable", False)
        except (ValueError, AttributeError) as e:  # truncated, or not a game's JSON object
            raise UsageError(f"{path} is damaged ({error_line(e)}); delete its folder (a "
                             "generated set: the generator's same command makes it again)"
                             ) from None
        if solvable:
            files.append(path)
    if not files:
        raise UsageError(f"no ALFWorld games found: {pattern} matches nothing "
                         f"(ALFWORLD_DATA={data_root()}).\n{DOWNLOAD_HINT}")
    return files


def game_set(splits: tuple[str, ...]) -> dict:
    """What names the game set a run plays, for its record: the folder, the games of each split,
    the seeds of generated games (their trial_T<seed>_<n> folders; none for the download) and the
    alfworld version."""
    import importlib.metadata

    seeds = set()
    record = {"alfworld_data": data_root()}
    for split in splits:
        files = game_files(split)
        record[f"{split}_games"] = len(files)
        for path in files:
            trial = os.path.basename(os.path.dirname(path))
            match = re.fullmatch(r"trial_T(\d+)_\d{5}", trial)
            if match:
                seeds.add(int(match.group(1)))
    return {**record, "seeds": sorted(seeds), "alfworld": importlib.metadata.version("alfworld")}


def vocabulary() -> list[str]:
    """Every word an ALFWorld game can print or accept, for the word-level tiny tokenizer: the
    grammar's texts and command templates, the goal sentences' templates and the names of all
    ALFRED object and receptacle kinds (a game names "sinkbasin 1" after its kind)."""
    from alfworld.gen import constants, goal_library

    from envs.alfworld_games import wheel_paths

    with open(wheel_paths()["grammar"]) as f:
        words = set(re.findall(r"[a-z]+", f.read().lower()))
    for goal in goal_library.gdict.values():
        words |= set(re.findall(r"[a-z]+", " ".join(goal["templates"]).lower()))
    words |= {kind.lower() for kind in constants.OBJECTS_SET | constants.RECEPTACLES}
    words |= {"welcome", "textworld", "alfred", "nothing", "happens"}
    return sorted(words - {"obj", "recep", "toggle", "mrecep"})


DEMONSTRATION = "demonstration.json"  # beside game.tw-pddl: the noisy expert's game, played once


def demonstration_file(game_file: str) -> str:
    """Where a game's recorded demonstration lies: beside the game."""
    return os.path.join(os.path.dirname(game_file), DEMONSTRATION)


def load_demonstration(game_file: str, max_steps: int) -> dict | None:
    """The game's recorded demonstration (`python -m envs.alfworld_games --demonstrations`) when
    it was played with at least this step limit (the expert never sees the limit, so a shorter
    one is the recording cut), else None."""
    path = demonstration_file(game_file)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            recording = json.load(f)
        recorded_steps, noise = recording["max_steps"], recording["noise"]
        if not isinstance(recording["steps"], list) or not all(
                isinstance(s, dict) and {"admissible", "label", "command"} <= set(s)
                for s in recording["steps"]):
            raise TypeError("its steps are not the recorded steps")
        if "sha256" in recording and recording["sha256"] != recording_digest(recording):
            raise ValueError("edited since it was recorded: its digest differs")
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path} is damaged ({e!r}): delete it, and `python -m "
                         "envs.alfworld_games --demonstrations` records it again") from e
    return recording if recorded_steps >= max_steps and recording["steps"] else None


def recording_digest(recording: dict) -> str:
    """A digest of a demonstration's content, stored in it when recorded (its own field aside)."""
    content = {k: v for k, v in recording.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


class RecordedGame:
    """A recorded expert demonstration, played back without the engine: the observations,
    admissible actions, expert labels and executed commands of the one time it was played, cut
    at max_steps. envs.noisy_expert takes its recorded (label, command); step() accepts only that
    command. A game whose expert gave up ends there (its further steps have no label to learn)."""

    def __init__(self, game_file: str, recording: dict, max_steps: int):
        self.game_file, self.task_type = game_file, task_type_of(game_file)
        self.noise, self.max_steps = recording["noise"], max_steps
        self.task_description = recording["task_description"]
        self._first, self._steps = recording["observation"], recording["steps"][:max_steps]
        self.steps, self.won = 0, False

    def reset(self) -> str:
        self.steps, self.won = 0, False
        return self._first

    def admissible_actions(self) -> list[str]:
        return list(self._steps[self.steps]["admissible"])

    def expert_action(self) -> str | None:
        return self._steps[self.steps]["label"]

    def recorded_step(self, noise: float) -> tuple[str | None, str]:
        """(label, command) as recorded; the recording's noise must be the one asked for."""
        if noise != self.noise:
            raise UsageError(f"{self.game_file}'s demonstration was played with --bc-noise "
                             f"{self.noise}, not {noise}: pass --bc-noise {self.noise}, or "
                             f"record the set again with --bc-noise {noise}")
        step = self._steps[self.steps]
        return step["label"], step["command"]

    def step(self, command: str) -> tuple[str, float, bool, dict]:
        """The recorded answer: only to the recorded command (any case and spacing)."""
        if self.won or self.steps >= len(self._steps):
            raise RuntimeError("step() called on a finished game; call reset() first")
        step = self._steps[self.steps]
        if normalise(command) != normalise(step["command"]):
            raise RuntimeError(f"a recorded demonstration plays only its own commands: "
                               f"{step['command']!r}, not {command!r}")
        self.steps, self.won = self.steps + 1, step["won"]
        done = step["done"] or self.steps == len(self._steps)
        return step["observation"], float(self.won), done, {"won": self.won,
                                                            "valid": step["valid"]}


def expert_view(command: str) -> str:
    """The command as alfworld's hand-coded expert must see it to track its inventory: the
    grammar's "move X to Y" written as the older "put X in/on Y" (see the module docstring)."""
    moved = re.fullmatch(r"move (.+) to (.+)", command)
    return f"put {moved[1]} in/on {moved[2]}" if moved else command


def memoize_engine() -> None:
    """Make TextWorld's PDDL engine do its pure, repeated work once per process.

    - Parses: at every step the engine re-parses, with TatSu, the same few hundred strings (the
      command template and feedback rule of every applicable action, the conditions of the
      grammar's rules): about 85 % of a step. Both parsers (textworld.envs.pddl.textgen's and
      textworld.logic's `_parse_and_convert`) are cached, and so is the parse of a game's own
      grammar at its load (textworld.envs.pddl.logic's, the TRANSLATIONS_KEPT last games: the
      copies of a game in a group then parse it once).
    - Translations: a game's load and every reset run Fast Downward's translator on the same
      domain and problem (twice: plain and optimized). fast_downward.pddl2sas is cached too, for
      the last TRANSLATIONS_KEPT translations (a reset, or another copy of the same game, then
      costs no translation), and on disk beside the game set (_stored: a game is translated
      once per game set, not once per process).

    Each call gets its own copy of the cached result, because the engine writes into what it is
    given: the result is kept pickled and each call unpickles it (faster than copy.deepcopy of
    the same objects, docs/performance.md). The observations and admissible commands are
    unchanged (tested against TextWorld unpatched).

    - Contexts: the grammar copies a derivation's context at every symbol, deep-copying its
      variables (the entities' infos) and mapping: most of a step once parses are cached. The
      grammar only reads the entities (its expressions are `o.name`, `r.indefinite`, ...) and
      adds keys to the two dicts, so new dicts holding the same entries are the same context.

    - Libraries: every game loads its own copy of Fast Downward's library (its state lives in
      the library's globals), and a loaded library is never unloaded: about 4 MB a game, for
      good (a worker of a 10-iteration ALFWorld run made ~440 games). A game's copy goes back to
      a free list when the game is gone (AlfworldEnv), and fast_downward.load_lib takes from it
      first: a process holds as many copies as it ever had games alive at once."""
    import fast_downward
    from textworld import logic
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.envs.pddl import textgen

    fast_downward.load_lib = _pooled(fast_downward.load_lib)
    fast_downward.pddl2sas = _memoized(fast_downward.pddl2sas, kept=TRANSLATIONS_KEPT,
                                       on_disk=True)
    textgen._parse_and_convert = _memoized(textgen._parse_and_convert)
    logic._parse_and_convert = _memoized(logic._parse_and_convert)
    pddl_logic._parse_and_convert = _memoized(pddl_logic._parse_and_convert,
                                              kept=TRANSLATIONS_KEPT)
    textgen.copy_context = _copy_context


def _copy_context(context: dict) -> dict:
    """textgen.copy_context with the variables and mapping in new dicts, their entries shared."""
    return {"state": context["state"], "facts": context["facts"],
            "variables": dict(context["variables"]), "mapping": dict(context["mapping"]),
            "entity_infos": context["entity_infos"]}


def _memoized(function, kept: int | None = None, on_disk: bool = False):
    """`function` (pure) with its results cached by arguments, the `kept` most recently used
    (all when None), and with on_disk also on disk (_stored); every call gets a copy of its own
    (the pickled result unpickled). A function already memoized is returned as it is, so
    memoize_engine may run many times."""
    if getattr(function, "memoized", False):
        return function
    cache = collections.OrderedDict()  # least recently used first: key -> pickled result

    def pickled(*args, **kwargs) -> bytes:  # pickled once: a fresh translation pickles slowly
        return pickle.dumps(function(*args, **kwargs), pickle.HIGHEST_PROTOCOL)

    produce = _stored(pickled) if on_disk else pickled

    def memoized(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = produce(*args, **kwargs)
            if kept is not None and len(cache) > kept:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return pickle.loads(cache[key])

    memoized.memoized = True
    return memoized


def _stored(pickled):
    """pickled(*args, **kwargs) -> bytes (a translation, pickled) with its results also kept in
    data_root()'s translations/ folder (without ALFWORLD_DATA, ~/.cache/alfworld's), one
    compressed file per arguments, named by their sha256 with Fast Downward's and Python's
    versions, read back by any later process. A file that does not read back whole (zlib checks
    it) is made and written again; where the folder cannot be written nothing is kept."""
    import importlib.metadata
    import zlib

    version = importlib.metadata.version("fast_downward_textworld")

    def stored(*args, **kwargs) -> bytes:  # named by Python's version too: its pickles
        named = json.dumps([version, sys.version_info[:2], args, sorted(kwargs.items())]).encode()
        name = hashlib.sha256(named).hexdigest()
        path = os.path.join(data_root(), "translations", name[:2], f"{name}.pickle.z")
        try:
            with open(path, "rb") as f:
                return zlib.decompress(f.read())
        except (OSError, zlib.error):
            pass  # not there yet, or damaged: made again
        result = pickled(*args, **kwargs)
        try:  # two workers may write one translation: each its own partial file
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with written_whole(path) as partial, open(partial, "wb") as f:
                f.write(zlib.compress(result, 1))
        except OSError:  # a read-only game set, a full disk: kept in memory only
            pass
        return result

    return stored


# Per-game results memoize_engine keeps: two translations a problem, so a worker holding 256
# games (an evaluation's 120, made before any is reset) translates none twice; ~250 KB each.
TRANSLATIONS_KEPT = 512
_FREE_LIBRARIES: list = []  # loaded copies of Fast Downward whose game is gone (memoize_engine)


def _pooled(load_lib):
    """fast_downward.load_lib taking a free copy first (each game's PddlState loads its problem
    into the copy anew). One already pooled is returned as it is, so memoize_engine may run many
    times."""
    if getattr(load_lib, "pooled", False):
        return load_lib

    def load():
        return _FREE_LIBRARIES.pop() if _FREE_LIBRARIES else load_lib()

    load.pooled = True
    return load


def _keeping_argv(call, *args):
    """call(*args) with sys.argv restored afterwards: Fast Downward's translator, which every
    load and reset runs, overwrites sys.argv with ['translate.py', 'domain', 'task']."""
    argv = list(sys.argv)
    try:
        return call(*args)
    finally:
        sys.argv[:] = argv


class AlfworldEnv:
    """One ALFWorld game. reset() -> first observation; step(command) -> (obs, reward, done, info).
    expert_action() needs expert=True."""

    def __init__(self, game_file: str, max_steps: int = 50, expert: bool = False,
                 seed: int | None = None):
        try:
            import textworld
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        except ImportError as e:  # pragma: no cover - alfworld is in requirements.txt
            raise UsageError(f"--env alfworld needs the alfworld package ({e}); "
                             "pip install alfworld") from e
        memoize_engine()
        self.game_file, self.max_steps, self.expert = game_file, max_steps, expert
        self.task_type = task_type_of(game_file)
        infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=expert,
                                   extras=["gamefile"])
        self._env = _keeping_argv(textworld.start, game_file, infos,
                                  [AlfredDemangler(), AlfredInfos])
        # This game's copy of Fast Downward serves a later game once this one is gone.
        weakref.finalize(self, _FREE_LIBRARIES.append, self._env.unwrapped.downward_lib)
        self._state = None
        self._goal = None  # goal_types of its PDDL problem, read by steps_to_go
        self._played: list[str] = []
        self._expert_agent = None
        self._expert_plan = "look"
        if expert and seed is None:
            seed = random.getrandbits(32)
        self._expert_seed = seed  # the expert's own random stream, restarted at every reset
        self._expert_random_state = None
        self.task_description = ""
        self.steps = 0
        self.won = False

    def reset(self) -> str:
        self._state = _keeping_argv(self._env.reset)
        self.steps, self.won, self._played = 0, False, []
        if self.expert:
            from alfworld.agents.expert import HandCodedTWAgent

            self._expert_agent = HandCodedTWAgent(max_steps=200)
            self._expert_agent.reset(self.game_file)
            self._expert_agent.observe(self._state.feedback)
            self._expert_plan = "look"
            self._expert_random_state = random.Random(self._expert_seed).getstate()
        obs = self._state.feedback
        # Drop TextWorld's banner; keep "You are in the middle of a room ... Your task is to: ...".
        start = obs.find("You are in the middle")
        obs = obs[start:].strip() if start >= 0 else obs.strip()
        self.task_description = obs.split("Your task is to: ", 1)[-1].strip()
        return obs

    def admissible_actions(self) -> list[str]:
        return [a for a in self._state["admissible_commands"] if a != "help"]

    def snapshot(self) -> tuple[str, ...]:
        """The commands played since reset(): TextWorld's PDDL engine cannot copy its state, so
        restore() replays them from a reset (about one CPU-second, plus a step per command)."""
        return tuple(self._played)

    def restore(self, snapshot: tuple[str, ...]) -> None:
        self.reset()
        for command in snapshot:
            self.step(command)

    def expert_action(self) -> str | None:
        """The expert's next command; None once it has given up on this game."""
        if not self.expert:
            raise RuntimeError("expert_action() needs a game made with expert=True")
        return self._expert_plan

    def _update_expert(self, command: str) -> None:
        """What alfworld's AlfredExpert does after a step, with expert_view(command). An expert
        that fails or times out (it raises) gives up: None from then on, instead of ending the
        run."""
        from alfworld.agents.expert.handcoded_expert import (HandCodedAgentFailed,
                                                             HandCodedAgentTimeout)

        if self._expert_agent is None:
            return
        admissible = self.admissible_actions()
        # The expert draws from the global `random` (which object of several to take): give it
        # this game's own stream, so a game plays the same in any process and leaves the
        # caller's stream alone.
        caller_state = random.getstate()
        random.setstate(self._expert_random_state)
        try:
            action = self._expert_agent.policy.act(self._state, expert_view(command))
            # HandCodedAgent.act's guard against repeating itself, on the command as played.
            if action == command or (command == "look" and action not in admissible):
                action = random.choice(admissible)
        except (HandCodedAgentFailed, HandCodedAgentTimeout, IndexError, KeyError, ValueError):
            self._expert_agent, action = None, None
        finally:
            self._expert_random_state = random.getstate()
            random.setstate(caller_state)
        self._expert_plan = action if action in admissible or action is None else "look"

    def step(self, command: str) -> tuple[str, float, bool, dict]:
        command, valid = begin_step(self, command)
        self._played.append(command)
        # A non-admissible command still goes to the engine, which answers "Nothing happens.".
        self._state, _, _ = self._env.step(command)
        self.won = bool(self._state["won"])
        done = self.won or self.steps >= self.max_steps
        if self.expert and not done:
            self._update_expert(command)
        info = {"won": self.won, "valid": valid}
        return self._state.feedback.strip(), float(self.won), done, info


# The oracle's distance ------------------------------------------------------------------------
# A change the goal asks for: (the fact it sets, the type of receptacle that does it).
CHANGES = {"clean": ("isclean", "sinkbasintype"), "heat": ("ishot", "microwavetype"),
           "cool": ("iscool", "fridgetype")}


def goal_types(problem: str) -> dict:
    """A game's PDDL goal as the types it names: "object" (e.g. "appletype"), "receptacle" (None
    when the object is to be held), "lamp" (None unless it is to be looked at under one),
    "change" (a key of CHANGES, or None) and "two" (two objects of the type, not one)."""
    goal = problem[problem.find("(:goal"):].lower()
    types = re.findall(r"objecttype \?\w+ (\w+)", goal)
    receptacles = re.findall(r"receptacletype \?\w+ (\w+)", goal)
    return {"object": next(t for t in types if "lamp" not in t),
            "receptacle": receptacles[0] if receptacles else None,
            "lamp": next((t for t in types if "lamp" in t), None),
            "change": next((c for c, (fact, _) in CHANGES.items() if fact in goal), None),
            "two": "?o2" in goal}


def plan_length(facts: list[tuple[str, ...]], goal: dict, cap: int = 60) -> int:
    """The fewest commands from a state to a win (0 if it is won), worked out from its true
    facts (name, *arguments), e.g. ("inreceptacle", apple, fridge), and goal_types(). A command
    goes anywhere ("go to"), opens what is closed (once: what a plan opened stays open), takes,
    puts, cleans / heats / cools or switches a lamp on; the object in hand first goes into a
    receptacle that can hold it. `cap` when the goal cannot be reached."""
    at, held, fits = None, None, set()
    place, kind, inside = {}, {}, collections.defaultdict(set)  # receptacle -> location, type
    true_of = collections.defaultdict(set)  # fact name -> what it is true of
    for name, *args in facts:
        if name == "atlocation":
            at = args[1]
        elif name == "holds":
            held = args[1]
        elif name == "receptacleatlocation":
            place[args[0]] = args[1]
        elif name in ("receptacletype", "objecttype"):
            kind[args[0]] = args[1]
        elif name == "inreceptacle":
            inside[args[0]].add(args[1])
        elif name == "cancontain":
            fits.add((args[0], args[1]))
        else:  # opened, openable, isclean, ishot, iscool, istoggled, pickupable, ...
            true_of[name].add(args[0])

    def go(here, there):
        return 0 if here == there else 1

    def opening(r, opened):
        """1 if receptacle r is closed and the plan has not opened it yet (in `opened`)."""
        return int(r in true_of["openable"] and r not in true_of["opened"] and r not in opened)

    def put_down(here, there, holding, opened):
        """The ways to stand at `there` with empty hands, as (commands, receptacles opened):
        the object held goes into a receptacle that can hold it, here, there or on the way."""
        if holding is None:
            return [(go(here, there), opened)]
        return [(go(here, location) + opening(r, opened) + 1 + go(location, there), opened | {r})
                for r, location in place.items() if (kind.get(r), kind.get(holding)) in fits]

    def fetch(o, here, holding, opened):
        """The ways to hold object o, from `here` holding `holding`, as (commands, where they
        end, receptacles opened): go where it is, open its receptacle (where the object held may
        go too), take it."""
        if holding == o:
            return [(0, here, opened)]
        ways = []
        for r in inside[o] & place.keys():
            for steps, now_open in put_down(here, place[r], holding, opened | {r}):
                ways.append((steps + opening(r, opened) + 1, place[r], now_open))
        return ways

    things = [o for o, t in kind.items()
              if t == goal["object"] and o in true_of["pickupable"]]
    targets = [r for r, t in kind.items() if t == goal["receptacle"]]
    best, none = cap, frozenset()
    if goal["lamp"] is not None:  # hold the object where a lamp that was switched on stands
        lamps = [o for o, t in kind.items() if t == goal["lamp"]]
        for o in things:
            for lamp in lamps:
                for r in inside[lamp] & place.keys():
                    switch = 0 if lamp in true_of["istoggled"] else 1
                    for steps, here, _ in fetch(o, at, held, none):
                        best = min(best, steps + go(here, place[r]) + switch)
                    for steps, here, _ in fetch(o, place[r], held, none):
                        best = min(best, go(at, place[r]) + switch + steps + go(here, place[r]))
        return best
    if goal["two"]:  # two objects of the type in one receptacle of the type
        for r in targets:
            there = place[r]
            missing = 2 - min(2, sum(r in inside[o] for o in things))
            if missing == 0:
                return 0
            others = [o for o in things if r not in inside[o]]
            for first in others:
                for steps, here, opened in fetch(first, at, held, none):
                    steps += go(here, there) + opening(r, opened) + 1
                    if missing == 1:
                        best = min(best, steps)
                        continue
                    for second in (o for o in others if o != first):
                        for more, here, _ in fetch(second, there, None, opened | {r}):
                            best = min(best, steps + more + go(here, there) + 1)
        return best
    for o in things:  # one object, changed if the goal asks, into a receptacle of the type
        ways = fetch(o, at, held, none)
        if goal["change"] is not None and o not in true_of[CHANGES[goal["change"]][0]]:
            devices = [r for r, t in kind.items() if t == CHANGES[goal["change"]][1]]
            ways = [(steps + go(here, place[d]) + 1, place[d], opened)
                    for steps, here, opened in ways for d in devices]
        for steps, here, opened in ways:
            for r in targets:
                best = min(best, steps + go(here, place[r]) + opening(r, opened) + 1)
    return best


def steps_to_go(game: AlfworldEnv, cap: int = 60) -> int:
    """The oracle's distance: plan_length of the game's true state and goal (0 once won). The
    engine's planner (Fast Downward, TextWorld's policy_commands) finds plans of this length,
    but takes up to seconds a state; this takes a millisecond. A function of the state alone:
    it knows where everything is, so a step that only searches earns nothing, unlike the
    household's expert, which searches."""
    if game.won:
        return 0
    engine = game._env.unwrapped
    if game._goal is None:
        game._goal = goal_types(engine._game_data["pddl_problem"])
    facts = [(f.name, *[v.name for v in f.arguments])
             for f in game._state["_facts"] if not f.is_negation]
    return plan_length(facts, game._goal, cap)


def true_state(game: AlfworldEnv) -> str:
    """The game's true state as text: the PDDL facts that hold, sorted (the engine also keeps
    the negations a step asserted, e.g. not_atlocation of every place the agent has left)."""
    return repr(sorted(str(fact) for fact in game._state["_facts"] if not fact.is_negation))
