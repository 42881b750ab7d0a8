"""A procedurally generated text household in the spirit of ALFWorld, in pure Python.

Every task is a deterministic function of an integer seed: a room type (kitchen, living room,
bedroom, bathroom), its receptacles (numbered like ALFWorld's "cabinet 3"; drawers, cabinets,
fridges, microwaves and safes start closed), objects placed where such objects usually are, and
one goal of the six ALFWorld task types. The text (observations, admissible commands, goal
sentences) follows ALFWorld's TextWorld engine closely enough that a prompt written for one reads
naturally for the other.

The agent does not know where objects are. The expert planner does not cheat either: it searches
the receptacles where an object of that kind usually lies, in a fixed order, using only what the
agent has already seen. So expert trajectories are what a careful player would do, and a learned
policy can match them; the harder task types take the expert 10-30 steps.

Rewards are sparse: 1.0 on the step that completes the goal, 0.0 otherwise. A command that is not
admissible changes nothing, returns "Nothing happens." and is flagged invalid.
"""

from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass, field

from envs.base import begin_step

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

OPENABLE = {"cabinet", "drawer", "fridge", "microwave", "safe"}

# Receptacle types of each room: (type, min count, max count).
ROOM_LAYOUTS = {
    "kitchen": [
        ("countertop", 1, 3), ("cabinet", 2, 6), ("drawer", 1, 4), ("fridge", 1, 1),
        ("microwave", 1, 1), ("sinkbasin", 1, 1), ("stoveburner", 2, 4), ("diningtable", 0, 1),
        ("garbagecan", 1, 1), ("shelf", 0, 2), ("coffeemachine", 1, 1), ("toaster", 0, 1),
    ],
    "livingroom": [
        ("sofa", 1, 1), ("armchair", 0, 1), ("coffeetable", 1, 1), ("sidetable", 1, 2),
        ("tvstand", 0, 1), ("shelf", 1, 3), ("drawer", 1, 3), ("cabinet", 0, 2),
        ("dresser", 0, 1), ("garbagecan", 1, 1), ("safe", 0, 1),
    ],
    "bedroom": [
        ("bed", 1, 1), ("desk", 1, 1), ("dresser", 1, 1), ("drawer", 2, 5), ("shelf", 1, 3),
        ("sidetable", 0, 2), ("garbagecan", 1, 1), ("laundryhamper", 0, 1), ("safe", 0, 1),
    ],
    "bathroom": [
        ("countertop", 1, 1), ("sinkbasin", 1, 2), ("cabinet", 2, 4), ("toilet", 1, 1),
        ("bathtubbasin", 0, 1), ("garbagecan", 1, 1), ("towelholder", 1, 1),
        ("handtowelholder", 0, 1), ("shelf", 0, 1), ("drawer", 0, 2),
    ],
}

