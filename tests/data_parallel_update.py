"""One PPO update of a fixed batch, in one process or in each of those `accelerate launch` started;
the main process saves the new LoRA weights and the update's stats to the path given.

    python tests/data_parallel_update.py OUT.pt [SHARE] [METHOD]
    accelerate launch --multi_gpu --num_processes 2 tests/data_parallel_update.py OUT.pt [SHARE]
        [METHOD]

METHOD is proxmo (default: proxmo.py's policy update), spa (spa.py's, with its value head and
value loss) or istar (istar.py's DPO step of the PRM, not a policy update: the 14 samples are the
steps of 7 trajectories in 3 groups, and SHARE counts process 0's trajectories, whole groups).

tests/test_data_parallel.py runs both and compares. The batch is split unevenly on purpose:
process 0 holds the SHARE (default 5) samples with the shortest responses, process 1 the rest,
so a mean of per-process means would not give the one-process update; with SHARE 1 process 0
has no member at all in some mini-batches.
"""

import os
import sys

import torch
from accelerate import PartialState

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.dist import mean_across_processes, my_share, whole_batch  # noqa: E402
from common.model import add_lora, load_model_and_tokenizer, scored_logprobs  # noqa: E402
import istar  # noqa: E402
import proxmo  # noqa: E402
import spa  # noqa: E402
from envs.text import build_prompt, chat_ids  # noqa: E402

ACTIONS = ["look", "go to cabinet 1", "open drawer 2", "take apple 1 from countertop 1",
           "heat apple 1 with microwave 1", "move apple 1 to diningtable 1", "inventory"]


def fixed_batch(tokenizer) -> list[tuple]:
    """14 step samples (prompt, response, advantage, None): 7 actions x 2 observations, advantages
    of mixed signs and sizes; the old log-probs (None) are scored before the split
    (with_old_logprobs, with_values)."""
    samples = []
    for k in range(14):
        action = ACTIONS[k % len(ACTIONS)]
        obs = "You arrive at cabinet 1. The cabinet 1 is closed." if k % 2 else "Nothing happens."
        prompt = chat_ids(tokenizer, build_prompt("put a hot apple in diningtable.", [], obs,
                                                  ACTIONS, k % 5 + 1, 1, False))
        response = tokenizer(f"<action>{action}</action>", add_special_tokens=False).input_ids
        samples.append((prompt, response + [tokenizer.eos_token_id], (k % 3 - 1) * (1 + k / 7),
                        None))
    return sorted(samples, key=lambda s: len(s[1]))


def with_values(model, value_head, tokenizer, samples: list[tuple]) -> list[tuple]:
    """spa.py's samples (prompt, response, advantage, return, old log-probs, old value): the old
    log-probs and values scored before the split, returns made up around them."""
    with torch.no_grad():
        logp, _, _, values = spa.policy_forward(model, value_head, [s[0] for s in samples],
                                                [s[1] for s in samples], tokenizer.pad_token_id)
    return [(p, r, a, v.item() + a / 2, lp[:len(r)], v.item())
            for (p, r, a, _), lp, v in zip(samples, logp, values)]


def with_old_logprobs(model, tokenizer, samples: list[tuple]) -> list[tuple]:
    """proxmo.py's samples (prompt, response, advantage, old log-probs): those the rollout would
    have recorded, scored before the split."""
    logp = scored_logprobs(model, [s[0] for s in samples], [s[1] for s in samples],
                           tokenizer.pad_token_id, 4, 1.0)
    return [(p, r, a, lp.tolist()) for (p, r, a, _), lp in zip(samples, logp)]


# istar: the 14 fixed samples as 7 trajectories (steps each), their groups and outcomes.
TRAJ_STEPS = [2, 2, 3, 2, 2, 1, 2]
TRAJ_GROUPS = [0, 0, 0, 1, 1, 2, 2]
TRAJ_WON = [1, 0, 0, 1, 0, 0, 0]  # group 2 all lost: no pair


