"""sspo.py's search (Algorithm 1) on the built-in household with a scripted policy: the game's
snapshot and restore, ranking and pushing, terminal children, truncation by a closed gate, the
ablations' variants, and that the harness sections are proxmo.py's text."""

import inspect
import math
import os

import pytest

import envs
import proxmo
import sspo
from common.model import load_model_and_tokenizer
from envs.household import HouseholdEnv, generate_task
from sspo import Args, Counts, StateTable, new_search, search_round, state_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_household_restore_replays_exactly():
    """Playing on from a restored snapshot gives the observations, admissible actions, rewards
    and flags of playing straight through; the snapshot is a copy, unchanged by later steps."""
    game = HouseholdEnv(generate_task(11), max_steps=40)
    game.reset()
    commands = []
    for _ in range(6):
        commands.append(game.expert_action())
        game.step(commands[-1])
    saved = game.snapshot()
    saved_copy = repr(saved)
    straight = []
    for _ in range(8):
        command = game.expert_action()
        straight.append((command, game.step(command), game.admissible_actions()))
        if straight[-1][1][2]:
            break
    assert repr(saved) == saved_copy
    other = HouseholdEnv(generate_task(11), max_steps=40)
    other.reset()
    other.restore(saved)
    for command, result, admissible in straight:
        assert other.step(command) == result
        assert other.admissible_actions() == admissible
    game.restore(saved)  # and the first game can go back too
    assert game.steps == 6 and not game.won


class ScriptedPolicy:
    """generate() answers each prompt with the next command of `script` (a list per call)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, list(script), []

    def generate(self, prompts, temperature, top_p=1.0):
        replies = self.script.pop(0)
        assert len(replies) == len(prompts)
        self.calls.append(len(prompts))
        ids = [self.tokenizer(r, add_special_tokens=False).input_ids for r in replies]
        return ids, [[-0.5] * len(i) for i in ids]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_and_tokenizer("tiny")[1]


def small_args(**kw):
    """K_max 4, and the literal reading (per-task keys, alpha 50, R_succ 1), whose numbers the
    first tests work by hand; the revised defaults have tests of their own below."""
    literal = {"share_states_across_tasks": False, "score_alpha": 50.0, "success_reward": 1.0}
    return Args(**{"max_rollouts": 4, "max_episode_steps": 30, **literal, **kw})


def expanded_node(search):
    return search["frontier"][-1]


def test_round_ranks_pushes_and_trains(tokenizer):
    """An unvisited root: n = K_max = 4. Replies: two different admissible moves, a repeat of
    the first, and a reply with no <action> tag. Rewards (w = 0.5 at N = 0, S = 1 everywhere):
    0.5, 0.5, 0.5, -0.1; the repeat is trained on but not pushed, the no-op neither; pushed
    worst first, so the first move is on top."""
    args = small_args()
    (task,) = envs.list_tasks("household", "train", 1)
    search = new_search(args, task)
    game = search["game"]
    moves = [a for a in game.admissible_actions() if a.startswith("go to")][:2]
    replies = [f"<action>{moves[0]}</action>", f"<action>{moves[1]}</action>",
               f"<action>{moves[0]}</action>", "no tag here"]
    policy = ScriptedPolicy(tokenizer, [replies])
    table = StateTable()
    samples, finished, records = search_round(args, tokenizer, policy, [search], table)
    assert finished == [] and table.counts == {} and table.t == 1  # read only
    assert records[0]["rollouts"] == 4 and records[0]["score"] == 1.0
    # an unvisited state: w = 0.5, so Eq. 2's score difference weighs nothing
    assert records[0]["w"] == 0.5 and not records[0]["score_difference_varies"]
    assert records[0]["score_difference_spread"] == 0.0
    assert records[0]["rewards"] == pytest.approx([0.5, 0.5, 0.5, -0.1])
    assert records[0]["well_formed"] == [True, True, True, False]
    assert [a for _, _, a, _ in samples] == pytest.approx([0.5, 0.5, 0.5, -1.5], abs=1e-5)
    assert search["generations"] == 4
    top, below = search["frontier"][-1], search["frontier"][-2]
    assert len(search["frontier"]) == 2
    assert top["history"] == [(search["root"]["obs"], moves[0])]
    assert below["history"] == [(search["root"]["obs"], moves[1])]
    assert top["keys"] == [search["root"]["keys"][0], state_key(str(task), top["obs"])]
    game.restore(top["snapshot"])
    assert game.location == moves[0][len("go to "):] and game.steps == 1


def test_closed_gate_truncates_without_sampling(tokenizer):
    """A root whose counts close the gate (11 failures, p <= 0.1): n = 0, no generation, one
    failed path with the root's key; the frontier is empty, so the search has ended."""
    args = small_args()
    (task,) = envs.list_tasks("household", "train", 1)
    search = new_search(args, task)
    root_key = search["root"]["keys"][0]
    table = StateTable({root_key: Counts(12, 1)}, t=5)
    policy = ScriptedPolicy(tokenizer, [])
    samples, finished, records = search_round(args, tokenizer, policy, [search], table)
    assert samples == [] and policy.calls == [] and records[0]["rollouts"] == 0
    assert finished == [(0, [root_key], False, None)]  # cut: no game end, no episode length
    assert not sspo.search_active(args, search)