# Objects of each room and the receptacle types where they usually are. The generator places
# objects only in these types; the expert searches them first.
OBJECT_PLACES = {
    "kitchen": {
        "apple": ["countertop", "diningtable", "fridge", "garbagecan"],
        "bread": ["countertop", "diningtable", "fridge"],
        "egg": ["fridge", "countertop", "diningtable", "garbagecan"],
        "lettuce": ["fridge", "countertop", "diningtable"],
        "potato": ["fridge", "countertop", "diningtable", "garbagecan"],
        "tomato": ["fridge", "countertop", "diningtable", "garbagecan"],
        "mug": ["coffeemachine", "cabinet", "countertop", "shelf", "sinkbasin"],
        "cup": ["cabinet", "countertop", "fridge", "shelf", "microwave"],
        "bowl": ["cabinet", "countertop", "fridge", "shelf", "diningtable"],
        "plate": ["cabinet", "countertop", "diningtable", "shelf"],
        "pan": ["stoveburner", "cabinet", "countertop"],
        "pot": ["stoveburner", "cabinet", "countertop"],
        "knife": ["drawer", "countertop", "diningtable"],
        "fork": ["drawer", "countertop", "diningtable"],
        "spoon": ["drawer", "countertop", "diningtable", "sinkbasin"],
        "spatula": ["drawer", "countertop", "diningtable"],
        "ladle": ["drawer", "countertop", "diningtable"],
        "saltshaker": ["countertop", "cabinet", "shelf", "diningtable"],
        "peppershaker": ["countertop", "cabinet", "shelf", "drawer"],
        "dishsponge": ["sinkbasin", "countertop", "drawer", "cabinet"],
        "winebottle": ["countertop", "cabinet", "fridge", "diningtable"],
    },
    "livingroom": {
        "book": ["shelf", "coffeetable", "sidetable", "sofa", "drawer"],
        "cd": ["shelf", "tvstand", "drawer", "coffeetable", "safe"],
        "creditcard": ["coffeetable", "sidetable", "drawer", "dresser", "safe"],
        "keychain": ["coffeetable", "sidetable", "drawer", "dresser", "safe"],
        "remotecontrol": ["sofa", "coffeetable", "armchair", "tvstand", "sidetable"],
        "statue": ["shelf", "coffeetable", "sidetable", "dresser", "tvstand"],
        "vase": ["shelf", "coffeetable", "sidetable", "dresser", "tvstand"],
        "newspaper": ["sofa", "coffeetable", "armchair", "sidetable", "garbagecan"],
        "pillow": ["sofa", "armchair"],
        "watch": ["coffeetable", "sidetable", "drawer", "dresser", "safe"],
        "box": ["coffeetable", "shelf", "sidetable", "dresser", "cabinet"],
        "laptop": ["sofa", "coffeetable", "armchair", "sidetable"],
    },
    "bedroom": {
        "book": ["desk", "shelf", "bed", "sidetable", "drawer"],
        "cd": ["desk", "shelf", "drawer", "safe"],
        "cellphone": ["bed", "desk", "sidetable", "dresser", "drawer"],
        "creditcard": ["desk", "dresser", "sidetable", "drawer", "safe"],
        "keychain": ["dresser", "desk", "sidetable", "drawer", "safe"],
        "pen": ["desk", "drawer", "shelf", "sidetable"],
        "pencil": ["desk", "drawer", "shelf", "sidetable"],
        "alarmclock": ["desk", "sidetable", "dresser", "shelf"],
        "laptop": ["bed", "desk", "dresser"],
        "pillow": ["bed"],
        "mug": ["desk", "shelf", "sidetable"],
        "cloth": ["laundryhamper", "dresser", "drawer", "bed"],
    },
    "bathroom": {
        "soapbar": ["countertop", "sinkbasin", "bathtubbasin", "cabinet", "toilet"],
        "soapbottle": ["countertop", "cabinet", "toilet", "shelf", "bathtubbasin"],
        "spraybottle": ["cabinet", "countertop", "toilet", "shelf"],
        "toiletpaper": ["toilet", "cabinet", "countertop", "shelf", "drawer"],
        "candle": ["countertop", "toilet", "shelf", "cabinet", "bathtubbasin"],
        "cloth": ["cabinet", "countertop", "bathtubbasin", "drawer", "sinkbasin"],
        "towel": ["towelholder", "countertop"],
        "handtowel": ["handtowelholder", "countertop"],
        "tissuebox": ["toilet", "countertop", "shelf", "cabinet"],
        "dishsponge": ["sinkbasin", "countertop", "cabinet", "bathtubbasin"],
    },
}

CLEANABLE = {"apple", "egg", "lettuce", "potato", "tomato", "mug", "cup", "bowl", "plate", "pan",
             "pot", "knife", "fork", "spoon", "spatula", "ladle", "dishsponge", "soapbar", "cloth"}
HEATABLE = {"apple", "bread", "egg", "potato", "tomato", "mug", "cup", "plate"}
COOLABLE = {"apple", "bread", "egg", "lettuce", "potato", "tomato", "mug", "cup", "bowl", "plate",
            "pan", "pot", "winebottle"}
