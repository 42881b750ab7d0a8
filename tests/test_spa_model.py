"""spa.py's model-side pieces on the shipped tiny model: what the progress estimator reads and
where, that c_t sees no later step, one pass for log-probs and values, and a saved PE that loads
back to the same scores (and another head, refused by name)."""

import copy
import json

import pytest
import torch

import envs
from common import UsageError
from common.model import add_lora, load_model_and_tokenizer, response_logprobs
from spa import (Args, Policy, action_end_positions, encode_trajectory, load_progress_estimator,
                 make_head, policy_forward, progress_forward, rollout, save_progress_estimator,
                 score_progress, score_rollouts, trajectory_messages)


def tiny_rollouts(n_tasks=3, steps=6):
    args = Args(max_episode_steps=steps)
    model, tokenizer = load_model_and_tokenizer("tiny")
    torch.manual_seed(0)
    tasks = envs.list_tasks("household", "train")[:n_tasks]
    trajs = rollout(args, tokenizer, Policy(args, model, tokenizer), tasks, list(range(n_tasks)),
                    temperature=1.0)
    return args, model, tokenizer, trajs


def test_every_reply_has_one_read_position_on_its_closing_token():
    _, _, tokenizer, trajs = tiny_rollouts()
    for traj in trajs:
        messages = trajectory_messages(traj, tokenizer)
        assert [m["role"] for m in messages[:3]] == ["user", "assistant", "user"]
        assert messages[-1]["role"] == "assistant"  # the trailing observation is dropped
        ids, mask = encode_trajectory(tokenizer, messages)
        ends = action_end_positions(mask)
        assert len(ends) == len(traj["steps"]) and len(ids) == len(mask)
        assert all(ids[j] == tokenizer.convert_tokens_to_ids("<|im_end|>") for j in ends)
        runs, start = [], None  # each masked run decodes to the reply it scores
        for j, m in enumerate(mask + [0]):
            if m and start is None:
                start = j
            if not m and start is not None:
                runs.append(tokenizer.decode(ids[start:j], skip_special_tokens=True))
                start = None
        replies = [tokenizer.decode(s["response_ids"], skip_special_tokens=True)
                   for s in traj["steps"]]
        assert [r.split() for r in runs] == [r.split() for r in replies]


def test_a_contribution_sees_no_later_step():
    args, model, tokenizer, trajs = tiny_rollouts()
    traj = max(trajs, key=lambda t: len(t["steps"]))
    assert len(traj["steps"]) >= 3
    pe = add_lora(copy.deepcopy(model), 4, 8, 0.0, "all-linear")
    torch.manual_seed(1)
    for p in pe.parameters():  # a PE that is not the identity adapter
        if p.requires_grad:
            p.data.normal_(0, 0.1)
    head = make_head(model.config.hidden_size, "mlp", "cpu")
    for p in head.parameters():
        p.data.normal_(0, 0.1)
    cut = dict(traj, steps=traj["steps"][:2])
    with torch.no_grad():
        whole, first_two = progress_forward(
            pe, head, [encode_trajectory(tokenizer, trajectory_messages(t, tokenizer))
                       for t in (traj, cut)], tokenizer.pad_token_id)
    assert len(whole) == len(traj["steps"]) and len(first_two) == 2
    assert torch.allclose(whole[:2], first_two, atol=1e-5)
    assert whole.abs().max() > 0


def test_policy_forward_gives_the_log_probs_of_a_plain_pass_and_a_value_per_prompt():
    args, model, tokenizer, trajs = tiny_rollouts()
    policy = add_lora(model, 4, 8, 0.0, "all-linear")
    value_head = make_head(model.config.hidden_size, "linear", "cpu")
    torch.nn.init.normal_(value_head[-1].weight, 0, 0.1)
    steps = [s for t in trajs for s in t["steps"]][:6]
    prompts = [s["prompt"] for s in steps]
    responses = [s["response_ids"] for s in steps]
    with torch.no_grad():
        logp, mask, _, values = policy_forward(policy, value_head, prompts, responses,
                                               tokenizer.pad_token_id, temperature=0.7)
        plain, plain_mask, _ = response_logprobs(policy, prompts, responses,
                                                 tokenizer.pad_token_id, temperature=0.7)
        # V(s_t) depends on the prompt alone: another reply leaves it unchanged
        other = [list(reversed(r)) for r in responses]
        _, _, _, values_other = policy_forward(policy, value_head, prompts, other,
                                               tokenizer.pad_token_id)
    assert torch.equal(mask, plain_mask)
    assert torch.allclose(logp * mask, plain * plain_mask, atol=1e-5)
    assert values.shape == (len(steps),) and torch.allclose(values, values_other, atol=1e-5)
    assert values.abs().max() > 0


