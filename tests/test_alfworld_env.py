"""The ALFWorld wrapper. The missing-data path is always tested; tests that need games skip with a
reason when $ALFWORLD_DATA holds none (fetch them with `alfworld-download`)."""

import gc
import os
import subprocess
import sys
import types

import pytest

import envs
from common import UsageError
from envs import alfworld_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_missing_data_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(UsageError) as err:
        envs.list_tasks("alfworld", "train")
    assert "alfworld-download" in str(err.value) and str(tmp_path) in str(err.value)
    # the offline way too: the README's commands for the set its ALFWorld numbers need
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = [line.lstrip("# ").strip() for line in f
                  if line.startswith("# python -m envs.alfworld_games")]
    assert len(readme) == 2
    for command in readme:
        assert command in str(err.value)


def test_script_exits_cleanly_without_data(tmp_path):
    env = dict(os.environ, ALFWORLD_DATA=str(tmp_path), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "proxmo.py", "--env", "alfworld",  # tiny-alfworld
                             "--run-dir", str(tmp_path / "runs")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "alfworld-download" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()  # a run stopped by bad input leaves no directory


def test_unknown_split_is_rejected():
    with pytest.raises(UsageError, match="unknown ALFWorld split"):
        alfworld_env.game_files("test")


def test_task_type_from_game_path():
    path = ("/d/json_2.1.1/valid_unseen/pick_cool_then_place_in_recep-Apple-None-Fridge-1/"
            "trial_T2019/game.tw-pddl")
    assert alfworld_env.task_type_of(path) == "pick_cool_then_place_in_recep"
    path = "/d/json_2.1.1/train/pick_and_place_simple-Mug-None-Desk-308/trial_T1/game.tw-pddl"
    assert alfworld_env.task_type_of(path) == "pick_and_place_simple"
    assert set(alfworld_env.TASK_TYPES) == set(envs.TASK_TYPES)


HEAT_GOAL = ("(:goal (and (exists (?r - receptacle) (exists (?o - object) (and (heatable ?o) "
             "(objectType ?o AppleType) (receptacleType ?r CounterTopType) (isHot ?o) "
             "(inReceptacle ?o ?r) ) ) ) ) ) )")
LOOK_GOAL = ("(:goal (and (exists (?ot - object ?r - receptacle ?a - agent ?l - location) (and "
             "(objectType ?ot DeskLampType) (toggleable ?ot) (isToggled ?ot) "
             "(receptacleAtLocation ?r ?l) (atLocation ?a ?l) (inReceptacle ?ot ?r) ) ) "
             "(exists (?o - object ?a - agent) (and (objectType ?o AlarmClockType) "
             "(holds ?a ?o) ) ) ) ) )")


def room(*extra):
    """A kitchen's facts: the agent at l0; a closed fridge at l1 with an apple in it, a microwave
    at l2, a countertop at l3 (which can hold apples and mugs) and a mug on it."""
    return [("atlocation", "agent1", "l0"),
            ("receptacleatlocation", "fridge", "l1"), ("receptacletype", "fridge", "fridgetype"),
            ("openable", "fridge"),
            ("receptacleatlocation", "oven", "l2"), ("receptacletype", "oven", "microwavetype"),
            ("receptacleatlocation", "top", "l3"), ("receptacletype", "top", "countertoptype"),
            ("cancontain", "countertoptype", "appletype"),
            ("cancontain", "countertoptype", "mugtype"),
            ("objecttype", "apple", "appletype"), ("pickupable", "apple"),
            ("inreceptacle", "apple", "fridge"),
            ("objecttype", "mug", "mugtype"), ("pickupable", "mug"),
            ("inreceptacle", "mug", "top"),
            *extra]


def test_the_alfworld_distance_counts_the_fewest_commands_by_hand():
    """alfworld_env.plan_length, worked by hand on room()'s kitchen: heat the apple and put it on
    the countertop."""
    goal = alfworld_env.goal_types(HEAT_GOAL)
    assert goal == {"object": "appletype", "receptacle": "countertoptype", "lamp": None,
                    "change": "heat", "two": False}
    # go to the fridge, open it, take the apple, go to the microwave, heat, go to the top, put
    assert alfworld_env.plan_length(room(), goal) == 7
    assert alfworld_env.plan_length(room(("opened", "fridge")), goal) == 6
    there = [f for f in room(("opened", "fridge")) if f[0] != "atlocation"]
    assert alfworld_env.plan_length(there + [("atlocation", "agent1", "l1")], goal) == 5
    # the apple already hot and in hand at the countertop: put it down
    hot = [f for f in room(("ishot", "apple"), ("holds", "agent1", "apple"),
                           ("atlocation", "agent1", "l3")) if f != ("atlocation", "agent1", "l0")]
    assert alfworld_env.plan_length([f for f in hot if f[0] != "inreceptacle" or f[1] != "apple"],
                                    goal) == 1
    # the mug in hand at the open fridge, which cannot hold mugs: it goes to the countertop
    # first (go, put), then go back, take the apple, go, heat, go, put: 8; a fridge that holds
    # mugs takes it at once: 6
    holding = there + [("atlocation", "agent1", "l1"), ("holds", "agent1", "mug")]
    holding = [f for f in holding if f != ("inreceptacle", "mug", "top")]
    assert alfworld_env.plan_length(holding, goal) == 8
    assert alfworld_env.plan_length(holding + [("cancontain", "fridgetype", "mugtype")], goal) == 6
    # no apple at all: the cap
    assert alfworld_env.plan_length([f for f in room() if "apple" not in f], goal, cap=60) == 60


def test_the_alfworld_distance_of_a_lamp_and_of_two_objects_by_hand():
    goal = alfworld_env.goal_types(LOOK_GOAL)
    assert goal == {"object": "alarmclocktype", "receptacle": None, "lamp": "desklamptype",
                    "change": None, "two": False}
    lamp = [("atlocation", "agent1", "l0"),
            ("receptacleatlocation", "desk", "l1"), ("receptacletype", "desk", "desktype"),
            ("receptacleatlocation", "side", "l2"), ("receptacletype", "side", "sidetabletype"),
            ("objecttype", "clock", "alarmclocktype"), ("pickupable", "clock"),
            ("inreceptacle", "clock", "desk"),
            ("objecttype", "lamp", "desklamptype"), ("inreceptacle", "lamp", "side")]
    assert alfworld_env.plan_length(lamp, goal) == 4  # go, take, go to the lamp, switch it on
    assert alfworld_env.plan_length(lamp + [("istoggled", "lamp")], goal) == 3
    beside = [f for f in lamp if f != ("inreceptacle", "lamp", "side")]
    assert alfworld_env.plan_length(beside + [("inreceptacle", "lamp", "desk")], goal) == 3
    two = {"object": "pentype", "receptacle": "shelftype", "lamp": None, "change": None,
           "two": True}
    pens = [("atlocation", "agent1", "l0"),
            ("receptacleatlocation", "drawer", "l1"), ("receptacletype", "drawer", "drawertype"),
            ("openable", "drawer"),
            ("receptacleatlocation", "desk", "l2"), ("receptacletype", "desk", "desktype"),
            ("receptacleatlocation", "shelf", "l3"), ("receptacletype", "shelf", "shelftype"),
            ("objecttype", "pen1", "pentype"), ("pickupable", "pen1"),
            ("inreceptacle", "pen1", "drawer"),
            ("objecttype", "pen2", "pentype"), ("pickupable", "pen2"),
            ("inreceptacle", "pen2", "desk")]
    # pen1: go, open, take, go, put (5); pen2: go, take, go, put (4)
    assert alfworld_env.plan_length(pens, two) == 9
    placed = [f for f in pens if f != ("inreceptacle", "pen2", "desk")]
    assert alfworld_env.plan_length(placed + [("inreceptacle", "pen2", "shelf")], two) == 5
    assert alfworld_env.plan_length(placed + [("inreceptacle", "pen2", "shelf"),
                                              ("inreceptacle", "pen1", "shelf")], two) == 0


def test_the_alfworld_distance_opens_a_receptacle_once():
    """What a plan opened stays open: it is not opened (counted) again on the way back."""
    pens = [("atlocation", "agent1", "l0"),
            ("receptacleatlocation", "drawer", "l1"), ("receptacletype", "drawer", "drawertype"),
            ("openable", "drawer"),
            ("receptacleatlocation", "shelf", "l3"), ("receptacletype", "shelf", "shelftype"),
            ("objecttype", "pen1", "pentype"), ("pickupable", "pen1"),
            ("inreceptacle", "pen1", "drawer"),
            ("objecttype", "pen2", "pentype"), ("pickupable", "pen2"),
            ("inreceptacle", "pen2", "drawer")]
    two = {"object": "pentype", "receptacle": "shelftype", "lamp": None, "change": None,
           "two": True}
    # both pens in one closed drawer: go, open, take, go, put, go, take, go, put
    assert alfworld_env.plan_length(pens, two) == 9
    # the pen to go into a drawer, cooled first: go, open, take, go to the fridge, cool, go
    # back, put (the drawer is still open)
    cool = {"object": "pentype", "receptacle": "drawertype", "lamp": None, "change": "cool",
            "two": False}
    fridge = [("receptacleatlocation", "fridge", "l2"),
              ("receptacletype", "fridge", "fridgetype")]
    assert alfworld_env.plan_length(pens + fridge, cool) == 7
    # at the closed target drawer with a pencil in hand, the pen in a closed cabinet that cannot
    # hold pencils: open the drawer, put the pencil in, go, open the cabinet, take, go, put
    one = {**cool, "change": None}
    holding = [("atlocation", "agent1", "l1"), ("holds", "agent1", "pencil"),
               ("objecttype", "pencil", "penciltype"),
               ("cancontain", "drawertype", "penciltype"),
               ("receptacleatlocation", "drawer", "l1"),
               ("receptacletype", "drawer", "drawertype"), ("openable", "drawer"),
               ("receptacleatlocation", "cabinet", "l2"),
               ("receptacletype", "cabinet", "cabinettype"), ("openable", "cabinet"),
               ("objecttype", "pen", "pentype"), ("pickupable", "pen"),
               ("inreceptacle", "pen", "cabinet")]
    assert alfworld_env.plan_length(holding, one) == 7


def test_expert_sees_move_as_put():
    assert alfworld_env.expert_view("move mug 1 to desk 2") == "put mug 1 in/on desk 2"
    assert alfworld_env.expert_view("take mug 1 from desk 2") == "take mug 1 from desk 2"
    assert alfworld_env.expert_view("go to desk 2") == "go to desk 2"


def test_pick_two_expert_empties_its_inventory_after_a_move():
    """alfworld 0.4.2's hand-coded expert updates its inventory on "put" only; the grammar's
    command is "move X to Y". Stock, it still holds the first object after placing it (and loops
    in pick-two games); told the command through expert_view, its hands are empty."""
    from alfworld.agents.expert.handcoded_expert_tw import PickTwoObjAndPlaceTWPolicy

    params = {"object_target": "mug", "parent_target": "desk", "toggle_target": "",
              "mrecep_target": "", "object_sliced": False, "task_type": "pick_two_obj_and_place"}
    inventories = {}
    for name, view in (("stock", lambda c: c), ("fixed", alfworld_env.expert_view)):
        expert = PickTwoObjAndPlaceTWPolicy(params, max_steps=200)
        expert.update_state_tracking({"feedback": "You pick up the mug 1 from the shelf 1."},
                                     view("take mug 1 from shelf 1"))
        assert expert.inventory == ["mug 1"]
        expert.update_state_tracking({"feedback": "You move the mug 1 to the desk 1."},
                                     view("move mug 1 to desk 1"))
        inventories[name] = expert.inventory
    assert inventories == {"stock": ["mug 1"], "fixed": []}


def test_games_without_expert_do_not_compute_it(monkeypatch):
    """The expert (and the engine facts it needs) runs only in games made with expert=True."""
    captured = {}

    def fake_start(path, infos, wrappers):
        captured["facts"] = infos.facts
        raise RuntimeError("stop here")

    import textworld
    monkeypatch.setattr(textworld, "start", fake_start)
    path = "/d/json_2.1.1/train/pick_two_obj_and_place-Mug-None-Desk-1/trial_T1/game.tw-pddl"
    for expert in (False, True):
        with pytest.raises(RuntimeError, match="stop here"):
            envs.make_game("alfworld", path, max_steps=5, expert=expert)
        assert captured["facts"] is expert


def _games_or_skip(split):
    try:
        return alfworld_env.game_files(split)
    except UsageError:
        pytest.skip(f"no ALFWorld games under $ALFWORLD_DATA ({alfworld_env.data_root()}); "
                    "run alfworld-download")


def test_expert_solves_a_game_and_invalid_commands_are_flagged():
    game_file = _games_or_skip("valid_seen")[0]
    game = alfworld_env.AlfworldEnv(game_file, max_steps=50, expert=True)
    obs = game.reset()
    assert obs.startswith("You are in the middle of a room") and game.task_description
    obs, reward, done, info = game.step("fly to the moon")
    assert info["valid"] is False and reward == 0.0 and "Nothing happens" in obs
    while not done:
        obs, reward, done, info = game.step(game.expert_action())
    assert info["won"] and reward == 1.0


def test_restore_replays_the_commands_from_a_reset(monkeypatch):
    """ALFWorld's engine cannot copy a game: restore() resets and replays the snapshot's
    commands (a stand-in engine here, whose state is the commands it has seen)."""
    class State(dict):
        @property
        def feedback(self):
            return self["feedback"]

    class FakeEngine:
        resets = 0
        unwrapped = types.SimpleNamespace(downward_lib="a copy of Fast Downward")

        def reset(self):
            FakeEngine.resets += 1
            self.played = []
            return self._state()

        def step(self, command):
            self.played.append(command)
            return self._state(), 0, False

        def _state(self):
            text = "You are in the middle of a room. Your task is to: do a then b" if not (
                self.played) else "after " + ",".join(self.played)
            return State(feedback=text, won=self.played == ["a", "b"],
                         admissible_commands=["a", "b", "help"])

    import textworld
    monkeypatch.setattr(textworld, "start", lambda path, infos, wrappers: FakeEngine())
    path = "/d/json_2.1.1/train/pick_and_place_simple-Mug-None-Desk-1/trial_T1/game.tw-pddl"
    game = envs.make_game("alfworld", path, max_steps=5)
    game.reset()
    game.step("a")
    saved = game.snapshot()
    assert saved == ("a",)
    assert game.step("a")[0] == "after a,a"
    game.restore(saved)
    assert game.steps == 1 and FakeEngine.resets == 2 and game.admissible_actions() == ["a", "b"]
    obs, reward, done, info = game.step("b")
    assert (obs, reward, done, info["won"]) == ("after a,b", 1.0, True, True)
    del game  # its (stand-in) library goes to the free list: take it out again
    gc.collect()
    alfworld_env._FREE_LIBRARIES.remove("a copy of Fast Downward")


def test_the_household_path_imports_no_alfworld_dependency():
    """alfworld's heavy dependencies (TextWorld, Fast Downward, jericho, TatSu) load only for
    --env alfworld: importing every script and playing a household game never imports them."""
    code = ("import sys, envs, proxmo, spa, istar, hisr, sspo; "
            "game = envs.make_game('household', envs.list_tasks('household', 'train', 1)[0], 3); "
            "game.reset(); game.step('look'); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'textworld', 'alfworld', "
            "'jericho', 'fast_downward', 'tatsu'}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