# Where a goal may ask an object to go (never an appliance that only transforms it).
PLACE_TARGETS = {"countertop", "cabinet", "drawer", "fridge", "microwave", "diningtable", "shelf",
                 "garbagecan", "sofa", "armchair", "coffeetable", "sidetable", "dresser", "desk",
                 "bed", "safe", "toilet", "bathtubbasin", "sinkbasin", "stoveburner"}
LAMP_PLACES = {"livingroom": ["sidetable", "coffeetable", "dresser", "shelf"],
               "bedroom": ["desk", "sidetable", "dresser", "shelf"]}
ROOM_NAMES = {"kitchen": "kitchen", "livingroom": "living room", "bedroom": "bedroom",
              "bathroom": "bathroom"}
# Rooms that have what each task type needs (sink, microwave, fridge, lamp).
ROOMS_FOR_TASK = {
    "pick_and_place_simple": ("kitchen", "livingroom", "bedroom", "bathroom"),
    "look_at_obj_in_light": ("livingroom", "bedroom"),
    "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
    "pick_heat_then_place_in_recep": ("kitchen",),
    "pick_cool_then_place_in_recep": ("kitchen",),
    "pick_two_obj_and_place": ("kitchen", "livingroom", "bedroom", "bathroom"),
}
NUM_TRAIN_TASKS = 4000
NUM_TEST_TASKS = 600
NUM_VALID_TASKS = 600
TEST_SEED_OFFSET = 1_000_000
VALID_SEED_OFFSET = 2_000_000


@dataclass
class Task:
    """Everything fixed at generation: the room, its contents and the goal."""

    seed: int
    room: str
    task_type: str
    receptacles: list[str]                   # "cabinet 1", ... in a fixed order
    contents: dict[str, list[str]]           # receptacle -> objects in it at the start
    lamp: str                                # "desklamp 1" or "" when the task needs none
    target_object: str                       # object type, e.g. "apple"
    target_receptacle: str                   # receptacle type, e.g. "fridge"; "" for look tasks
    goal: str                                # "put a clean apple in fridge."

    def fingerprint(self) -> tuple:
        return (self.room, self.task_type, self.goal,
                tuple((r, tuple(self.contents[r])) for r in self.receptacles), self.lamp)


def _kind(name: str) -> str:
    return name.rsplit(" ", 1)[0]


def _goal_sentence(task_type: str, obj: str, recep: str, rng: random.Random) -> str:
    forms = {
        "pick_and_place_simple": [f"put a {obj} in {recep}.", f"put some {obj} on {recep}."],
        "look_at_obj_in_light": [f"look at {obj} under the desklamp.",
                                 f"examine the {obj} with the desklamp."],
        "pick_clean_then_place_in_recep": [f"put a clean {obj} in {recep}.",
                                  f"clean some {obj} and put it in {recep}."],
        "pick_heat_then_place_in_recep": [f"put a hot {obj} in {recep}.",
                                 f"heat some {obj} and put it in {recep}."],
        "pick_cool_then_place_in_recep": [f"put a cool {obj} in {recep}.",
                                 f"cool some {obj} and put it in {recep}."],
        "pick_two_obj_and_place": [f"put two {obj} in {recep}.",
                                   f"find two {obj} and put them in {recep}."],
    }
    return rng.choice(forms[task_type])


