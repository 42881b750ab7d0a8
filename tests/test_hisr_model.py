"""hisr.py's model-side pieces on the shipped tiny model: what the SPRM and the hindsight model
read (no word unknown to the tiny vocabulary, the reply hidden, the outcome shown), where the SPRM
reads, that a segment's score sees no later turn, the length limits, the collection filter, and
saved reward models that load back to the same scores."""

import copy
import json
import random
from dataclasses import replace

import pytest
import torch

import envs
from common import UsageError
from common.model import load_model_and_tokenizer, response_logprobs
from hisr import (CLOZE_TEXTS, Args, Policy, SegmentRewardHead, action_end_positions,
                  cloze_messages, cloze_texts, encode_cloze, encode_transcript,
                  keep_for_training, load_reward_models, repeats_itself, rollout,
                  save_reward_models, score_hindsight, score_reward_models, score_segments,
                  segment_scores, split_heldout, trajectory_segments, train_sprm)


@pytest.fixture(scope="module")
def tiny():
    args = Args(max_episode_steps=8)
    model, tokenizer = load_model_and_tokenizer("tiny")
    torch.manual_seed(0)
    tasks = envs.list_tasks("household", "train")[:4]
    trajs = rollout(args, tokenizer, Policy(args, model, tokenizer), tasks, list(range(4)),
                    temperature=1.0)
    return args, model, tokenizer, trajs


def random_sprm(model):
    sprm = copy.deepcopy(model)
    head = SegmentRewardHead(model.config.hidden_size)
    torch.manual_seed(1)
    for p in head.parameters():  # W2 starts at zero: a head that says something
        p.data.normal_(0, 0.1)
    return sprm, head


def test_the_fixed_texts_use_no_word_the_tiny_vocabulary_lacks(tiny):
    args, _, tokenizer, trajs = tiny
    unk = tokenizer.convert_tokens_to_ids("[UNK]")
    for traj in trajs:
        ids, mask, first_turn = encode_transcript(args, tokenizer, traj)
        assert unk not in ids and first_turn == 0
        ends = action_end_positions(mask)
        assert len(ends) == len(traj["steps"])
        assert all(ids[j] == tokenizer.convert_tokens_to_ids("<|im_end|>") for j in ends)
        replies = tokenizer.batch_decode([s["response_ids"] for s in traj["steps"]],
                                         skip_special_tokens=True)
        cloze, cut = encode_cloze(args, tokenizer, traj, replies, 0)
        assert unk not in cloze and not cut


@pytest.mark.parametrize("model, hidden, outcome", [
    ("tiny", "?", "Your task: {:.1f}."),
    ("Qwen2.5-1.5B-Instruct", "___", "The episode ended with reward {:.1f}.")])
def test_the_cloze_hides_one_reply_and_shows_the_rest_and_the_outcome(tiny, model, hidden,
                                                                      outcome):
    _, _, tokenizer, trajs = tiny
    traj = max(trajs, key=lambda t: len(t["steps"]))
    replies = [f"reply {k}" for k in range(len(traj["steps"]))]
    texts = cloze_texts(Args(model=model))
    assert texts == CLOZE_TEXTS["tiny" if model == "tiny" else "real"]
    messages = cloze_messages(traj, replies, 1, range(len(traj["steps"])), texts)
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    assert assistant == [hidden if k == 1 else r for k, r in enumerate(replies)]
    observations = [m["content"] for m in messages[1:-1] if m["role"] == "user"]
    # the message before the hidden reply lists what the policy's prompt listed at that turn
    listed = "Admissible actions: " + ", ".join(traj["steps"][1]["admissible"])
    assert traj["steps"][1]["admissible"] and "go to" in listed
    shown = [f"Observation: {s['next_state']}" for s in traj["steps"]]
    assert observations == [shown[0] + "\n" + listed] + shown[1:]
    assert messages[-1]["content"].startswith(outcome.format(float(traj["won"])))
    assert messages[0]["content"].startswith(texts[0])
    first = cloze_messages(traj, replies, 0, range(len(traj["steps"])), texts)
    assert first[0]["content"].endswith("Admissible actions: "
                                        + ", ".join(traj["steps"][0]["admissible"]))
    cut = cloze_messages(traj, replies, 2, range(2, len(traj["steps"])), texts)  # turns 0-1 cut
    assert cut[0]["content"].endswith("Admissible actions: "
                                      + ", ".join(traj["steps"][2]["admissible"]))
    assert cut[1] == {"role": "assistant", "content": hidden}


