"""Games generated from the alfworld wheel's files (envs/alfworld_games.py), played on the real
engine: TextWorld's PDDL environment with ALFWorld's domain, grammar and hand-coded expert. The
session fixture generates one game per task type for train and two for valid_unseen (about
15 s)."""

import glob
import json
import os
import random
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # also when run as a script, to record
from envs import alfworld_env, alfworld_games  # noqa: E402

TINY_ALFWORLD_RECORD = os.path.join(ROOT, "assets", "tiny-alfworld", "greedy_check.json")
SEED = 3
UNSEEN_TYPES = ("look_at_obj_in_light", "pick_two_obj_and_place")


def make_games(root: str) -> str:
    made = alfworld_games.generate(root, per_type=1, seed=SEED, splits=("train",))
    made.update(alfworld_games.generate(root, per_type=1, seed=SEED, splits=("valid_unseen",),
                                        task_types=UNSEEN_TYPES))
    assert all(len(files) == 1 for files in made.values()), made
    return root


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    return make_games(str(tmp_path_factory.mktemp("alfworld_data")))


def games(root, split):
    """The whole games of a split (not a folder still being written)."""
    return sorted(g for g in glob.glob(os.path.join(root, "json_2.1.1", split, "*", "*",
                                                    "game.tw-pddl"))
                  if not os.path.dirname(g).endswith(alfworld_games.PARTIAL))


def test_pure_helpers_by_hand():
    assert alfworld_games.mangle("Sink|-01.90|+00.97|-01.50|SinkBasin") == (
        "Sink_bar__minus_01_dot_90_bar__plus_00_dot_97_bar__minus_01_dot_50_bar_SinkBasin")
    assert alfworld_games.receptacle_kind("Sink|-01.90|+00.97|-01.50|SinkBasin") == "SinkBasin"
    assert alfworld_games.receptacle_kind("Cabinet|+00.68|+00.50|-02.20") == "Cabinet"
    # metres / 0.25 and degrees / 90, as ALFRED's grid locations
    assert alfworld_games.location([0.5, -1.75, 180, -30]) == "loc|2|-7|2|-30"
    assert 10 in alfworld_games.scene_numbers("train")
    assert alfworld_games.scene_numbers("valid_unseen") == [
        *range(1, 7), *range(201, 207), *range(301, 307), *range(401, 407)]
    assert not set(alfworld_games.scene_numbers("train")) & set(
        alfworld_games.scene_numbers("valid_unseen"))


def test_sampled_goals_are_plausible_and_not_already_true():
    """Over many draws (no engine): the object may go in the target, has the affordance the task
    needs, the target is not the appliance, and no target object starts in a target receptacle."""
    from alfworld.gen import constants

    layouts = alfworld_games.wheel_paths()["layouts"]
    rng = random.Random(0)
    seen = set()
    for scene_number in (1, 11, 205, 301, 311, 401, 411):
        scene = alfworld_games.load_scene(scene_number, layouts)
        for task_type in alfworld_games.TASK_TYPES:
            for _ in range(5):
                params = alfworld_games.sample_goal(task_type, scene, rng)
                if params is None:
                    continue
                seen.add(task_type)
                obj, recep = params["object_target"], params["parent_target"]
                placed = alfworld_games.place_objects(scene, params, task_type, rng)
                for _, kind, r in placed:
                    if kind != "DeskLamp":
                        assert kind in constants.VAL_RECEPTACLE_OBJECTS[
                            alfworld_games.receptacle_kind(r)]
                targets = [r for _, kind, r in placed if kind == obj]
                assert len(targets) >= (2 if task_type == "pick_two_obj_and_place" else 1)
                if task_type == "look_at_obj_in_light":
                    assert params["toggle_target"] == "DeskLamp" and recep == ""
                    lamps = [r for _, kind, r in placed if kind == "DeskLamp"]
                    assert len(lamps) == 1
                    assert alfworld_games.receptacle_kind(lamps[0]) in ("Desk", "SideTable",
                                                                        "Dresser")
                    continue
                assert obj in constants.VAL_RECEPTACLE_OBJECTS[recep]
                assert recep not in alfworld_games.INVALID_TARGETS.get(task_type, ())
                if task_type in alfworld_games.PICKUP_AFFORDANCE:
                    affordance = alfworld_games.PICKUP_AFFORDANCE[task_type]
                    assert obj in constants.VAL_ACTION_OBJECTS[affordance]
                assert all(alfworld_games.receptacle_kind(r) != recep for r in targets)
    assert seen == set(alfworld_games.TASK_TYPES)