def generate_task(seed: int, task_type: str | None = None) -> Task:
    """The task of a seed (a fresh random.Random(seed) drives every choice, so it is exact)."""
    rng = random.Random(seed)
    task_type = task_type or TASK_TYPES[rng.randrange(len(TASK_TYPES))]
    while True:  # rejection sampling: a few draws at most
        room = rng.choice(ROOMS_FOR_TASK[task_type])
        receptacles = []
        for kind, lo, hi in ROOM_LAYOUTS[room]:
            receptacles += [f"{kind} {i}" for i in range(1, rng.randint(lo, hi) + 1)]
        kinds_here = {_kind(r) for r in receptacles}
        places = {o: [k for k in ks if k in kinds_here] for o, ks in OBJECT_PLACES[room].items()}
        candidates = [o for o, ks in places.items() if ks]
        if task_type == "pick_clean_then_place_in_recep":
            candidates = [o for o in candidates if o in CLEANABLE]
        elif task_type == "pick_heat_then_place_in_recep":
            candidates = [o for o in candidates if o in HEATABLE]
        elif task_type == "pick_cool_then_place_in_recep":
            candidates = [o for o in candidates if o in COOLABLE]
        target = rng.choice(candidates)

        # The target object (two or three of it for pick-two, else one or two) plus distractors.
        pick_two = task_type == "pick_two_obj_and_place"
        counts = {target: rng.randint(2, 3) if pick_two else rng.randint(1, 2)}
        for o in rng.sample(list(places), k=min(6, len(places))):
            if o not in counts and places[o]:
                counts[o] = rng.randint(1, 2)
        contents: dict[str, list[str]] = {r: [] for r in receptacles}
        for o, n in counts.items():
            for i in range(1, n + 1):
                kind = rng.choice(places[o])
                spot = rng.choice([r for r in receptacles if _kind(r) == kind])
                contents[spot].append(f"{o} {i}")
        lamp = ""
        if task_type == "look_at_obj_in_light":
            lamp_spots = [r for r in receptacles if _kind(r) in LAMP_PLACES[room]]
            lamp = "desklamp 1"
            contents[rng.choice(lamp_spots)].append(lamp)
            target_recep = ""
        else:
            where_target = {_kind(r) for r, objs in contents.items()
                            if any(_kind(x) == target for x in objs)}
            targets = sorted(k for k in kinds_here & PLACE_TARGETS if k not in where_target)
            if task_type in ("pick_clean_then_place_in_recep",):
                targets = [k for k in targets if k != "sinkbasin"]
            if task_type in ("pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep"):
                targets = [k for k in targets if k not in ("microwave", "fridge")]
            if not targets:
                continue
            target_recep = rng.choice(targets)
        for r in receptacles:
            rng.shuffle(contents[r])
        goal = _goal_sentence(task_type, target, target_recep, rng)
        return Task(seed, room, task_type, receptacles, contents, lamp, target, target_recep, goal)


def _see_list(items: list[str]) -> str:
    if not items:
        return "nothing"
    names = [f"a {x}" for x in items]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]


# The fields of HouseholdEnv that a step changes (what snapshot() copies).
_GAME_STATE = ("contents", "is_open", "location", "holding", "clean", "hot", "cool", "seen",
               "lamp_on", "won", "steps")