def test_a_segment_score_sees_no_later_turn(tiny):
    args, model, tokenizer, trajs = tiny
    traj = max(trajs, key=lambda t: len(t["steps"]))
    m = len(traj["steps"])
    assert m >= 3
    sprm, head = random_sprm(model)
    turns = list(range(m))  # every turn its own segment
    ids, mask, _ = encode_transcript(args, tokenizer, traj)
    changed = copy.deepcopy(traj)
    changed["steps"][-1]["response_ids"] = tokenizer("<action> look </action>",
                                                     add_special_tokens=False).input_ids
    ids2, mask2, _ = encode_transcript(args, tokenizer, changed)
    with torch.no_grad():
        (before,) = segment_scores(sprm, head, [(ids, mask, turns)], tokenizer.pad_token_id)
        (after,) = segment_scores(sprm, head, [(ids2, mask2, turns)], tokenizer.pad_token_id)
    assert before.shape == (m,)
    assert torch.allclose(before[:-1], after[:-1], atol=1e-5)
    assert not torch.allclose(before[-1], after[-1])


def test_too_long_transcripts_are_read_from_a_suffix(tiny):
    args, model, tokenizer, trajs = tiny
    sprm, head = random_sprm(model)
    whole = copy.deepcopy(trajs)
    score_segments(args, sprm, head, tokenizer, whole)
    for t in whole:
        assert len(t["seg_rewards"]) == max(t["seg_ids"]) + 1
    args2 = Args(max_episode_steps=8, segmenter="turns")
    lengths = [len(encode_transcript(args2, tokenizer, t)[0]) for t in trajs]
    limited = Args(max_episode_steps=8, segmenter="turns", aux_max_tokens=max(lengths) - 1)
    cut_trajs = copy.deepcopy(trajs)
    assert score_segments(limited, sprm, head, tokenizer, cut_trajs) == 1
    longest = max(range(len(trajs)), key=lambda i: lengths[i])
    ids, _, first_turn = encode_transcript(limited, tokenizer, trajs[longest])
    assert first_turn >= 1 and len(ids) <= limited.aux_max_tokens
    rewards = cut_trajs[longest]["seg_rewards"]
    assert rewards[:first_turn] == [0.0] * first_turn
    assert len(rewards) == len(trajs[longest]["steps"])
    assert any(r != 0 for r in rewards[first_turn:])


def test_too_long_cloze_inputs_drop_the_farthest_turns(tiny):
    args, _, tokenizer, trajs = tiny
    traj = max(trajs, key=lambda t: len(t["steps"]))
    replies = tokenizer.batch_decode([s["response_ids"] for s in traj["steps"]],
                                     skip_special_tokens=True)
    full, cut = encode_cloze(args, tokenizer, traj, replies, 1)
    assert not cut
    target = len(traj["steps"][1]["response_ids"])
    limited = Args(aux_max_tokens=len(full) + target - 1)
    shorter, cut = encode_cloze(limited, tokenizer, traj, replies, 1)
    assert cut and len(shorter) + target <= limited.aux_max_tokens
    # one whole turn went, the last one (after k first): its reply and observation
    assert tokenizer.decode(shorter).count("observation") == (
        tokenizer.decode(full).count("observation") - 1)
    last = cloze_messages(traj, replies, 1, range(len(traj["steps"]) - 1), cloze_texts(limited))
    text = tokenizer.apply_chat_template(last, tokenize=False, add_generation_prompt=True)
    assert shorter == tokenizer(text, add_special_tokens=False).input_ids