def test_layout_is_what_alfworlds_own_loader_expects(data_root):
    """alfworld's AlfredTWEnv, configured as its base config does ($ALFWORLD_DATA/json_2.1.1/...),
    finds every generated game of both splits, and our loader finds the same files."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    config = {"env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
              "dataset": {"data_path": os.path.join(data_root, "json_2.1.1", "train"),
                          "eval_ood_data_path": os.path.join(data_root, "json_2.1.1",
                                                             "valid_unseen"),
                          "num_train_games": -1, "num_eval_games": -1}}
    for split, mode in (("train", "train"), ("valid_unseen", "eval_out_of_distribution")):
        found = AlfredTWEnv(config, train_eval=mode).game_files
        assert sorted(found) == games(data_root, split)
        assert len(found) == (6 if split == "train" else len(UNSEEN_TYPES))


def test_game_files_and_task_types(data_root, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", data_root)
    assert alfworld_env.game_files("train") == games(data_root, "train")
    types = set()
    for game_file in games(data_root, "train") + games(data_root, "valid_unseen"):
        with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
            traj = json.load(f)
        with open(game_file) as f:
            game = json.load(f)
        assert alfworld_env.task_type_of(game_file) == traj["task_type"]
        assert game["solvable"] is True and len(game["walkthrough"]) >= 2
        assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
        scene = traj["scene"]["scene_num"]
        assert (scene in alfworld_games.scene_numbers("valid_unseen")) == (
            "valid_unseen" in game_file)
        types.add(traj["task_type"])
    assert types == set(alfworld_games.TASK_TYPES)


def play_experts(files: list[str], workers: int) -> list:
    """alfworld's hand-coded expert, live on the engine, in every game at once (EnvBatch)."""
    import envs
    from common.envbatch import EnvBatch

    seeds = []
    for game_file in files:  # the seed the generator verified the game with
        with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
            seeds.append(json.load(f)["expert_seed"])
    games = [envs.make_game("alfworld", f, 50, expert=True, workers=workers, seed=seed)
             for f, seed in zip(files, seeds)]
    batch = EnvBatch(games)
    log = [batch.reset(), [g.won for g in games]]
    while batch.active():
        results = batch.step({i: games[i].expert_action() for i in batch.active()})
        log.append(sorted((i, r, games[i].admissible_actions()) for i, r in results.items()))
    return log + [batch.won]


def test_expert_wins_every_train_game_in_workers_as_in_this_process(data_root):
    """The expert (live, not the stored walkthrough), with the seed the generator kept the game
    for, wins every type's game; no goal holds at the start; two worker processes play exactly
    as this process does."""
    files = games(data_root, "train")
    local = play_experts(files, workers=0)
    assert local[1] == [False] * 6 and local[-1] == [True] * 6
    assert play_experts(files, workers=2) == local