def near_win(task):
    """A search whose root is the state one expert step before the win."""
    game = HouseholdEnv(generate_task(task), max_steps=30)
    game.reset()
    while True:
        command = game.expert_action()
        saved = game.snapshot()
        _, _, done, info = game.step(command)
        if info["won"]:
            return saved, command
        assert not done


def test_terminal_children_finish_paths_and_a_single_sample_trains_nothing(tokenizer):
    """From one step before the win, with uniform rollouts off and a state visited once on a
    won path (S ~ 0 at t = 3, alpha = 50): n = 1, one winning child, one finished path, no
    training sample. Then the same state unvisited: n = 4, two winning children of four finish
    two paths (best first) and the group trains."""
    (task,) = envs.list_tasks("household", "train", 1)
    saved, winning = near_win(task)
    for counts, replies, n_paths, n_samples in (
            (Counts(1, 1), [[f"<action>{winning}</action>"]], 1, 0),
            (None, [[f"<action>{winning}</action>", "<action>look</action>",
                     f"<action>{winning}</action>", "<action>inventory</action>"]], 2, 4)):
        args = small_args()
        search = new_search(args, task)
        search["game"].restore(saved)
        search["root"]["snapshot"] = saved
        key = search["root"]["keys"][0]
        table = StateTable({key: counts} if counts else {}, t=3)
        policy = ScriptedPolicy(tokenizer, replies)
        samples, finished, records = search_round(args, tokenizer, policy, [search], table)
        assert [f[2] for f in finished] == [True] * n_paths and len(samples) == n_samples
        assert all(f[1] == [key] for f in finished)
        if n_samples:
            # Wins: 0.5 + 0.5 + 0 (S_t = S_next = 1); look, inventory: novel, 0.5 each.
            assert records[0]["rewards"] == pytest.approx([1.0, 0.5, 1.0, 0.5])
            # look and inventory, both new observations, pushed worst first: look (index 1,
            # ranked above index 3 on the tie) ends on top.
            assert [n["history"][-1][1] for n in search["frontier"]] == ["inventory", "look"]


def test_step_limit_children_are_scored_from_the_table(tokenizer):
    """With a step limit of 1 every child ends a lost path, but none is the game's own end: a
    child reaching a state seen on a won path (S ~ 0 at t = 3) earns the score difference,
    w + (0.5 - w) (1 - 0) = 0.5 from a root with N = 2 (w = 0.5 e^-0.2 = 0.409365), while one
    reaching an unvisited state earns w alone."""
    args = small_args(max_episode_steps=1)
    (task,) = envs.list_tasks("household", "train", 1)
    search = new_search(args, task)
    game = search["game"]
    moves = [a for a in game.admissible_actions() if a.startswith("go to")][:2]
    won_key = state_key(str(task), game.step(moves[0])[0])  # restored before the round
    root_key = search["root"]["keys"][0]
    table = StateTable({root_key: Counts(2, 0), won_key: Counts(1, 1)}, t=3)
    replies = [f"<action>{moves[0]}</action>", f"<action>{moves[1]}</action>"] * 2
    policy = ScriptedPolicy(tokenizer, [replies])
    samples, finished, records = search_round(args, tokenizer, policy, [search], table)
    w = 0.5 * math.exp(-0.2)
    assert records[0]["rewards"] == pytest.approx([0.5, w, 0.5, w], abs=1e-6)
    assert finished == [(0, [root_key], False, 1)] * 4 and search["frontier"] == []
    assert len(samples) == 4


def test_uniform_rollouts_at_a_visited_state(tokenizer):
    """A root on one won path has S ~ 0 at t = 3: one action; with --uniform-rollouts, K_max."""
    (task,) = envs.list_tasks("household", "train", 1)
    for uniform, n in ((False, 1), (True, 4)):
        args = small_args(uniform_rollouts=uniform)
        search = new_search(args, task)
        table = StateTable({search["root"]["keys"][0]: Counts(1, 1)}, t=3)
        policy = ScriptedPolicy(tokenizer, [["<action>look</action>"] * n])
        _, _, records = search_round(args, tokenizer, policy, [search], table)
        assert records[0]["rollouts"] == n and policy.calls == [n]


def test_no_backtracking_keeps_the_best_child_and_restarts(tokenizer):
    (task,) = envs.list_tasks("household", "train", 1)
    args = small_args(backtracking=False)
    search = new_search(args, task)
    moves = [a for a in search["game"].admissible_actions() if a.startswith("go to")][:4]
    policy = ScriptedPolicy(tokenizer, [[f"<action>{m}</action>" for m in moves]])
    search_round(args, tokenizer, policy, [search], StateTable())
    assert len(search["frontier"]) == 1
    assert search["frontier"][0]["history"][0][1] == moves[0]
    # A step limit of 1: every child ends its path, nothing is pushed, and the search goes on
    # from the first state again (backtracking would have ended it).
    args = small_args(backtracking=False, max_episode_steps=1)
    search = new_search(args, task)
    policy = ScriptedPolicy(tokenizer, [[f"<action>{m}</action>" for m in moves]] * 2)
    for depth in (0, 0):
        assert sspo.search_active(args, search)
        _, finished, records = search_round(args, tokenizer, policy, [search], StateTable())
        assert records[0]["depth"] == depth and len(finished) == 4 and not search["frontier"]
        search["paths"] += len(finished)
    assert search["paths"] == 8 and not sspo.search_active(args, search)  # --max-paths 8