def test_saved_progress_estimator_scores_the_same(tmp_path):
    args, model, tokenizer, trajs = tiny_rollouts()
    start = copy.deepcopy(model)
    spare = copy.deepcopy(model)
    pe = add_lora(model, args.lora_r, args.lora_alpha, 0.0, "all-linear")
    for p in pe.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.05)
    head = make_head(model.config.hidden_size, args.pe_head, "cpu")
    head[-1].bias.data.fill_(0.25)
    torch.nn.init.normal_(head[-1].weight, 0, 0.1)
    save_progress_estimator(str(tmp_path / "pe"), pe, head, "the start model")
    with open(tmp_path / "pe" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == "the start model"
    loaded, loaded_head = load_progress_estimator(args, start, str(tmp_path / "pe"))
    for scorer in ((pe, head), (loaded, loaded_head)):
        score_progress(args, *scorer, tokenizer, trajs)
        scores = [s["contrib"] for t in trajs for s in t["steps"]]
        if scorer[0] is pe:
            first = scores
    assert first == scores and any(abs(c - 0.25) > 1e-4 for c in scores)
    assert not any(p.requires_grad for p in loaded.parameters())
    # Another head than the one saved: named with its error's type and first line.
    other = Args(pe_head="mlp" if args.pe_head == "linear" else "linear")
    with pytest.raises(UsageError, match=r"head.pt cannot be loaded \(RuntimeError: \S"):
        load_progress_estimator(other, spare, str(tmp_path / "pe"))


def test_too_long_trajectories_are_read_up_to_the_limit():
    """Replies that close within --pe-max-tokens are scored, later steps get 0."""
    args, model, tokenizer, trajs = tiny_rollouts()
    pe = add_lora(model, 4, 8, 0.0, "all-linear")
    head = make_head(model.config.hidden_size, "linear", "cpu")
    head[-1].bias.data.fill_(0.5)
    encoded = [encode_trajectory(tokenizer, trajectory_messages(t, tokenizer)) for t in trajs]
    limit = min(len(ids) for ids, _ in encoded)  # only the shortest fits
    args = Args(pe_max_tokens=limit)
    too_long = score_progress(args, pe, head, tokenizer, trajs)
    assert too_long == sum(len(ids) > limit for ids, _ in encoded) >= 1
    for t, (ids, mask) in zip(trajs, encoded):
        readable = sum(end < limit for end in action_end_positions(mask))
        contribs = [s["contrib"] for s in t["steps"]]
        assert all(abs(c - 0.5) < 1e-6 for c in contribs[:readable])
        assert contribs[readable:] == [0.0] * (len(contribs) - readable)
        assert readable == len(contribs) or len(ids) > limit


def test_scoring_pass_a_zero_adapter_has_no_kl_and_values_ignore_the_batch():
    args, model, tokenizer, trajs = tiny_rollouts()
    policy = add_lora(model, 4, 8, 0.0, "all-linear")  # lora_B = 0: the policy is the reference
    value_head = make_head(model.config.hidden_size, "linear", "cpu")
    torch.nn.init.normal_(value_head[-1].weight, 0, 0.1)
    score_rollouts(args, policy, value_head, tokenizer, trajs)
    steps = [s for t in trajs for s in t["steps"]]
    assert all(s["step_kl"] == 0.0 for s in steps)
    alone = copy.deepcopy(steps[0])  # the same prompt scored in a batch of one
    score_rollouts(args, policy, value_head, tokenizer, [{"steps": [alone]}])
    assert abs(alone["value"] - steps[0]["value"]) < 1e-5 and abs(alone["value"]) > 0
    assert torch.allclose(alone["old_logprobs"], steps[0]["old_logprobs"], atol=1e-5)
