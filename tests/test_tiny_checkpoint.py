"""The shipped start model (assets/tiny-household, `--model tiny`): it loads, its tokenizer knows
every word the household and the prompts use, and a greedy evaluation of fixed test tasks plays
exactly the games recorded beside it, so that a change to the environment's text or the prompt
that silently breaks the shipped model fails here.

Re-record (after rebuilding the model on purpose):  python tests/test_tiny_checkpoint.py --record
"""

import json
import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import envs  # noqa: E402
from common.model import TINY_CHECKPOINT, load_model_and_tokenizer  # noqa: E402
from envs.text import PROMPT_WORDS  # noqa: E402
from proxmo import Args, Policy, preset_args, rollout  # noqa: E402

RECORD = os.path.join(TINY_CHECKPOINT, "greedy_check.json")
CANDIDATES = 40  # the recorder keeps the first NUM_TASKS of these first test tasks
NUM_TASKS = 12
MIN_MARGIN = 0.05  # logit gap between the two best tokens of every greedy choice that is kept


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny")


def play_greedy(model, tokenizer, task_indices: list[int]) -> tuple[list[dict], list[dict]]:
    """(games as recorded: task index, won, executed actions; the trajectories)."""
    args = preset_args()
    tasks = envs.list_tasks("household", "test")
    trajs = rollout(args, tokenizer, Policy(args, model, tokenizer),
                    [tasks[i] for i in task_indices], task_indices, temperature=0.0)
    games = [{"task": i, "won": t["won"], "actions": [s["action"] for s in t["steps"]]}
             for i, t in zip(task_indices, trajs)]
    return games, trajs


def test_the_shipped_model_loads_with_its_tokenizer(tiny):
    model, tokenizer = tiny
    assert model.config.model_type == "qwen2" and tokenizer.eos_token == "<|im_end|>"
    assert preset_args().model == "tiny" and preset_args().bc_epochs == 0


def test_the_weaker_start_is_the_same_model_with_other_weights(tiny):
    """--model tiny-weak (assets/tiny-household-weak): tiny's architecture and tokenizer, other
    weights."""
    model, tokenizer = tiny
    weak, weak_tokenizer = load_model_and_tokenizer("tiny-weak")
    differ = {k for k in model.config.to_dict()
              if weak.config.to_dict().get(k) != model.config.to_dict()[k]}
    assert differ == {"_name_or_path"}  # where it was loaded from
    assert weak_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert not torch.equal(weak.lm_head.weight, model.lm_head.weight)


def test_its_tokenizer_knows_every_household_and_prompt_word(tiny):
    _, tokenizer = tiny
    unknown = tokenizer.unk_token_id
    words = envs.vocabulary("household") + PROMPT_WORDS
    missing = [w for w in words if unknown in tokenizer(w, add_special_tokens=False).input_ids]
    assert missing == []
    # And the prompts of real games, expert-played (every observation, goal and admissible action).
    args = Args()
    for split in ("train", "valid", "test"):
        tasks = envs.list_tasks("household", split)[:30]
        trajs = rollout(args, tokenizer, None, tasks, list(range(len(tasks))), 0.0,
                        expert_rng=random.Random(0))
        prompts = [s["prompt"] for t in trajs for s in t["steps"]]
        assert len(prompts) > 100 and not any(unknown in p for p in prompts), split


def test_greedy_games_match_the_record(tiny):
    model, tokenizer = tiny
    with open(RECORD) as f:
        record = json.load(f)
    played, _ = play_greedy(model, tokenizer, [g["task"] for g in record["games"]])
    assert played == record["games"]
    assert sum(g["won"] for g in played) == record["wins"]


def step_margins(model, traj: dict) -> list[float]:
    """Per step of a greedy game, the smallest logit gap between the two best tokens over its
    response: a step float differences between machines cannot change when it is large enough."""
    margins = []
    for step in traj["steps"]:
        ids = torch.tensor([step["prompt"] + step["response_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(step["prompt"]) - 1:-1]
        top2 = logits.topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).min().item())
    return margins


def record() -> None:
    """Play the first CANDIDATES test tasks greedily; keep the first NUM_TASKS whose every greedy
    token beat the runner-up by MIN_MARGIN logits, so that float differences between machines
    cannot flip a choice."""
    model, tokenizer = load_model_and_tokenizer("tiny")
    games, trajs = play_greedy(model, tokenizer, list(range(CANDIDATES)))
    kept = [game for game, traj in zip(games, trajs)
            if min(step_margins(model, traj)) >= MIN_MARGIN][:NUM_TASKS]
    with open(RECORD, "w") as f:
        json.dump({"wins": sum(g["won"] for g in kept), "games": kept}, f, indent=1)
    print(f"recorded {len(kept)} games ({sum(g['won'] for g in kept)} won) in {RECORD}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    record()