@dataclass
class HouseholdEnv:
    """One game. reset() -> first observation; step(command) -> (obs, reward, done, info)."""

    task: Task
    max_steps: int = 50
    # Mutable game state, set by reset().
    contents: dict[str, list[str]] = field(default_factory=dict)
    is_open: dict[str, bool] = field(default_factory=dict)
    location: str = ""
    holding: str = ""
    clean: set = field(default_factory=set)
    hot: set = field(default_factory=set)
    cool: set = field(default_factory=set)
    seen: set = field(default_factory=set)        # receptacles whose contents the agent has seen
    lamp_on: bool = False
    won: bool = False
    steps: int = 0

    @property
    def task_type(self) -> str:
        return self.task.task_type

    @property
    def task_description(self) -> str:
        return self.task.goal

    def reset(self) -> str:
        t = self.task
        self.contents = {r: list(objs) for r, objs in t.contents.items()}
        self.is_open = {r: _kind(r) not in OPENABLE for r in t.receptacles}
        self.location, self.holding, self.lamp_on, self.won, self.steps = "", "", False, False, 0
        self.clean, self.hot, self.cool, self.seen = set(), set(), set(), set()
        around = _see_list(t.receptacles)
        return (f"You are in the middle of a {ROOM_NAMES[t.room]}. Looking quickly around you, "
                f"you see {around}.\n\nYour task is to: {t.goal}")

    def snapshot(self) -> dict:
        """A copy of the game's mutable state; restore(snapshot) puts the game back into it (a
        search that branches from a saved state, as 3SPO's does)."""
        return copy.deepcopy({name: getattr(self, name) for name in _GAME_STATE})

    def restore(self, snapshot: dict) -> None:
        for name, value in copy.deepcopy(snapshot).items():
            setattr(self, name, value)

    # ---- rules -------------------------------------------------------------------------------
    def _visible(self) -> list[str]:
        r = self.location
        return self.contents[r] if r and self.is_open[r] else []

    def _describe_here(self) -> str:
        r = self.location
        if not self.is_open[r]:
            return f"The {r} is closed."
        self.seen.add(r)
        prep = "In it" if _kind(r) in OPENABLE else f"On the {r}"
        return f"{prep}, you see {_see_list(self.contents[r])}."

    def admissible_actions(self) -> list[str]:
        acts = [f"go to {r}" for r in self.task.receptacles if r != self.location]
        r = self.location
        if r:
            if _kind(r) in OPENABLE:
                acts.append(f"close {r}" if self.is_open[r] else f"open {r}")
            if self.is_open[r]:
                if not self.holding:
                    acts += [f"take {o} from {r}" for o in self.contents[r]
                             if _kind(o) != "desklamp"]
                else:
                    acts.append(f"move {self.holding} to {r}")
            if self.holding:
                kind = _kind(r)
                obj = _kind(self.holding)
                if kind == "sinkbasin" and obj in CLEANABLE:
                    acts.append(f"clean {self.holding} with {r}")
                if kind == "microwave" and obj in HEATABLE:
                    acts.append(f"heat {self.holding} with {r}")
                if kind == "fridge" and obj in COOLABLE:
                    acts.append(f"cool {self.holding} with {r}")
            if self.is_open[r] and self.task.lamp in self.contents[r]:
                acts.append(f"use {self.task.lamp}")
            acts.append(f"examine {r}")
        acts += ["inventory", "look"]
        return acts

    def _goal_met(self) -> bool:
        t = self.task
        if t.task_type == "look_at_obj_in_light":
            return self.lamp_on and _kind(self.holding) == t.target_object
        need = {"pick_clean_then_place_in_recep": self.clean,
                "pick_heat_then_place_in_recep": self.hot,
                "pick_cool_then_place_in_recep": self.cool}.get(t.task_type)
        for r, objs in self.contents.items():
            if _kind(r) != t.target_receptacle:
                continue
            good = [o for o in objs if _kind(o) == t.target_object and (need is None or o in need)]
            if len(good) >= (2 if t.task_type == "pick_two_obj_and_place" else 1):
                return True
        return False

    def step(self, command: str) -> tuple[str, float, bool, dict]:
        """Apply one command. info: won (bool), valid (the command was admissible)."""
        command, valid = begin_step(self, command)
        obs = self._apply(command) if valid else "Nothing happens."
        if valid and self._goal_met():  # begin_step refuses a game already won
            self.won = True
        done = self.won or self.steps >= self.max_steps
        return obs, float(self.won), done, {"won": self.won, "valid": valid}

    def _apply(self, c: str) -> str:
        r = self.location
        if c.startswith("go to "):
            self.location = c[6:]
            return f"You arrive at {self.location}. " + self._describe_here()
        if c.startswith("open "):
            self.is_open[r] = True
            return f"You open the {r}. The {r} is open. " + self._describe_here()
        if c.startswith("close "):
            self.is_open[r] = False
            return f"You close the {r}."
        if c.startswith("take "):
            obj = c[5:].split(" from ")[0]
            self.contents[r].remove(obj)
            self.holding = obj
            return f"You pick up the {obj} from the {r}."
        if c.startswith("move "):
            obj = self.holding
            self.contents[r].append(obj)
            self.holding = ""
            return f"You move the {obj} to the {r}."
        for verb, done_set, past in (("clean", self.clean, "clean"), ("heat", self.hot, "heat"),
                                     ("cool", self.cool, "cool")):
            if c.startswith(verb + " "):
                done_set.add(self.holding)
                return f"You {past} the {self.holding} using the {r}."
        if c.startswith("use "):
            self.lamp_on = True
            return f"You turn on the {self.task.lamp}."
        if c.startswith("examine "):
            return ("On" if self.is_open[r] else "The") + (
                f" the {r}, you see {_see_list(self.contents[r])}." if self.is_open[r]
                else f" {r} is closed.")
        if c == "inventory":
            if self.holding:
                return f"You are carrying: a {self.holding}."
            return "You are not carrying anything."
        if c == "look":
            where = f"facing the {r}" if r else f"in the middle of a {ROOM_NAMES[self.task.room]}"
            return f"You are {where}. Next to it, you see nothing."
        raise AssertionError(f"admissible command without a rule: {c}")

    # ---- expert --------------------------------------------------------------------------------
    def expert_action(self) -> str:
        """The next command of a searching expert that uses only what the agent has seen.

        It takes the target object from the first place it was seen, else opens / visits the next
        unseen receptacle, in the room's listing order, of a kind where such objects usually lie
        (OBJECT_PLACES), then any other,
        processes it (sink / microwave / fridge / lamp) and puts it in the first receptacle of the
        goal type (for pick-two, the one that already holds the first).
        """
        t, here = self.task, self.location
        want = t.target_object
        if self.holding:
            if _kind(self.holding) != want:                 # drop a wrong object right here
                if here and self.is_open[here]:
                    return f"move {self.holding} to {here}"
                return self._explore()
            if t.task_type == "look_at_obj_in_light":
                spot = next((r for r in t.receptacles
                             if t.lamp in self.contents[r] and r in self.seen), "")
                if not spot:
                    return self._explore(lamp=True)
                return f"use {t.lamp}" if here == spot else f"go to {spot}"
            steps = {"pick_clean_then_place_in_recep": ("clean", "sinkbasin", self.clean),
                     "pick_heat_then_place_in_recep": ("heat", "microwave", self.hot),
                     "pick_cool_then_place_in_recep": ("cool", "fridge", self.cool)}
            step = steps.get(t.task_type)
            if step and self.holding not in step[2]:
                verb, kind, _ = step
                if _kind(here) == kind:
                    return f"{verb} {self.holding} with {here}"
                return "go to " + next(r for r in t.receptacles if _kind(r) == kind)
            dest = self._destination()
            if here != dest:
                return f"go to {dest}"
            return f"move {self.holding} to {here}" if self.is_open[here] else f"open {here}"
        # Hands empty: take a wanted object we know about, else search.
        known = [(r, o) for r in t.receptacles if r in self.seen and not self._already_placed(r)
                 for o in self.contents[r] if _kind(o) == want]
        if known:
            r, o = known[0]
            if here != r:
                return f"go to {r}"
            return f"take {o} from {r}" if self.is_open[r] else f"open {r}"
        return self._explore()

    def _destination(self) -> str:
        t = self.task
        spots = [r for r in t.receptacles if _kind(r) == t.target_receptacle]
        with_one = [r for r in spots if any(_kind(o) == t.target_object for o in self.contents[r])]
        return with_one[0] if t.task_type == "pick_two_obj_and_place" and with_one else spots[0]

    def _already_placed(self, r: str) -> bool:
        t = self.task
        return t.task_type == "pick_two_obj_and_place" and _kind(r) == t.target_receptacle

    def _explore(self, lamp: bool = False) -> str:
        t, here = self.task, self.location
        kinds = LAMP_PLACES[t.room] if lamp else OBJECT_PLACES[t.room][t.target_object]
        # Plausible receptacles first, each group in the order the room lists them.
        order = [r for r in t.receptacles if _kind(r) in kinds]
        order += [r for r in t.receptacles if r not in order]
        for r in order:
            if r in self.seen or (not lamp and self._already_placed(r)):
                continue
            if here == r:
                return f"open {r}"
            return f"go to {r}"
        if self.holding and here:  # everything seen, a wrong object in hand at a closed receptacle
            return f"open {here}"
        return "look"  # everything seen, hands empty: cannot happen for generated tasks