def test_hindsight_scores_every_reply_token(tiny):
    args, model, tokenizer, trajs = tiny
    trajs = copy.deepcopy(trajs)
    assert score_hindsight(args, model, tokenizer, trajs) == 0
    traj = trajs[0]
    replies = tokenizer.batch_decode([s["response_ids"] for s in traj["steps"]],
                                     skip_special_tokens=True)
    for k, step in enumerate(traj["steps"]):
        assert step["hind_logprobs"].shape == (len(step["response_ids"]),)
    prompt, _ = encode_cloze(args, tokenizer, traj, replies, 2)
    with torch.no_grad():
        logp, _, _ = response_logprobs(model, [prompt], [traj["steps"][2]["response_ids"]],
                                       tokenizer.pad_token_id)
    assert torch.allclose(traj["steps"][2]["hind_logprobs"], logp[0], atol=1e-5)


def test_without_hindsight_the_hindsight_logprobs_are_the_policys(tiny):
    """w/o HIM no hindsight model is read: log pi_hind = log pi_old, so every z = 1; RL reads one
    segment a turn with --segmenter turns."""
    args, model, tokenizer, trajs = tiny
    trajs = copy.deepcopy(trajs)
    for t in trajs:
        for s in t["steps"]:
            s["old_logprobs"] = torch.randn(len(s["response_ids"]))
    sprm, head = random_sprm(model)
    turns = replace(args, use_hindsight=False, segmenter="turns")
    score_reward_models(turns, sprm, head, None, tokenizer, trajs)
    for t in trajs:
        assert t["seg_ids"] == list(range(len(t["steps"])))
        assert all(torch.equal(s["hind_logprobs"], s["old_logprobs"]) for s in t["steps"])


def test_the_collection_filter():
    """Dropped: a malformed reply, or one repeating itself; a failure that loops is kept (the
    paper keeps 92.7 % of its rollouts)."""
    def traj(actions_feedback, well_formed=True):
        return {"steps": [{"action": a, "next_state": f, "well_formed": well_formed}
                          for a, f in actions_feedback]}

    def replies(t):
        return [f"<action>{s['action']}</action>" for s in t["steps"]]
    ok = traj([("look", "x"), ("go to desk 1", "y"), ("look", "x")])
    loop = traj([("a", "b"), ("look", "x"), ("look", "x"), ("look", "x")])
    almost = traj([("look", "x"), ("look", "x"), ("look", "z")])
    malformed = traj([("look", "x")], well_formed=False)
    for t in (ok, loop, almost):
        assert keep_for_training(t, replies(t))
    assert not keep_for_training(malformed, replies(malformed))
    babble = ["<action>look</action>", "<action>go to go to go to desk 1</action>",
              "<action>look</action>"]
    assert not keep_for_training(ok, babble)


def test_a_reply_repeating_itself():
    """A piece of 3+ characters, from a letter or digit, 3 times in a row, only punctuation or
    white space between."""
    assert repeats_itself("look look look")
    assert repeats_itself("<action>go to go to go to</action>")
    assert repeats_itself("go to cabinet 1, go to cabinet 1, go to cabinet 1")
    assert repeats_itself("Step 1.\nStep 1.   Step 1.")
    assert repeats_itself("hmm hmm hmm")
    assert not repeats_itself("<action>go to desk 1</action>")
    assert not repeats_itself("<action>open drawer 11</action>")  # "1" x 2: too short
    assert not repeats_itself("look look")  # twice is not degenerate
    assert not repeats_itself("Step 1. Step 2. Step 3.")
    assert not repeats_itself("")


def test_segmenters(tiny):
    _, _, _, trajs = tiny
    traj = max(trajs, key=lambda t: len(t["steps"]))
    m = len(traj["steps"])
    assert trajectory_segments(Args(segmenter="turns"), traj) == list(range(m))
    events = trajectory_segments(Args(), traj)
    assert events[0] == 0 and all(b - a in (0, 1) for a, b in zip(events, events[1:]))