def prm_step(model, tokenizer, samples: list[tuple], share_of_process_0: int) -> dict:
    """istar.prm_update on the fixed batch: the PRM is `model` with its adapter moved off zero,
    the old log-probs are those of the zero adapter; every process scores the whole batch (the
    gathered one) and steps on its share of whole trajectories."""
    dist = PartialState()
    steps = [istar.ScoredStep(p, r, None) for p, r, _, _ in samples]
    with model.disable_adapter():
        old = istar.score_responses(model, tokenizer, steps, 4, 1.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    trajs = [{"steps": [None] * n} for n in TRAJ_STEPS]
    rewards = istar.step_rewards_per_trajectory(
        trajs, istar.score_responses(model, tokenizer, steps, 4, 1.0), old, 0.05)
    batch = [{"won": w, "group": g, "step_rewards": r}
             for w, g, r in zip(TRAJ_WON, TRAJ_GROUPS, rewards)]
    mine = range(len(batch))
    if dist.num_processes == 2:
        mine = [range(share_of_process_0), range(share_of_process_0, len(batch))][
            dist.process_index]
    first_step = sum(TRAJ_STEPS[:mine.start])
    share = [step._replace(old_logprobs=lp) for step, lp in list(zip(steps, old))[
        first_step:first_step + sum(TRAJ_STEPS[i] for i in mine)]]
    mine = slice(mine.start, mine.stop)
    args = istar.Args(micro_batch_size=3)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    return istar.prm_update(args, model, tokenizer, optimizer, batch, share, mine, 1)


def main(out: str, share_of_process_0: int, method: str) -> None:
    dist = PartialState(cpu=True)
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer("tiny")
    model = add_lora(model, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    samples = fixed_batch(tokenizer)
    params = [p for p in model.parameters() if p.requires_grad]
    if method == "spa":
        value_head = spa.make_head(model.config.hidden_size, "linear", "cpu")
        torch.nn.init.normal_(value_head[-1].weight, 0, 0.1)
        samples = with_values(model, value_head, tokenizer, samples)
        params += list(value_head.parameters())
    elif method == "proxmo":
        samples = with_old_logprobs(model, tokenizer, samples)
    if dist.num_processes not in (1, 2):
        raise SystemExit("run with one or two processes")
    if method == "istar":
        stats = prm_step(model, tokenizer, samples, share_of_process_0)
    else:
        if dist.num_processes == 2:
            samples = [samples[:share_of_process_0],
                       samples[share_of_process_0:]][dist.process_index]
        # SGD: Adam's first steps are sign-like and would amplify float noise in tiny gradients.
        optimizer = torch.optim.SGD(params, lr=0.5)
        generator = torch.Generator().manual_seed(0)
        if method == "spa":
            args = spa.Args(micro_batch_size=3, minibatch_size=6, ppo_epochs=2, vf_coef=0.5)
            stats = spa.policy_update(args, model, value_head, tokenizer, optimizer,
                                      [spa.StepSample(*s) for s in samples], generator, 1)
        else:
            args = proxmo.Args(micro_batch_size=3, minibatch_size=6, ppo_epochs=2)
            stats = proxmo.policy_update(args, model, tokenizer, optimizer,
                                         [proxmo.StepSample(*s) for s in samples], generator, 1)
    # A process without a micro-batch of its own in an update (3SPO's rounds) lacks some stats:
    # the means are over the processes that have them.
    uneven = {"loss": [1.0], "clip_fraction": [0.5]} if dist.process_index else {"loss": [3.0]}
    means = mean_across_processes(uneven)
    expected = {"loss": 2.0, "clip_fraction": 0.5} if dist.num_processes == 2 else {"loss": 3.0}
    assert means == expected, means
    # Each process plays its share of the groups; the batch is every share, in process order.
    tasks, groups = my_share(["a", "b", "c"], 2)
    batch, mine = whole_batch(groups)
    assert batch == [0, 0, 1, 1, 2, 2] and batch[mine] == groups, (batch, mine, groups)
    expected_tasks = ["b", "b", "c", "c"] if dist.process_index else ["a", "a"]
    if dist.num_processes == 1:
        expected_tasks = ["a", "a", "b", "b", "c", "c"]
    assert tasks == expected_tasks, tasks
    if dist.is_main_process:
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        if method == "spa":
            weights.update({f"value_head.{n}": p.detach().clone()
                            for n, p in value_head.named_parameters()})
        torch.save({"weights": weights, "stats": stats, "processes": dist.num_processes}, out)
    if dist.num_processes > 1:
        # Without it a busy machine sometimes aborted a process at exit ("terminate called
        # without an active exception", gloo's threads still running).
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5,
         sys.argv[3] if len(sys.argv) > 3 else "proxmo")