def test_proxmo_runs_on_generated_games(data_root, tmp_path):
    """BC on expert demonstrations, an RL iteration and evaluations, tiny-scratch on the real
    engine, its games stepped in two worker processes."""
    env = dict(os.environ, ALFWORLD_DATA=data_root, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "proxmo.py", "--env", "alfworld", "--model", "tiny-scratch",
         "--env-workers", "2", "--bc-num-tasks", "2", "--bc-epochs", "1",
         "--tasks-per-iteration", "1", "--group-size", "2", "--max-episode-steps", "4",
         "--eval-splits", "valid_unseen", "--eval-num-tasks", "1", "--iterations", "1",
         "--run-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "behavior cloning: 2 expert trajectories" in result.stdout
    assert "[eval valid_unseen @ iter 1]" in result.stdout and "rl 1/1" in result.stdout
    (run_path,) = glob.glob(str(tmp_path / "proxmo__alfworld__proxmo__1__*"))
    with open(os.path.join(run_path, "summary.json")) as f:
        summary = json.load(f)
    assert sorted(summary["evaluations"]) == ["0", "1"]
    with open(os.path.join(run_path, "config.json")) as f:
        assert json.load(f)["args"]["env_workers"] == 2


def test_an_evaluation_alone_needs_no_train_split(data_root, tmp_path):
    """--iterations 0 evaluates the start on a set without train games; SPA, whose progress
    estimator is trained on rollouts of training games, says so in one line."""
    import shutil

    only_unseen = tmp_path / "data"
    shutil.copytree(os.path.join(data_root, "json_2.1.1", "valid_unseen"),
                    only_unseen / "json_2.1.1" / "valid_unseen")
    env = dict(os.environ, ALFWORLD_DATA=str(only_unseen), HF_HUB_OFFLINE="1")
    common = ["--env", "alfworld", "--iterations", "0", "--eval-num-tasks", "1",
              "--max-episode-steps", "3", "--run-dir", str(tmp_path / "runs")]
    result = subprocess.run([sys.executable, "proxmo.py", *common], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "[eval valid_unseen @ iter 0]" in result.stdout
    result = subprocess.run([sys.executable, "spa.py", *common], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "SPA explores training tasks" in result.stderr


def test_a_resume_on_another_game_set_is_refused(data_root, tmp_path):
    """config.json keeps the games' identity (per split: how many, a digest of their paths);
    --resume with ALFWORLD_DATA naming another set (one train game fewer) says so, exit 2."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(data_root, other)
    shutil.rmtree(os.path.dirname(games(str(other), "train")[0]))
    flags = ["--env", "alfworld", "--tasks-per-iteration", "1", "--group-size", "2",
             "--max-episode-steps", "3", "--eval-num-tasks", "1", "--run-dir", str(tmp_path)]
    env = dict(os.environ, ALFWORLD_DATA=data_root, HF_HUB_OFFLINE="1")
    first = subprocess.run([sys.executable, "proxmo.py", *flags, "--iterations", "1"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    (run_path,) = glob.glob(str(tmp_path / "proxmo__alfworld__*"))
    with open(os.path.join(run_path, "config.json")) as f:
        saved = json.load(f)["task_set"]
    assert saved["splits"]["train"]["games"] == 6 and saved["alfworld_data"] == data_root
    env["ALFWORLD_DATA"] = str(other)
    resumed = subprocess.run([sys.executable, "proxmo.py", "--resume", run_path, "--iterations",
                              "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr
    assert "its games are not the ones it began on (train: 6 games then, 5 now)" in resumed.stderr
    env["ALFWORLD_DATA"] = data_root
    more = subprocess.run([sys.executable, "proxmo.py", "--env", "alfworld", "--eval-num-tasks",
                           "100", "--run-dir", str(tmp_path / "more")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert more.returncode == 2 and "100 valid_unseen tasks asked for" in more.stderr
    assert "the split has 2 games" in more.stderr


def test_walkthroughs_win_and_the_tiny_vocabulary_covers_every_text(data_root):
    """Replaying each stored walkthrough wins; `help` is never admissible; every observation and
    admissible command is spelled in words of envs.vocabulary("alfworld")."""
    import re

    import envs

    vocabulary = set(envs.vocabulary("alfworld")) | {str(i) for i in range(100)}
    for game_file in games(data_root, "valid_unseen"):
        with open(game_file) as f:
            walkthrough = json.load(f)["walkthrough"]
        game = alfworld_env.AlfworldEnv(game_file, max_steps=50)
        texts = [game.reset()]
        for command in walkthrough:
            assert "help" not in game.admissible_actions()
            texts += game.admissible_actions()
            obs, reward, done, info = game.step(command)
            texts.append(obs)
        assert info["won"] and done and reward == 1.0
        words = set(re.findall(r"[a-z]+|\d+", " ".join(texts).lower()))
        assert words <= vocabulary, words - vocabulary


def test_inadmissible_command_changes_nothing(data_root):
    game_file = games(data_root, "train")[0]
    with open(game_file) as f:
        walkthrough = json.load(f)["walkthrough"]
    game = alfworld_env.AlfworldEnv(game_file, max_steps=50)
    game.reset()
    game.step(walkthrough[0])
    before = (game.admissible_actions(), sorted(map(str, game._state["_facts"])))
    obs, reward, done, info = game.step("take the moon from the sky")
    assert obs == "Nothing happens." and not info["valid"] and reward == 0.0 and not done
    after = (game.admissible_actions(), sorted(map(str, game._state["_facts"])))
    assert after == before
    for command in walkthrough[1:]:
        obs, reward, done, info = game.step(command)
    assert info["won"]


def test_generator_is_deterministic(data_root, tmp_path):
    """The same (seed, split, type, draw) writes the same bytes, in another process with another
    string-hash seed."""
    (first,) = glob.glob(os.path.join(data_root, "json_2.1.1", "train",
                                      "pick_heat_then_place_in_recep-*", "*", "game.tw-pddl"))
    draw = int(os.path.basename(os.path.dirname(first)).rsplit("_", 1)[1])
    code = ("import sys; from envs import alfworld_games as g; print(g.make_game(sys.argv[1], "
            "'train', 'pick_heat_then_place_in_recep', int(sys.argv[2]), int(sys.argv[3]), "
            "g.wheel_paths()))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(draw), str(SEED)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    again = result.stdout.strip().splitlines()[-1]
    assert os.path.relpath(again, tmp_path) == os.path.relpath(first, data_root)
    for name in ("game.tw-pddl", "traj_data.json", "initial_state.pddl"):
        with open(os.path.join(os.path.dirname(first), name), "rb") as f:
            expected = f.read()
        with open(os.path.join(os.path.dirname(again), name), "rb") as f:
            assert f.read() == expected, name


def play_texts(game_file: str, walkthrough: list[str]) -> list:
    """Observations and admissible commands along a walkthrough, on TextWorld as alfworld's
    AlfredTWEnv starts it (no wrapper of ours)."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    argv = list(sys.argv)  # Fast Downward's translator overwrites it
    infos = textworld.EnvInfos(won=True, admissible_commands=True)
    env = textworld.start(game_file, infos, wrappers=[AlfredDemangler(), AlfredInfos])
    state = env.reset()
    texts = [state.feedback, state["admissible_commands"]]
    for command in walkthrough:
        state, _, _ = env.step(command)
        texts += [state.feedback, state["admissible_commands"]]
    sys.argv[:] = argv
    return texts


def test_memoized_engine_gives_its_own_text(data_root):
    """With the caches and the grammar's lighter context copies, observations and admissible
    commands equal those of TextWorld unpatched (played in a fresh process that never calls
    memoize_engine), on the walkthrough after a look, the inventory and a command the game
    does not know."""
    game_file = games(data_root, "train")[-1]
    with open(game_file) as f:
        walkthrough = ["look", "inventory", "take nothing from nowhere",
                       *json.load(f)["walkthrough"]]
    code = ("import json, sys; sys.path.insert(0, 'tests'); import test_alfworld_games as t; "
            "print(json.dumps(t.play_texts(sys.argv[1], json.loads(sys.argv[2]))))")
    plain = subprocess.run([sys.executable, "-c", code, game_file, json.dumps(walkthrough)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr[-2000:]
    alfworld_env.memoize_engine()
    memoized = play_texts(game_file, walkthrough)
    assert memoized == json.loads(plain.stdout)
    assert len(memoized) == 2 * (len(walkthrough) + 1) and memoized[-2].startswith("You ")
    # the engine offers "help" at every step; the wrapper never does (the walkthrough test)
    assert all("help" in admissible for admissible in memoized[1::2])


def test_translations_are_kept_on_disk_beside_the_game_set(tmp_path, monkeypatch):
    """A translation made once is read back by a later process (a new cache: the function is not
    called again); a damaged file is made and written again; a game set where nothing can be
    written keeps translations in memory only."""
    calls = []

    def translate(domain, problem, verbose=False, optimize=False):
        calls.append((domain, problem, optimize))
        return {"sas": f"{domain}|{problem}|{optimize}"}

    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    first = alfworld_env._memoized(translate, kept=4, on_disk=True)
    assert first("d", "p", optimize=True) == {"sas": "d|p|True"}
    (kept,) = glob.glob(str(tmp_path / "translations" / "*" / "*.pickle.z"))
    later = alfworld_env._memoized(translate, kept=4, on_disk=True)  # another process's cache
    assert later("d", "p", optimize=True) == {"sas": "d|p|True"} and len(calls) == 1
    with open(kept, "r+b") as f:
        f.truncate(10)
    again = alfworld_env._memoized(translate, kept=4, on_disk=True)
    assert again("d", "p", optimize=True) == {"sas": "d|p|True"} and len(calls) == 2
    assert alfworld_env._memoized(translate, on_disk=True)("d", "p", optimize=True) == {
        "sas": "d|p|True"} and len(calls) == 2  # the file written again is whole
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "a-file"))
    assert alfworld_env._memoized(translate, on_disk=True)("d", "q") == {"sas": "d|q|False"}
    assert len(calls) == 3 and not glob.glob(str(tmp_path / "**" / "*.partial"), recursive=True)


def test_loading_a_game_keeps_sys_argv(data_root):
    argv = list(sys.argv)
    game = alfworld_env.AlfworldEnv(games(data_root, "train")[0], max_steps=5)
    game.reset()
    assert sys.argv == argv


def test_generator_cli_refuses_bad_input(data_root, tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    for argv, message in ((["--out", data_root, "--per-type", "0"], "--per-type must be >= 1"),
                          (["--out", data_root, "--seed", "-1"], "--seed must be in"),
                          (["--out", data_root, "--workers", "0"], "--workers must be >= 1"),
                          (["--out", data_root, "--demonstrations", "--max-episode-steps", "0"],
                           "--max-episode-steps and --workers must be >= 1"),
                          (["--out", str(blocked / "data")], "cannot write there")):
        with pytest.raises(SystemExit) as exit_:
            alfworld_games.main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_an_interrupted_generation_goes_on_to_the_same_games(tmp_path):
    """A set made in one go, and one made in two with what a kill leaves between (a .partial
    folder, and a game folder of an older version without its walkthrough): the same games, byte
    for byte, on one worker or two."""
    kinds = ("pick_and_place_simple", "look_at_obj_in_light")
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    alfworld_games.generate(whole, 2, SEED, ("valid_unseen",), kinds, workers=1)
    first = alfworld_games.generate(cut, 1, SEED, ("valid_unseen",), kinds, workers=2)
    game_dir = os.path.dirname(first[("valid_unseen", kinds[0])][0])
    os.makedirs(game_dir[:-1] + "7" + alfworld_games.PARTIAL)  # killed while writing draw 7
    stale = os.path.join(os.path.dirname(game_dir), "trial_T3_00009")  # no walkthrough
    os.makedirs(stale)
    with open(os.path.join(stale, "game.tw-pddl"), "w") as f:
        json.dump({"walkthrough": None}, f)
    alfworld_games.generate(cut, 2, SEED, ("valid_unseen",), kinds, workers=2)

    def contents(root):
        found = {}
        for path in sorted(glob.glob(os.path.join(root, "json_2.1.1", "*", "*", "*", "*"))):
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
        return found

    made = contents(whole)
    assert len(made) == 2 * 2 * 3 and contents(cut) == made


def test_speed_benchmark_at_a_tiny_size(data_root, monkeypatch, capsys):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import alfworld_speed

    monkeypatch.setenv("ALFWORLD_DATA", data_root)
    assert alfworld_speed.main(["--split", "valid_unseen", "--games", "3", "--single", "1"]) == 0
    out = capsys.readouterr().out
    steps = sum(len(alfworld_speed.walkthrough(f)) for f in games(data_root, "valid_unseen"))
    first = len(alfworld_speed.walkthrough(games(data_root, "valid_unseen")[0]))
    # three games cycle over the split's two: the first plays twice
    assert "batch of 3 games, workers 0: made and reset in" in out
    assert f", {steps + first} steps in " in out and "one game (1 games, engine cache on)" in out


def test_the_generator_ends_with_the_line_to_type(tmp_path, monkeypatch, capsys):
    """Its last line is the export that makes the scripts find the games: the data root given
    to --out, not its json_2.1.1 folder."""
    monkeypatch.setattr(alfworld_games, "generate",
                        lambda out, per_type, *rest: {("train", "pick"): ["g"] * per_type})
    assert alfworld_games.main(["--out", str(tmp_path / "data"), "--per-type", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"  export ALFWORLD_DATA={tmp_path / 'data'}"


def test_demonstrations_are_played_once_and_played_back_as_the_engine_plays(data_root, tmp_path,
                                                                            capsys):
    """--demonstrations plays the noisy expert once per train game and keeps it beside the game;
    make_game(expert=True) then plays it back without the engine: the same observations and
    admissible commands as the engine gives for the recorded commands, the recorded labels; a
    shorter step limit is the recording cut, a longer one the live engine."""
    import shutil

    import envs
    from common import UsageError

    out = str(tmp_path / "data")
    shutil.copytree(os.path.join(data_root, "json_2.1.1", "train"),
                    os.path.join(out, "json_2.1.1", "train"))
    argv = ["--out", out, "--seed", str(SEED), "--demonstrations", "--bc-noise", "0.5",
            "--max-episode-steps", "12", "--workers", "2"]
    assert alfworld_games.main(argv) == 0
    assert ("0 of 6 games already recorded; the expert plays the other 6 (0 of them recorded"
            in capsys.readouterr().out)
    files = games(out, "train")
    first = os.path.join(os.path.dirname(files[0]), "demonstration.json")
    with open(first, "rb") as f:
        recorded = f.read()
    os.remove(first)  # one game lost: only it is played again, to the same bytes
    assert alfworld_games.main(argv) == 0
    assert "5 of 6 games already recorded; the expert plays the other 1" in capsys.readouterr().out
    with open(first, "rb") as f:
        assert f.read() == recorded
    mistakes = 0
    for limit in (12, 5):
        for game_file in files:
            game = envs.make_game("alfworld", game_file, limit, expert=True, workers=2)
            assert isinstance(game, alfworld_env.RecordedGame)
            engine = alfworld_env.AlfworldEnv(game_file, max_steps=limit)
            assert game.reset() == engine.reset() and game.task_description
            done = False
            while not done:
                assert game.admissible_actions() == engine.admissible_actions()
                label, command = envs.noisy_expert(game, [], 0.5, random.Random(0))
                assert label is not None
                mistakes += label != command
                answer = game.step(command.upper())  # any case, as the engine
                assert answer == engine.step(command)
                done = answer[2]
            assert (game.won, game.steps) == (engine.won, engine.steps)
            with pytest.raises(RuntimeError, match="finished game"):
                game.step(command)
    assert mistakes > 0  # at noise 0.5 some recorded commands are not the expert's
    with pytest.raises(UsageError, match="played with --bc-noise 0.5, not 0.2"):
        envs.noisy_expert(envs.make_game("alfworld", files[0], 12, expert=True), [], 0.2,
                          random.Random(0))
    assert isinstance(envs.make_game("alfworld", files[0], 13, expert=True),
                      alfworld_env.AlfworldEnv)
    with open(first, "w") as f:
        f.write("{")
    with pytest.raises(UsageError, match="damaged"):
        envs.make_game("alfworld", files[0], 12, expert=True)
    with pytest.raises(SystemExit):
        alfworld_games.main(["--out", out, "--bc-noise", "0.1"])  # only with --demonstrations
    assert "--bc-noise is for --demonstrations" in capsys.readouterr().err


def test_the_start_rule_keeps_the_cheaper_candidate_unless_the_costlier_wins_by_two_se(
        monkeypatch):
    """benchmarks/alfworld_start.py's table, on hand-made records of 4 games: b wins 3 more
    games than a (differences 1, 1, 1, 0: mean 0.75, sample SD 0.5, SE 0.25: 3 SE), so b is
    chosen; c wins the same games as b (+0 +- 0): a tie keeps the cheaper b."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import alfworld_start

    def record(flags, wins):
        outcomes = [[game, won, 10] for game, won in enumerate(wins)]
        return {"flags": flags, "minutes": 1.0,
                "evaluation": {"eval_valid_seen/success": sum(wins) / 4,
                               "eval_valid_seen/grounding": 0.5,
                               "eval_valid_seen/episode_length": 10.0,
                               "eval_valid_seen/outcomes": outcomes}}

    text, chosen = alfworld_start.table({"a": record(["--a"], [0, 0, 0, 1]),
                                 "b": record(["--b"], [1, 1, 1, 1]),
                                 "c": record(["--c"], [1, 1, 1, 1])})
    assert "| a | --a | 0.250 (1/4) | 0.500 | 10.0 | 1.0 |  | chosen (the first) |" in text
    assert "| b | --b | 1.000 (4/4) | 0.500 | 10.0 | 1.0 | +0.750 +- 0.250 vs a | chosen |" in text
    assert ("| c | --c | 1.000 (4/4) | 0.500 | 10.0 | 1.0 | +0.000 +- 0.000 vs b | b stays |"
            in text)
    assert chosen == "b"


def test_a_start_candidate_runs_once_and_is_recorded(data_root, tmp_path, monkeypatch, capsys):
    """benchmarks/alfworld_start.py at a tiny size: the candidate clones and evaluates once, its
    record names the commit, the game set and every game's outcome; a second call reads it."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import alfworld_start

    monkeypatch.setenv("ALFWORLD_DATA", data_root)
    monkeypatch.setattr(alfworld_start, "SPLIT", "valid_unseen")
    monkeypatch.setattr(alfworld_start, "START_FLAGS", [
        "--env", "alfworld", "--model", "tiny-scratch", "--bc-epochs", "1", "--iterations", "0",
        "--max-episode-steps", "4", "--eval-splits", "valid_unseen", "--eval-num-tasks", "0",
        "--env-workers", "0"])
    monkeypatch.setattr(alfworld_start, "CANDIDATES", {"t": ["--bc-num-tasks", "2"]})
    argv = ["--results", str(tmp_path / "results"), "--runs", str(tmp_path / "runs")]
    assert alfworld_start.main(argv) == 0
    with open(tmp_path / "results" / "t.json") as f:
        record = json.load(f)
    assert record["flags"] == ["--bc-num-tasks", "2"] and record["commit"]
    assert record["game_set"]["train_games"] == 6
    assert record["game_set"]["valid_unseen_games"] == 2
    assert record["behavior_cloning"]["bc/steps"] > 0
    assert len(record["evaluation"]["eval_valid_unseen/outcomes"]) == 2
    assert "| t | --bc-num-tasks 2 |" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "results" / "table.md")
    assert alfworld_start.main(argv) == 0
    assert "  t: recorded" in capsys.readouterr().out


def test_a_gone_games_engine_library_serves_a_later_game(data_root):
    """Each game loads a copy of Fast Downward's library, which is never unloaded: a game that
    is gone leaves its copy to a later game (TatSu's parser keeps the last game it parsed
    alive until the next parse), which plays exactly as with a fresh copy."""
    import gc

    game_file = games(data_root, "train")[0]

    def play():
        game = alfworld_env.AlfworldEnv(game_file, max_steps=50)
        texts = [game.reset()]
        with open(game_file) as f:
            for command in json.load(f)["walkthrough"]:
                texts += [game.step(command)[0], *game.admissible_actions()]
        return id(game._env.unwrapped.downward_lib), texts, alfworld_env.steps_to_go(game)

    played = []
    for _ in range(4):
        played.append(play())
        gc.collect()
    assert len({library for library, _, _ in played}) < 4  # a copy served again
    assert all(p[1:] == played[0][1:] for p in played) and played[0][2] == 0


def test_the_alfworld_oracle_is_the_planners_distance(data_root):
    """envs.label_progress on ALFWorld: a step's progress is the fewest commands to a win before
    it minus after it, the length of the plan the engine's own planner (Fast Downward) makes
    from that state, in every state of every fixture game's walkthrough and of a random walk.
    Only a step of such a plan earns: going where the object is, taking it, going to the target,
    opening it when it is closed, putting the object in (+1 each); a look or a visit elsewhere
    earns 0, and closing the target again undoes its opening (-1)."""
    import envs

    rng, compared = random.Random(0), set()
    for game_file in games(data_root, "train") + games(data_root, "valid_unseen"):
        with open(game_file) as f:
            walkthrough = json.load(f)["walkthrough"]
        for walk in ("walkthrough", "random"):
            game = alfworld_env.AlfworldEnv(game_file, max_steps=50)
            game.reset()
            engine = game._env.unwrapped
            for t in range(len(walkthrough) if walk == "walkthrough" else 5):
                state = (game_file, alfworld_env.true_state(game))
                if state not in compared:  # the planner takes up to seconds a state
                    compared.add(state)
                    planned = engine._pddl_state.replan(engine._entity_infos)
                    assert alfworld_env.steps_to_go(game) == len(planned), (game_file, t, planned)
                command = walkthrough[t] if walk == "walkthrough" else rng.choice(
                    game.admissible_actions())
                game.step(command)
                if game.won:
                    break
            assert game.won == (walk == "walkthrough")

    def labels(task_type: str):
        (game_file,) = [f for f in games(data_root, "train") if task_type in f]
        with open(game_file) as f:
            commands = ["look", *json.load(f)["walkthrough"]]
        game = alfworld_env.AlfworldEnv(game_file, max_steps=50)
        game.reset()
        first = alfworld_env.steps_to_go(game)
        seen = [game.step(c)[0] for c in commands]
        assert game.won and alfworld_env.steps_to_go(game) == 0
        return (game_file, first, commands, seen,
                *envs.label_progress("alfworld", game_file, commands, seen, 50))

    game_file, first, commands, seen, progress, states = labels("pick_and_place_simple")
    assert commands == ["look", "look", "go to sofa 1", "go to shelf 1",
                        "take keychain 1 from shelf 1", "go to sofa 1",
                        "move keychain 1 to sofa 1"]
    assert first == 4 and progress == [0, 0, 0, 1, 1, 1, 1]
    # the true state before each step: the second look changes no fact, going to the sofa does
    assert states[1] == states[2] != states[3] and len(states) == len(commands)
    cool_file, first, commands, cool_seen, progress, _ = labels("pick_cool_then_place_in_recep")
    assert commands[3:6] == ["go to microwave 1", "open microwave 1", "close microwave 1"]
    assert first == 7 and progress[3:6] == [0, 1, -1] and sum(progress) == first
    with pytest.raises(RuntimeError, match="the replay of"):
        envs.label_progress("alfworld", game_file, commands, ["something else"] + seen[1:], 50)
    # shared among two processes, the same labels in the same order
    jobs = [(cool_file, commands[:n], cool_seen[:n], 50) for n in (len(commands), 3, 5)]
    assert envs.label_batch("alfworld", jobs, workers=2) == [
        envs.label_progress("alfworld", *job) for job in jobs]


def test_the_credit_benchmark_runs_on_alfworld(data_root, tmp_path):
    """benchmarks/credit.py --env alfworld at a tiny size: the batch played from tiny-alfworld on
    the fixture's games, labelled by ALFWorld's oracle; a household start and a folder without
    games are refused before any rollout."""
    env = dict(os.environ, ALFWORLD_DATA=data_root, HF_HUB_OFFLINE="1")
    command = [sys.executable, "benchmarks/credit.py", "--env", "alfworld", "--num-tasks", "2",
               "--group-size", "2", "--max-episode-steps", "6", "--estimators", "oracle", "grpo",
               "admissible", "--out", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    with open(tmp_path / "out" / "table.md") as f:
        summary, _, *table = f.read().splitlines()
    assert summary.startswith("alfworld: start tiny-alfworld, 2 train tasks x 2, ")
    assert "4 episodes" in summary and "step limit 6" in summary
    assert [row.split(" | ")[0] for row in table[2:]] == [
        "| oracle: GRPO + progress (reference, proxmo.py)", "| GRPO (proxmo.py)",
        "| admissible steps only (reference)"]
    assert os.path.isfile(tmp_path / "out" / "credit.png")
    for argv, extra, message in ((["--model", "tiny"], {}, "--model tiny on --env alfworld"),
                                 ([], {"ALFWORLD_DATA": str(tmp_path)}, "alfworld-download")):
        refused = subprocess.run(command[:6] + argv + ["--out", str(tmp_path / "no")], cwd=ROOT,
                                 env={**env, **extra}, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr[-2000:]
        assert "Traceback" not in refused.stderr and not (tmp_path / "no").exists()


def test_the_learning_protocol_runs_on_alfworld(data_root, tmp_path):
    """benchmarks/learning.py --env alfworld at a tiny size, the oracle's run (rollouts in worker
    processes, replayed with the planner in the trainer's): the run takes the env's flags, its
    record names the game set (the generator's seed, the split's size, the alfworld version); a
    household split is refused."""
    import importlib.metadata

    command = [sys.executable, "benchmarks/learning.py", "--env", "alfworld", "--estimators",
               "oracle", "--seeds", "1", "--results", str(tmp_path / "records"), "--runs",
               str(tmp_path / "runs"), "--", "--iterations", "1", "--tasks-per-iteration", "1",
               "--group-size", "2", "--max-episode-steps", "6", "--env-workers", "2"]
    env = dict(os.environ, ALFWORLD_DATA=data_root, HF_HUB_OFFLINE="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    with open(tmp_path / "records" / "oracle-seed1.json") as f:
        record = json.load(f)
    assert record["split"] == "valid_unseen" and record["flags"][:6] == [
        "--iterations", "10", "--tasks-per-iteration", "8", "--env", "alfworld"]
    assert record["game_set"] == {"alfworld_data": data_root, "train_games": 6,
                                  "valid_unseen_games": 2, "seeds": [SEED],
                                  "alfworld": importlib.metadata.version("alfworld")}
    # keyed, every game played 3 times (--eval-draws 3): [game, won, steps] per episode
    outcomes = record["evaluations"]["0"]["eval_valid_unseen/outcomes"]
    assert record["flags"][6:8] == ["--eval-draws", "3"] and record["sampler"] == "keyed"
    assert [game for game, _, _ in outcomes] == [0, 0, 0, 1, 1, 1]
    assert re.search(r"^\| proxmo\.py \| oracle \| 1 \|", result.stdout, re.MULTILINE)
    refused = subprocess.run([*command[:2], "--env", "alfworld", "--split", "test"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "--split test is not a split of alfworld: valid_seen, valid_unseen" in refused.stderr


def play_tiny_alfworld(root: str):
    """--model tiny-alfworld's greedy games of every game under root (train, then valid_unseen):
    (the games as recorded: game, won, executed actions; the trajectories; the model)."""
    from dataclasses import replace

    from common.model import load_model_and_tokenizer
    from proxmo import Policy, preset_args, rollout

    model, tokenizer = load_model_and_tokenizer("tiny-alfworld")
    # At most 30 steps: the recording's limit (the preset's 50 would lengthen its lost games).
    args = replace(preset_args("tiny-alfworld", "alfworld"), env_workers=0, max_episode_steps=30)
    files = games(root, "train") + games(root, "valid_unseen")
    trajs = rollout(args, tokenizer, Policy(args, model, tokenizer), files,
                    list(range(len(files))), temperature=0.0)
    played = [{"game": os.path.relpath(f, root), "won": t["won"],
               "actions": [s["action"] for s in t["steps"]]} for f, t in zip(files, trajs)]
    return played, trajs, model


def test_a_rollouts_own_games_label_its_steps_as_a_replay_does(data_root):
    """rollout(progress=True) reads the oracle's labels in the games it plays, in the env
    workers (envs.ProgressGame): the labels a replay of each trajectory's commands gives
    (envs.label_progress, what the oracle's runs did before), without the replay."""
    from dataclasses import replace

    import envs
    from common.generation import episode_keys
    from common.model import load_model_and_tokenizer
    from proxmo import Policy, preset_args, rollout

    model, tokenizer = load_model_and_tokenizer("tiny-alfworld")
    args = replace(preset_args("tiny-alfworld", "alfworld"), env_workers=2, max_episode_steps=12)
    files = games(data_root, "train")[:3]
    groups = [0, 0, 1, 1, 2, 2]
    trajs = rollout(args, tokenizer, Policy(args, model, tokenizer), [files[g] for g in groups],
                    groups, temperature=1.0, keys=episode_keys((1, "test"), groups),
                    progress=True)
    labels = [[s["progress"] for s in t["steps"]] for t in trajs]
    replayed = [envs.label_progress("alfworld", files[g], [s["action"] for s in t["steps"]],
                                    [s["next_state"] for s in t["steps"]], 12)[0]
                for g, t in zip(groups, trajs)]
    assert labels == replayed
    assert any(p != 0 for label in labels for p in label)  # not a run of zeros
    plain = rollout(args, tokenizer, Policy(args, model, tokenizer), files[:1], [0], 1.0,
                    keys=episode_keys((1, "test"), [0]))
    assert {s["progress"] for s in plain[0]["steps"]} == {None}


def test_the_shipped_alfworld_start_plays_its_recorded_games(data_root):
    """assets/tiny-alfworld (the default --model of --env alfworld) plays, greedily, the games
    recorded beside it on the games the fixture generates: each game's actions up to its first
    close call (the record keeps those), and the whole game where it has none. A change to
    ALFWorld's text, the wrapper or the prompt that silently breaks the shipped start fails here.
    Re-record, after rebuilding the start on purpose: python tests/test_alfworld_games.py --record
    """
    with open(TINY_ALFWORLD_RECORD) as f:
        record = json.load(f)
    played = {g["game"]: g for g in play_tiny_alfworld(data_root)[0]}
    assert sorted(played) == sorted(g["game"] for g in record["games"])
    for game in record["games"]:
        actions = played[game["game"]]["actions"]
        assert actions[:len(game["actions"])] == game["actions"], game["game"]
        if game["whole"]:
            assert (actions, played[game["game"]]["won"]) == (game["actions"], game["won"])
    assert sum(len(g["actions"]) for g in record["games"]) >= 40


def record_tiny_alfworld() -> None:
    """Play every fixture game greedily; keep each game's actions up to the first whose greedy
    tokens did not all beat the runner-up by 0.05 logits (float differences between machines
    cannot flip the ones kept), and whether the whole game was kept."""
    import tempfile

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_tiny_checkpoint import MIN_MARGIN, step_margins

    with tempfile.TemporaryDirectory() as root:
        played, trajs, model = play_tiny_alfworld(make_games(root))
    kept = []
    for game, traj in zip(played, trajs):
        margins = step_margins(model, traj)
        sure = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(margins))
        kept.append({**game, "actions": game["actions"][:sure], "whole": sure == len(margins)})
    with open(TINY_ALFWORLD_RECORD, "w") as f:
        json.dump({"games": kept}, f, indent=1)
    print(f"recorded {sum(len(g['actions']) for g in kept)} greedy actions of {len(kept)} games "
          f"({sum(g['whole'] for g in kept)} whole) in {TINY_ALFWORLD_RECORD}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(record_tiny_alfworld.__doc__)
    record_tiny_alfworld()


def test_ctrl_c_stops_the_generator_without_a_traceback_and_loses_no_game(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) once games are being written:
    exit status 130, one line saying how to go on, no traceback; the same command then finishes
    the set, keeping every game written before."""
    import signal
    import subprocess
    import time

    out = tmp_path / "data"
    command = [sys.executable, "-m", "envs.alfworld_games", "--out", str(out), "--per-type", "10",
               "--splits", "valid_unseen", "--task-types", "pick_and_place_simple",
               "look_at_obj_in_light", "--seed", str(SEED), "--workers", "2"]
    # As from a terminal: SIGINT handled (a test runner's worker may have it ignored, and a
    # child inherits that).
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not games(str(out), "valid_unseen") and time.time() < deadline:
        time.sleep(0.2)
    assert games(str(out), "valid_unseen"), "no game written in 120 s"
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "the same command goes on from them" in err
    kept = {path: open(path, "rb").read() for path in games(str(out), "valid_unseen")}
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    after = games(str(out), "valid_unseen")
    assert len(after) == 20 and all(open(p, "rb").read() == b for p, b in kept.items())
    assert not glob.glob(os.path.join(str(out), "json_2.1.1", "*", "*", "*.partial"))


def test_eval_sizing_pairs_the_same_policy_to_a_difference_of_zero(data_root, tmp_path,
                                                                  monkeypatch, capsys):
    """benchmarks/eval_sizing.py on a policy against itself: under each sampler both arms draw
    alike (keyed: the same keys; global: the same torch seed), so every seed's paired difference
    is exactly 0; each evaluation is kept, and a second sitting plays none again."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    monkeypatch.setenv("ALFWORLD_DATA", data_root)
    import eval_sizing

    argv = ["--a", "start", "--b", "start", "--seeds", "1", "2", "--out", str(tmp_path)]
    markdown = eval_sizing.main(argv)
    for sampler in ("global", "keyed"):
        assert f"| {sampler} | +0.000, +0.000 | +0.0000 | 0.0000 | 0.0000 (" in markdown
    assert len(glob.glob(str(tmp_path / "*-seed*-draws1.json"))) == 8
    capsys.readouterr()
    eval_sizing.main(argv)
    assert "success" not in capsys.readouterr().out.split("| sampler")[0]  # nothing played


def test_eval_sizing_pools_each_games_variance_by_hand(monkeypatch):
    """Two seeds, two games. B - A per game: seed 1 (0, 1), seed 2 (1, 0); each game's variance
    over the seeds is 0.5, so one evaluation's difference has SD sqrt(0.5 / 2) = 0.5."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import eval_sizing

    def evaluation(*won):
        return {"outcomes": [[game, w, 50] for game, w in enumerate(won)]}

    a = [evaluation(1, 0), evaluation(0, 0)]
    b = [evaluation(1, 1), evaluation(1, 0)]
    assert eval_sizing.pooled_sd(a, b) == pytest.approx(0.5)


def test_a_demonstration_edited_or_reshaped_is_damage(data_root, tmp_path):
    """A recording carries a digest of its content: a label changed by hand (valid JSON, every
    label "look") or steps that are no list is refused by name, not trained on or a traceback."""
    import shutil

    from common import UsageError

    game_dir = os.path.dirname(games(data_root, "train")[0])
    copy = tmp_path / "json_2.1.1" / "train" / os.path.basename(os.path.dirname(game_dir))
    shutil.copytree(game_dir, copy / os.path.basename(game_dir))
    game_file = str(copy / os.path.basename(game_dir) / "game.tw-pddl")
    alfworld_games.record_demonstrations([game_file], 0.2, 50, 1)
    assert alfworld_env.load_demonstration(game_file, 50)["steps"]
    path = alfworld_env.demonstration_file(game_file)
    saved = json.load(open(path))
    for change, says in ((lambda r: [s.update(label="look") for s in r["steps"]], "digest"),
                         (lambda r: r.update(steps="three"), "not the recorded steps")):
        recording = json.loads(json.dumps(saved))
        change(recording)
        json.dump(recording, open(path, "w"))
        with pytest.raises(UsageError, match=f"is damaged.*{says}"):
            alfworld_env.load_demonstration(game_file, 50)


def test_a_damaged_game_file_is_named(data_root, tmp_path, monkeypatch):
    """A truncated game.tw-pddl, or one holding a list: listing the split names it and its error
    (UsageError, "Type: first line"), not a JSON traceback."""
    import shutil

    from common import UsageError

    shutil.copytree(os.path.join(data_root, "json_2.1.1", "valid_unseen"),
                    tmp_path / "json_2.1.1" / "valid_unseen")
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    game_file = games(str(tmp_path), "valid_unseen")[0]
    text = open(game_file).read()
    for damaged, error in ((text[:len(text) // 2], "JSONDecodeError"),
                          (json.dumps([json.loads(text)]), "AttributeError")):
        open(game_file, "w").write(damaged)
        with pytest.raises(UsageError, match=rf"game.tw-pddl is damaged \({error}: \S.*\)"):
            alfworld_env.game_files("valid_unseen")