def test_saved_reward_models_load_back_to_the_same_scores(tiny, tmp_path):
    from hisr import auxiliary_copy

    args, model, tokenizer, trajs = tiny
    sprm = auxiliary_copy(model)
    hindsight = auxiliary_copy(model)
    torch.manual_seed(2)
    for p in [*sprm.parameters(), *hindsight.parameters()]:
        if p.requires_grad:
            p.data.add_(torch.randn_like(p) * 0.05)
    _, head = random_sprm(model)
    before = copy.deepcopy(trajs)
    score_segments(args, sprm, head, tokenizer, before)
    score_hindsight(args, hindsight, tokenizer, before)
    save_reward_models(str(tmp_path), sprm, head, hindsight, args)
    for other in (replace(args, segmenter="turns"), replace(args, collect_filter="none")):
        with pytest.raises(UsageError, match="were trained with"):
            load_reward_models(other, model, str(tmp_path))
    sprm2, head2, hindsight2 = load_reward_models(args, model, str(tmp_path))
    assert not any(p.requires_grad for p in [*sprm2.parameters(), *hindsight2.parameters()])
    after = copy.deepcopy(trajs)
    score_segments(args, sprm2, head2, tokenizer, after)
    score_hindsight(args, hindsight2, tokenizer, after)
    for a, b in zip(before, after):
        assert a["seg_rewards"] == pytest.approx(b["seg_rewards"], abs=1e-6)
        for s, t in zip(a["steps"], b["steps"]):
            assert torch.allclose(s["hind_logprobs"], t["hind_logprobs"], atol=1e-6)
    start = [p.clone() for p in model.parameters()]
    assert all(torch.equal(p, q) for p, q in zip(start, model.parameters()))  # untouched
    # Saved before issue 44 without the admissible actions in the cloze: refused, not misread.
    reading = tmp_path / "reading.json"
    reading.write_text(json.dumps({**json.loads(reading.read_text()),
                                   "hindsight_admissible": False}))
    with pytest.raises(UsageError, match="--no-hindsight-admissible .removed; docs/hisr.md"):
        load_reward_models(args, model, str(tmp_path))


def test_the_update_is_spas_text():
    """The PPO update with its critic is spa.py's (whose data-parallel test covers it); that
    rollouts, BC and evaluation are proxmo.py's text is test_proxmo_harness.py's."""
    import inspect

    import hisr
    import spa

    for name in ("policy_update", "score_rollouts", "policy_forward", "value_loss", "policy_ratio",
                 "final_hidden_states", "make_head", "StepSample"):
        a, b = inspect.getsource(getattr(hisr, name)), inspect.getsource(getattr(spa, name))
        assert a == b.replace("spa.py", "hisr.py"), name


def test_sprm_micro_batches_give_the_batch_update(tiny):
    """Eq. 3's batch mean taken in micro-batches of 2 gives the update of one pass over 4."""
    args, model, tokenizer, trajs = tiny
    trajs = copy.deepcopy(trajs)
    for t in trajs:
        t["seg_ids"] = trajectory_segments(args, t)
    trained = []
    for micro in (4, 2):
        sprm, head = random_sprm(model)
        sprm.requires_grad_(True)
        run_args = Args(max_episode_steps=8, sprm_batch_size=4, sprm_epochs=1,
                        micro_batch_size=micro, sprm_learning_rate=1e-2)
        train, heldout = split_heldout(trajs, 0.0, random.Random(0))
        train_sprm(run_args, sprm, head, tokenizer, trajs, train, heldout,
                   random.Random(1))
        trained.append(head.w1.weight.clone())
    assert not torch.equal(trained[0], random_sprm(model)[1].w1.weight)  # it moved
    assert torch.allclose(trained[0], trained[1], atol=1e-5)