def test_the_update_and_the_loss_are_proxmos_text():
    """diff proxmo.py sspo.py shows only what 3SPO changes (its rollouts, BC and evaluation
    sections: test_proxmo_harness.py)."""
    for name in ("policy_update", "ppo_clip_loss", "k3_kl", "policy_ratio", "StepSample"):
        a, b = inspect.getsource(getattr(sspo, name)), inspect.getsource(getattr(proxmo, name))
        assert a == b.replace("(Eq. 13)", "(Eq. 4)"), name
    # proxmo.py's summarize also carries the oracle's progress, which 3SPO never has
    step = {"state": "s", "valid": True, "well_formed": False, "prompt": [1], "action": "look"}
    traj = {"task_type": "pick", "group": 3, "won": True, "rewards": [0.0, 1.0],
            "steps": [step, step], "task": "put a mug in the sink"}
    assert sspo.summarize(traj) == proxmo.summarize(traj)


def test_round_statistics_under_the_revised_defaults(tokenizer):
    """The revised reading at alpha 0.5: shared keys, R_succ 10, K_max 4. One step before the
    win, the root counted on four paths with one win at t = 10: S = 10^-0.125 = 0.749894,
    n = ceil(4 S) = 3, w = 0.5 e^-0.4 = 0.335160. Replies: the win (terminal, S 1), look
    (unvisited, S 1) and inventory, whose observation's key (shared, the task's text left out)
    has 11 failures in 12: hopeless, S = 0. Rewards: 0.335160 + 0.164840 (0.749894 - 1) + 0.5 x
    10 = 5.293933; look: 0.293933; inventory: 0.335160 + 0.164840 x 0.749894 = 0.458773. The
    score difference varies in the group: its terms 0.164840 (0.749894 - S') are -0.041228,
    -0.041228 and 0.123613, their spread about their mean 0.013719 is 0.054947 x 2 + 0.109894 =
    0.219787, the rewards' about 2.015546 is 3.278387 + 1.721613 + 1.556773 = 6.556773. One
    child of three is hopeless; the win's path has 1 step."""
    (task,) = envs.list_tasks("household", "train", 1)
    saved, winning = near_win(task)
    args = Args(max_rollouts=4, max_episode_steps=30, score_alpha=0.5)
    search = new_search(args, task)
    search["game"].restore(saved)
    inventory = search["game"].step("inventory")[0]
    search["root"]["snapshot"] = saved
    key = search["root"]["keys"][0]
    assert key == state_key("another task", search["root"]["obs"], share_across_tasks=True)
    table = StateTable({key: Counts(4, 1), state_key("", inventory, True): Counts(12, 1)}, t=10)
    replies = [f"<action>{winning}</action>", "<action>look</action>",
               "<action>inventory</action>"]
    policy = ScriptedPolicy(tokenizer, [replies])
    samples, finished, records = search_round(args, tokenizer, policy, [search], table)
    record = records[0]
    assert record["rollouts"] == 3 and len(samples) == 3
    assert record["rewards"] == pytest.approx([5.293933, 0.293933, 0.458773], abs=1e-6)
    assert record["w"] == pytest.approx(0.335160, abs=1e-6)
    assert record["hopeless"] == [False, False, True] and record["score_difference_varies"]
    assert record["score_difference_spread"] == pytest.approx(0.219787, abs=1e-6)
    assert record["reward_spread"] == pytest.approx(6.556773, abs=1e-6)
    assert finished == [(0, [key], True, 1)]


def test_score_difference_stats_by_hand():
    """Two trained groups: the term varies in one (w 0.3, spreads 0.2 of the rewards' 1.0), not
    in the other (w 0.5, rewards' spread 0.6): varies 1/2, w 0.4, share 0.2 / 1.6 = 0.125; one
    hopeless child of four. Without groups or children the figures are left out."""
    trained = [{"score_difference_varies": True, "w": 0.3, "score_difference_spread": 0.2,
                "reward_spread": 1.0},
               {"score_difference_varies": False, "w": 0.5, "score_difference_spread": 0.0,
                "reward_spread": 0.6}]
    stats = sspo.score_difference_stats(trained, [False, False, True, False])
    assert stats == pytest.approx({"sspo/score_difference_varies": 0.5, "sspo/trained_w": 0.4,
                                   "sspo/score_difference_share": 0.125,
                                   "sspo/hopeless_children": 0.25})
    assert sspo.score_difference_stats([], []) == {}