def steps_to_go(game: HouseholdEnv, cap: int = 60) -> int:
    """The oracle's distance: how many steps the expert takes from the game's current state to a
    win; 0 for a game already won, `cap` when the expert has not won within `cap` steps. The game
    is left exactly as it was (snapshot / restore; its step limit does not cut the expert short).

    The expert searches with what the agent has seen, so this is a consistent distance under
    that expert, not the shortest path. The progress of a step is steps_to_go before it minus
    steps_to_go after it: +1 for every expert step."""
    if game.won:
        return 0
    saved, max_steps = game.snapshot(), game.max_steps
    game.max_steps = game.steps + cap
    try:
        for taken in range(1, cap + 1):
            if game.step(game.expert_action())[3]["won"]:
                return taken
        return cap
    finally:
        game.restore(saved)
        game.max_steps = max_steps


def true_state(game: HouseholdEnv) -> str:
    """The game's true state as text (its step counter left out), the same in every process:
    sets are written sorted, since their order depends on the string hash seed."""
    snapshot = game.snapshot()
    snapshot.pop("steps")
    return repr([(name, sorted(value) if isinstance(value, set) else value)
                 for name, value in sorted(snapshot.items())])


# ---- task sets ----------------------------------------------------------------------------------
SPLITS = ("train", "valid", "test")
_FINGERPRINTS: dict[str, set] = {}


def _held_out_seeds(offset: int, n: int, exclude: set) -> list[int]:
    """The first n seeds from `offset` on whose task (layout and goal) is not in `exclude`."""
    seeds, s = [], offset
    while len(seeds) < n:
        if generate_task(s).fingerprint() not in exclude:
            seeds.append(s)
        s += 1
    return seeds


def _fingerprints(split: str) -> set:
    if split not in _FINGERPRINTS:
        _FINGERPRINTS[split] = {generate_task(s).fingerprint() for s in task_seeds(split)}
    return _FINGERPRINTS[split]


def task_seeds(split: str, num_tasks: int | None = None) -> list[int]:
    """Seeds of a split. Train seeds are 0..N-1. Test seeds start at TEST_SEED_OFFSET and skip any
    task whose full layout and goal also occur in train; valid seeds (for choosing
    hyperparameters, so that test stays untouched) start at VALID_SEED_OFFSET and skip any task of
    train or test. The three sets are disjoint."""
    sizes = {"train": NUM_TRAIN_TASKS, "valid": NUM_VALID_TASKS, "test": NUM_TEST_TASKS}
    if split not in sizes:
        raise ValueError(f"unknown household split {split!r}: expected one of {', '.join(SPLITS)}")
    n = num_tasks or sizes[split]
    if n > sizes[split]:
        raise ValueError(f"the household {split} split has {sizes[split]} tasks, not {n}")
    if split == "train":
        return list(range(n))
    if split == "test":
        return _held_out_seeds(TEST_SEED_OFFSET, n, _fingerprints("train"))
    return _held_out_seeds(VALID_SEED_OFFSET, n, _fingerprints("train") | _fingerprints("test"))


def vocabulary() -> list[str]:
    """Every word the household can print or accept, for building a word-level tokenizer."""
    words = set("you are in the middle of a looking quickly around see your task is to arrive at "
                "on it closed open close take from move use turn heat cool clean using with pick "
                "up nothing happens carrying not anything inventory look examine go facing next "
                "and put some two find them hot desklamp under".split())
    for room in ROOM_LAYOUTS:
        words |= set(ROOM_NAMES[room].split())
        words |= {k for k, _, _ in ROOM_LAYOUTS[room]}
        words |= set(OBJECT_PLACES[room])
    for tt in TASK_TYPES:
        for seed in range(4):  # enough draws to see both phrasings of each goal
            words |= set(re.findall(r"[a-z]+", _goal_sentence(tt, "x", "y", random.Random(seed))))
    words |= {str(i) for i in range(1, 10)}
    words.discard("x"), words.discard("y")
    return sorted(words)
