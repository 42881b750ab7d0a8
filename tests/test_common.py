"""common/: model resolution and loading, the tiny tokenizer, LoRA round trips, generation,
log-probabilities, env batching; and the action parser of the scripts."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import common.model
import envs
from common import RunStopped, UsageError, error_line
from common.envbatch import EnvBatch
from common.generation import hf_generate
from common.model import (add_lora, eos_token_ids, load_lora,
                          load_model_and_tokenizer, merge_lora, next_token_losses,
                          pad_prompt_response, resolve_model_name, response_logprobs,
                          scored_logprobs)
from envs.text import PROMPT_WORDS, is_well_formed, parse_action

VOCAB = envs.vocabulary("household") + PROMPT_WORDS


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny-scratch", vocabulary=VOCAB, seed=0)


def test_model_name_resolution(tmp_path):
    assert resolve_model_name("Qwen2.5-1.5B-Instruct") == ["Qwen/Qwen2.5-1.5B-Instruct"]
    assert resolve_model_name("meta-llama/Llama-3.2-1B") == ["meta-llama/Llama-3.2-1B"]
    assert resolve_model_name(str(tmp_path)) == [str(tmp_path)]


def test_unknown_model_fails_with_what_was_tried():
    with pytest.raises(UsageError) as err:
        load_model_and_tokenizer("Qwen-does-not-exist-0B")
    message = str(err.value)
    assert "Qwen/Qwen-does-not-exist-0B" in message and "Tried" in message


def test_tiny_tokenizer_round_trip_and_chat_template(tiny):
    _, tok = tiny
    text = "<action> take apple 1 from countertop 2 </action>"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    # Word level: the "countertop" of an entity is the same token as in a goal sentence.
    ids_of = lambda t: tok(t, add_special_tokens=False).input_ids
    assert ids_of("countertop 2") == ids_of("countertop") + ids_of("2")
    chat = tok.apply_chat_template([{"role": "user",
                                     "content": "Your task is to: put a mug in desk."}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat.startswith("<|im_start|>user\n") and chat.endswith("<|im_start|>assistant\n")
    assert tok.unk_token_id not in tok(chat, add_special_tokens=False).input_ids


def test_tiny_scratch_model_is_deterministic_per_seed():
    a, _ = load_model_and_tokenizer("tiny-scratch", vocabulary=VOCAB, seed=3)
    b, _ = load_model_and_tokenizer("tiny-scratch", vocabulary=VOCAB, seed=3)
    c, _ = load_model_and_tokenizer("tiny-scratch", vocabulary=VOCAB, seed=4)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_local_directory_loads_the_same_model(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_model_and_tokenizer(str(tmp_path))
    ids = torch.tensor([tok("you arrive at desk 1 .").input_ids])
    assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-6)
    assert tok2.decode(ids[0]) == tok.decode(ids[0])
    message = [{"role": "user", "content": "nothing happens ."}]
    assert tok2.apply_chat_template(message, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(message, add_generation_prompt=True, tokenize=False)


def test_lora_save_load_and_merge(tiny, tmp_path):
    base, tok = tiny
    ids = torch.tensor([tok("you open the drawer 2 .").input_ids])
    reference = base(ids).logits
    model = add_lora(base, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for p in trainable:
            p.add_(0.05)
    tuned = model(ids).logits
    assert not torch.allclose(tuned, reference)
    with model.disable_adapter():
        assert torch.allclose(model(ids).logits, reference, atol=1e-6)
    model.save_pretrained(tmp_path)
    fresh, _ = load_model_and_tokenizer("tiny-scratch", vocabulary=VOCAB, seed=0)
    reloaded = load_lora(fresh, str(tmp_path))
    assert torch.allclose(reloaded(ids).logits, tuned, atol=1e-5)
    merged = merge_lora(reloaded)
    assert torch.allclose(merged(ids).logits, tuned, atol=1e-5)
    with pytest.raises(UsageError):
        load_lora(fresh, str(tmp_path / "missing"))
    with open(tmp_path / "adapter_model.safetensors", "wb") as f:  # damaged: one line names it
        f.write(b"not a safetensors file")
    with pytest.raises(UsageError, match=r"adapter at .* cannot be loaded \((\w+Error): .+\)$"):
        load_lora(fresh, str(tmp_path))


def test_a_library_error_is_one_line_of_ours():
    assert error_line(OSError("no such file\n  more detail")) == "OSError: no such file"
    assert error_line(KeyError(), "optimizer") == "KeyError: optimizer"
    assert error_line(ValueError("")) == "ValueError: "


def test_response_logprobs_match_an_unpadded_forward(tiny):
    model, _ = tiny
    prompts, responses = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14]]
    logp, mask, _ = response_logprobs(model, prompts, responses, pad_id=0)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        full = torch.log_softmax(model(torch.tensor([p + r])).logits[0].float(), -1)
        expected = [full[len(p) - 1 + k, t].item() for k, t in enumerate(r)]
        assert torch.allclose(logp[i, :len(r)], torch.tensor(expected), atol=1e-5)


def test_response_logprobs_at_a_temperature_are_those_of_the_tempered_policy(tiny):
    model, _ = tiny
    prompt, response = [5, 6, 7], [8, 9]
    logp, _, _ = response_logprobs(model, [prompt], [response], pad_id=0, temperature=0.5)
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    tempered = torch.log_softmax(logits * 2.0, -1)  # logits / 0.5
    expected = [tempered[2, 8].item(), tempered[3, 9].item()]
    assert torch.allclose(logp[0], torch.tensor(expected), atol=1e-5)
    assert not torch.allclose(logp[0], torch.log_softmax(logits, -1)[[2, 3], [8, 9]], atol=1e-3)


def test_scored_logprobs_are_response_logprobs_in_input_order_without_grad(tiny):
    """Micro-batches of 2 sorted by length give each response's rows of one padded pass, trimmed
    to its length, back in the input order."""
    model, _ = tiny
    prompts, responses = [[5, 6, 7, 8], [9], [10, 11]], [[12, 13, 14], [15], [16, 17]]
    scored = scored_logprobs(model, prompts, responses, pad_id=0, micro_batch_size=2,
                             temperature=0.5)
    assert [len(r) for r in scored] == [3, 1, 2] and not any(r.requires_grad for r in scored)
    for p, r, row in zip(prompts, responses, scored):
        alone, _, _ = response_logprobs(model, [p], [r], pad_id=0, temperature=0.5)
        assert torch.allclose(row, alone[0], atol=1e-5)


def test_next_token_losses_split_one_forward_at_the_response(tiny):
    """The response loss is the mean NLL of the response tokens; the prompt loss that of every
    prompt token after the first, worked out from an unpadded forward per pair."""
    model, _ = tiny
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12]]
    response_loss, prompt_loss = next_token_losses(model, prompts, responses, pad_id=0)
    response_nll, prompt_nll = [], []
    for p, r in zip(prompts, responses):
        ids = p + r
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        nll = [-logp[j - 1, ids[j]].item() for j in range(1, len(ids))]
        prompt_nll += nll[:len(p) - 1]
        response_nll += nll[len(p) - 1:]
    assert response_loss.item() == pytest.approx(sum(response_nll) / 3, abs=1e-5)
    assert prompt_loss.item() == pytest.approx(sum(prompt_nll) / 3, abs=1e-5)


def test_noisy_expert_labels_the_experts_step_and_sometimes_executes_a_mistake():
    """noise 0: the expert's own command; noise 1: the previous command or a random admissible
    one, the label still the expert's; an expert that gave up only looks around."""
    import random

    game = envs.make_game("household", envs.list_tasks("household", "train")[0], 30, expert=True)
    game.reset()
    expert = game.expert_action()
    assert envs.noisy_expert(game, [], 0.0, random.Random(0)) == (expert, expert)
    history = [("an observation", "the previous command")]
    commands = {envs.noisy_expert(game, history, 1.0, random.Random(k))[1] for k in range(40)}
    assert "the previous command" in commands
    assert commands - {"the previous command"} <= set(game.admissible_actions())
    assert len(commands) > 2
    assert {envs.noisy_expert(game, history, 1.0, random.Random(k))[0]
            for k in range(40)} == {expert}
    game.expert_action = lambda: None  # gave up
    assert envs.noisy_expert(game, history, 1.0, random.Random(0)) == (None, "look")


def _rows_through(model):
    """A list that collects the batch size of every forward pass of `model`, and the hook's
    handle."""
    rows = []
    handle = model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: rows.append(output.shape[0]))
    return rows, handle


def test_response_logprobs_score_a_repeated_pair_once(tiny):
    """Pair 0 and pair 2 are the same: one forward row, two equal output rows, and the gradient
    of a weighted sum is the one of three separate forwards."""
    model, _ = tiny
    prompts, responses = [[5, 6, 7], [9, 10], [5, 6, 7]], [[11, 12], [14], [11, 12]]
    rows, handle = _rows_through(model)
    try:
        logp, mask, entropy = response_logprobs(model, prompts, responses, pad_id=0,
                                                with_entropy=True)
    finally:
        handle.remove()
    assert rows == [2]
    assert mask.tolist() == [[1, 1], [1, 0], [1, 1]]
    assert torch.equal(logp[0], logp[2]) and torch.equal(entropy[0], entropy[2])
    single = [response_logprobs(model, [p], [r], pad_id=0)[0][0]
              for p, r in zip(prompts, responses)]
    for i, r in enumerate(responses):
        assert torch.allclose(logp[i, :len(r)], single[i], atol=1e-5)

    weights = torch.tensor([[1.0], [2.0], [3.0]])
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    (response_logprobs(model, prompts, responses, pad_id=0)[0] * mask * weights).sum().backward()
    together = [p.grad.clone() for p in params]
    model.zero_grad()
    for i, (p, r) in enumerate(zip(prompts, responses)):
        (response_logprobs(model, [p], [r], pad_id=0)[0] * weights[i]).sum().backward()
    # float32 sums in another order: up to 9e-6 apart (gradients up to 15), once just past 1e-5
    assert all(torch.allclose(a, p.grad, atol=1e-4) for a, p in zip(together, params))
    model.zero_grad()


def test_hf_generate_prefills_each_distinct_prompt_once(tiny, monkeypatch):
    """Prompts of several lengths, repeated, one of a single token, in prefill batches of 2
    rows: the replies, greedy and sampled with one seed, and the recorded log-probs are those of
    generate() on the whole left-padded batch; the prefill passes hold each distinct prompt once;
    the decoding steps' one thread is given back."""
    import common.generation as generation

    model, tok = tiny
    kitchen = tok("you are in the middle of a kitchen .").input_ids
    nothing = tok("nothing happens .").input_ids
    desk = tok("you arrive at desk 1 . on the desk 1 , you see a mug 1 .").input_ids
    prompts = [kitchen, nothing, kitchen, desk, [kitchen[0]], nothing, kitchen]
    monkeypatch.setattr(generation, "PREFILL_ROWS", 2)
    eos = [tok.eos_token_id]
    threads = torch.get_num_threads()

    def plain_generate(temperature):
        width = max(len(p) for p in prompts)
        ids, mask = pad_prompt_response(prompts, [[]] * len(prompts), tok.pad_token_id)[:2]
        config = generation.sampling_config(temperature=temperature, top_p=1.0,
                                            max_new_tokens=6, eos_ids=eos,
                                            pad_id=tok.pad_token_id)
        recorder = generation.SampledLogprobs(temperature) if temperature > 0 else None
        with torch.no_grad(), generation._without_checkpoint_generation_config(model):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 logits_processor=[recorder] if recorder else None)
        new = out[:, width:]
        cuts = [generation._through_first_eos(row, eos) for row in new.tolist()]
        replies = [row[:cut] for row, cut in zip(new.tolist(), cuts)]
        if recorder is None:
            return replies, None
        chosen = recorder.finish(new)
        return replies, [chosen[k, :cut] for k, cut in enumerate(cuts)]

    rows, handle = _rows_through(model)
    try:
        greedy = hf_generate(model, prompts, pad_id=tok.pad_token_id, eos_ids=eos,
                             max_new_tokens=6, temperature=0.0)
    finally:
        handle.remove()
    # prefill: 3 distinct prompts with more than one token, in batches of 2; then the decoding
    # steps, each over all 7 rows
    assert rows[:2] == [2, 1] and set(rows[2:]) == {7}
    assert greedy == plain_generate(0.0)[0]
    assert hf_generate(model, prompts, pad_id=tok.pad_token_id, eos_ids=eos, max_new_tokens=6,
                       temperature=0.0, batch_size=3) == greedy
    torch.manual_seed(3)
    sampled, recorded = hf_generate(model, prompts, pad_id=tok.pad_token_id, eos_ids=eos,
                                    max_new_tokens=6, temperature=1.0, return_logprobs=True)
    torch.manual_seed(3)
    expected, expected_logp = plain_generate(1.0)
    assert sampled == expected
    for got, want in zip(recorded, expected_logp):
        assert torch.allclose(torch.tensor(got), want, atol=1e-5)
    assert torch.get_num_threads() == threads


def test_pad_prompt_response_layout():
    ids, attention, positions, targets, mask = pad_prompt_response([[1, 2], [3]], [[4], [5, 6]],
                                                                   pad_id=0)
    assert ids.tolist() == [[1, 2, 4, 0], [0, 3, 5, 6]]
    assert attention.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 2], [0, 0, 1, 2]]
    assert targets.tolist() == [[4, 0], [5, 6]] and mask.tolist() == [[1, 0], [1, 1]]


def test_hf_generate_greedy_is_deterministic_and_cut_at_eos(tiny):
    model, tok = tiny
    prompts = [tok("you are in the middle of a kitchen .").input_ids,
               tok("nothing happens .").input_ids]
    a = hf_generate(model, prompts, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id],
                    max_new_tokens=6, temperature=0.0)
    b = hf_generate(model, prompts[:1], pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id],
                    max_new_tokens=6, temperature=0.0)
    assert a[0] == b[0] and 1 <= len(a[0]) <= 6
    torch.manual_seed(0)
    s1 = hf_generate(model, prompts, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id],
                     max_new_tokens=6, temperature=1.0)
    torch.manual_seed(0)
    s2 = hf_generate(model, prompts, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id],
                     max_new_tokens=6, temperature=1.0)
    assert s1 == s2
    # A token chosen as eos ends the response right after it.
    eos = a[0][0]
    cut = hf_generate(model, prompts[:1], pad_id=tok.pad_token_id, eos_ids=[eos], max_new_tokens=6,
                      temperature=0.0)
    assert cut == [[eos]]


def test_sampling_ignores_the_checkpoint_generation_config(tiny):
    """A checkpoint's generation_config (Qwen2.5-Instruct ships repetition_penalty, top_k, top_p,
    temperature) must not act during rollouts. The log-probs recorded while sampling equal the
    log-probs PPO scores the same tokens with, softmax(logits / T) (so no penalty or suppression
    acted, and the recorder sees the logits it assumes), and a leaked top_k=1 / top_p=0.01 would
    make every sample of one prompt the greedy one."""
    model, tok = tiny
    saved = model.generation_config
    model.generation_config = type(saved)(repetition_penalty=3.0, top_k=1, top_p=0.01,
                                          temperature=0.2, no_repeat_ngram_size=1,
                                          suppress_tokens=list(range(10, 400)), do_sample=True)
    prompt = tok("you arrive at desk 1 . on the desk 1 , you see a mug 1 .").input_ids
    try:
        prompts = [prompt, tok("nothing happens .").input_ids]
        torch.manual_seed(0)
        responses, sampled_logp = hf_generate(model, prompts, pad_id=tok.pad_token_id,
                                              eos_ids=[tok.eos_token_id], max_new_tokens=8,
                                              temperature=0.7, return_logprobs=True)
        torch.manual_seed(0)
        again = hf_generate(model, prompts, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id],
                            max_new_tokens=8, temperature=0.7)
        copies = hf_generate(model, [prompt] * 16, pad_id=tok.pad_token_id,
                             eos_ids=[tok.eos_token_id], max_new_tokens=8, temperature=1.0)
    finally:
        model.generation_config = saved
    assert again == responses and all(len(r) == len(lp) for r, lp in zip(responses, sampled_logp))
    # the random model rarely says eos: 8 steps recorded
    assert max(len(r) for r in responses) == 8
    logp, _, _ = response_logprobs(model, prompts, responses, pad_id=tok.pad_token_id,
                                   temperature=0.7)
    for i, r in enumerate(responses):
        assert torch.allclose(logp[i, :len(r)], torch.tensor(sampled_logp[i]), atol=1e-4)
    assert len({tuple(c) for c in copies}) > 8


def test_recorded_logprobs_need_plain_sampling(tiny):
    model, tok = tiny
    for temperature, top_p in ((0.0, 1.0), (1.0, 0.9)):
        with pytest.raises(ValueError, match="return_logprobs"):
            hf_generate(model, [[5, 6]], pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id],
                        max_new_tokens=2, temperature=temperature, top_p=top_p,
                        return_logprobs=True)


def test_eos_ids_are_the_tokenizer_and_generation_config_union(tiny):
    model, tok = tiny
    saved = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = [5, tok.eos_token_id, 6]  # Qwen2.5 lists two
        assert eos_token_ids(model, tok) == [tok.eos_token_id, 5, 6]
        model.generation_config.eos_token_id = 7
        assert eos_token_ids(model, tok) == [tok.eos_token_id, 7]
        model.generation_config.eos_token_id = None
        assert eos_token_ids(model, tok) == [tok.eos_token_id]
    finally:
        model.generation_config.eos_token_id = saved


def test_unreachable_hub_fails_fast_with_a_hint(monkeypatch):
    monkeypatch.setattr(common.model, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(UsageError) as err:
        load_model_and_tokenizer("Qwen/Qwen-no-such-model-0B")
    assert "hub is unreachable" in str(err.value) and "local directory" in str(err.value)


def test_a_hub_id_without_network_fails_within_seconds():
    """Without HF_HUB_OFFLINE, where the hub cannot be reached (as in CI) or does not know the
    model, loading stops in seconds instead of retrying for a minute."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = ("from common.model import load_model_and_tokenizer as f; "
            "f('Qwen/Qwen-no-such-model-0B')")
    t0 = time.time()
    result = subprocess.run([sys.executable, "-c", code],
                            cwd=os.path.dirname(os.path.dirname(__file__)), env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "cannot load model" in result.stderr
    assert time.time() - t0 < 30 and "Retrying" not in result.stderr


def test_env_batch_steps_only_running_games():
    tasks = envs.list_tasks("household", "train", 2)
    batch = EnvBatch([envs.make_game("household", t, max_steps=2) for t in tasks])
    assert len(batch.reset()) == 2 and batch.active() == [0, 1]
    batch.step({0: "look", 1: "look"})
    results = batch.step({0: "look", 1: "fly"})
    assert results[1][3]["valid"] is False and batch.active() == []
    with pytest.raises(ValueError):
        batch.step({0: "look"})


def _play_household(workers: int) -> list:
    """Three household games (one more than the workers) in lock-step, the expert acting."""
    tasks = envs.list_tasks("household", "train", 3)
    games = [envs.make_game("household", t, max_steps=6, workers=workers) for t in tasks]
    batch = EnvBatch(games)
    log = [batch.reset(), [(g.task_type, g.task_description) for g in games]]
    while batch.active():
        actions = {i: games[i].expert_action() or "look" for i in batch.active()}
        results = batch.step(actions)
        log.append(sorted((i, r, games[i].admissible_actions(), games[i].steps)
                          for i, r in results.items()))
    return log + [batch.won]


def test_games_in_worker_processes_play_as_in_this_one():
    """Games made with workers=2 (three games, so one worker hosts two and answers interleave)
    give the same observations, rewards, admissible commands and expert actions."""
    assert _play_household(2) == _play_household(0)


def test_a_remote_game_snapshots_and_restores_as_a_local_one():
    """After snapshot() (which changes nothing) the cached admissible commands stay; restore()
    brings back the saved state."""
    task = envs.list_tasks("household", "train", 1)[0]
    seen = []
    for workers in (0, 1):
        game = envs.make_game("household", task, max_steps=6, workers=workers)
        game.reset()
        game.step(game.expert_action())
        saved = game.snapshot()
        after_snapshot = game.admissible_actions()
        game.step("look")
        game.restore(saved)
        seen.append((after_snapshot, game.admissible_actions(), game.steps, game.expert_action()))
    assert seen[0] == seen[1] and seen[0][0] and seen[0][2] == 1


def test_a_tasks_copies_made_in_a_row_share_a_worker():
    """A group's copies of a task (or an evaluation's draws of a game) go to one worker, where its
    caches serve them; the tasks go to the workers in turn."""
    from common.envbatch import WorkerPool

    a, b, c = envs.list_tasks("household", "train", 3)
    pool = WorkerPool(2, envs.make_game)
    try:
        games = [pool.make("household", task, 5) for task in (a, a, a, b, b, c, a)]
        assert [game.worker for game in games] == [0, 0, 0, 1, 1, 0, 1]
        games[4].reset()  # a game made there plays there
        assert games[4].admissible_actions()
    finally:
        pool.close()


def test_a_dead_or_failing_env_worker_is_a_clear_error():
    from common.envbatch import WorkerPool

    pool = WorkerPool(1, envs.make_game)
    try:
        game = pool.make("household", envs.list_tasks("household", "train", 1)[0], 1)
        game.reset()
        game.step("look")
        with pytest.raises(RuntimeError, match="(?s)env worker 0 raised:.*finished game"):
            game.step("look")  # a finished game: the worker answers with the traceback
        pool.processes[0].kill()
        pool.processes[0].join()
        with pytest.raises(RunStopped, match=r"env worker 0 died \(exit code -9\).*resumes it"):
            game.reset()
    finally:
        pool.close()
    assert pool.processes == []


def test_a_hung_env_worker_stops_the_run_naming_its_game(monkeypatch):
    """A worker that stops answering (SIGSTOP, as a game whose engine loops): after the request
    timeout the run stops (RunStopped: exit status 1, resumable), naming the game; the worker is
    killed, not left behind."""
    import signal

    from common import envbatch
    from common.envbatch import WorkerPool

    monkeypatch.setattr(envbatch, "REQUEST_TIMEOUT_SECONDS", 2.0)
    pool = WorkerPool(1, envs.make_game)
    try:
        task = envs.list_tasks("household", "train", 1)[0]
        game = pool.make("household", task, 5)
        game.reset()
        os.kill(pool.processes[0].pid, signal.SIGSTOP)
        started = time.time()
        with pytest.raises(RunStopped, match=r"no answer in 2 s \(waiting on household .*hung"):
            game.step("look")
        assert time.time() - started < 10
        pool.processes[0].join(timeout=5)
        assert not pool.processes[0].is_alive()
    finally:
        pool.close()


@pytest.mark.parametrize("reply, action", [
    ("<action>go to desk 1</action>", "go to desk 1"),
    ("<think>the mug is here</think> <action> Take Mug 1 from Desk 1 </action>",
     "take mug 1 from desk 1"),
    ('<action>"open drawer 2"</action>', "open drawer 2"),
    ("<action>look</action> then <action>inventory</action>", "inventory"),
    ("go to desk 1", None),
    ("<action></action>", None),
    ("<action>go to", None),
])
def test_parse_action(reply, action):
    assert parse_action(reply) == action


@pytest.mark.parametrize("reply, reasoning, well_formed", [
    ("<action>go to desk 1</action>", False, True),
    # inadmissible, still well formed
    ("<action>take unicorn 9 from moon 1</action>", False, True),
    ("go to desk 1", False, False),
    ("<action></action>", False, False),
    ("<action>go to desk 1</action>", True, False),  # --reasoning asks for <think> too
    ("<think>the mug is on the desk</think><action>go to desk 1</action>", True, True),
    ("<think>unclosed <action>go to desk 1</action>", True, False),
    ("<action>go to desk 1</action> \u684c\u5b50", False, False),  # Chinese characters
])
def test_is_well_formed(reply, reasoning, well_formed):
    assert is_well_formed(reply, reasoning) is well_formed


def test_ranges_read_as_in_mathematics():
    from common.config import in_range

    assert in_range(0, "in [0, 1)") and not in_range(1, "in [0, 1)")
    assert not in_range(0, "in (0, 1]") and in_range(1, "in (0, 1]")
    assert in_range(2**32 - 1, "in [0, 2**32)") and not in_range(2**32, "in [0, 2**32)")
    assert in_range(0, ">= 0 (0 = the whole split)") and not in_range(-1, ">= 0 (0 = greedy)")
    assert not in_range(0, "> 0: a hint") and in_range(1e-9, "> 0")
    assert in_range(0.5, "in [0, 0.5]") and not in_range(0.51, "in [0, 0.5]")
    with pytest.raises(ValueError, match="not '<= 10'"):  # never read as something else
        in_range(5, "<= 10")


def test_vllm_lora_ranks_are_checked_before_any_work():
    """vLLM serves only the ranks of its MaxLoRARanks: another --lora-r with --backend vllm is a
    usage error at once (not a pydantic error after loading and behavior cloning)."""
    from dataclasses import replace

    import proxmo
    from common.config import errors

    def lora_errors(**changes):
        return [e for e in errors(replace(proxmo.preset_args(), **changes), {}) if "--lora-r" in e]

    assert lora_errors(backend="vllm", lora_r=16) == []
    assert lora_errors(backend="hf", lora_r=4) == []
    assert lora_errors(backend="vllm", lora_r=4) == [
        "--lora-r 4: vLLM serves LoRA ranks 1, 8, 16, 32, 64, 128, 256, 320, 512 only; pick one "
        "of them, or --backend hf"]


def test_processes_wait_for_each_other_as_long_as_the_flag_says(monkeypatch):
    """The process group is created with --process-timeout-minutes (torch's NCCL default is 10
    minutes, shorter than one process's share of a long evaluation), gloo on CPU."""
    import datetime

    import common.dist
    import proxmo

    made = []
    monkeypatch.setattr(common.dist, "PartialState", lambda **kwargs: made.append(kwargs))
    common.dist.start_processes(proxmo.preset_args())
    assert made == [{"cpu": True, "timeout": datetime.timedelta(hours=2)}]


def test_nested_timers_count_each_second_on_one_clock(monkeypatch):
    """An outer timer's clock leaves out the seconds of the timers inside it; a block that
    raises is still timed; timings() reads the clocks out once."""
    import types

    import common.run

    ticks = iter([0.0, 1.0, 4.0, 10.0, 10.0, 12.0, 20.0, 20.5])
    clock = types.SimpleNamespace(perf_counter=lambda: next(ticks))
    monkeypatch.setattr(common.run, "time", clock)
    common.run.timings()  # clocks that earlier tests started
    with common.run.timer("update"):  # 0 -> 10, of which 1 -> 4 inside
        with common.run.timer("old_logprobs"):
            pass
    with common.run.timer("old_logprobs"):  # 10 -> 12
        pass
    with pytest.raises(KeyError), common.run.timer("env"):  # 20 -> 20.5
        raise KeyError("a failing step")
    assert common.run.timings() == {"time/update_seconds": 7.0, "time/old_logprobs_seconds": 5.0,
                                    "time/env_seconds": 0.5}
    assert common.run.timings() == {}


def test_try_lock_holds_a_directory_once_and_locks_nothing_without_fcntl(tmp_path, monkeypatch):
    import common.run

    held = common.run.try_lock(str(tmp_path))
    assert held is not None and common.run.try_lock(str(tmp_path)) is None
    os.close(held)
    again = common.run.try_lock(str(tmp_path))  # let go: the next one holds it
    assert again is not None
    os.close(again)
    monkeypatch.setattr(common.run, "fcntl", None)  # not POSIX: nothing is locked, no error
    first, second = common.run.try_lock(str(tmp_path)), common.run.try_lock(str(tmp_path))
    assert first is not None and second is not None
    os.close(first)
    os.close(second)
    assert os.listdir(tmp_path) == []


def test_rollout_stats_by_hand():
    """Two groups of two: group 0 won once (mixed), group 1 never (all lost); 5 steps, 3 of them
    admissible; advantages |0.5|, |-0.5|, 0, 0, |1|."""
    from common.run import rollout_stats

    def trajectory(group, won, valid):
        return {"group": group, "won": won,
                "steps": [{"valid": v, "well_formed": True} for v in valid]}

    batch = [trajectory(0, True, [True]), trajectory(0, False, [True, False]),
             trajectory(1, False, [False]), trajectory(1, False, [True])]
    stats = rollout_stats(batch, [[0.5], [-0.5, 0.0], [0.0], [1.0]])
    assert stats == {"rollout/success": 0.25, "rollout/mixed_groups": 0.5,
                     "rollout/grounding": 0.6, "rollout/well_formed": 1.0,
                     "rollout/episode_length": 1.25, "rollout/step_samples": 5,
                     "train/advantage_abs_mean": 0.4}


def test_a_sealed_folder_or_file_names_what_changed(tmp_path):
    """seal / seal_errors, which SPA's exploration rollouts and progress model and HISR's reward
    models are checked by on --resume: nothing to say as saved or unsealed; a changed, missing or
    added file named."""
    from common.run import seal, seal_errors

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "head.pt").write_bytes(b"abc")
    (folder / "model.pt").write_bytes(b"def")
    lone = tmp_path / "rollouts.pt"
    lone.write_bytes(b"123")
    assert seal_errors(str(folder)) == [] and seal_errors(str(lone)) == []  # not sealed yet
    seal(str(folder))
    seal(str(lone))
    assert seal_errors(str(folder)) == [] and seal_errors(str(lone)) == []
    (folder / "head.pt").write_bytes(b"abd")
    (folder / "extra.pt").write_bytes(b"")
    os.remove(folder / "model.pt")
    assert seal_errors(str(folder)) == ["head.pt differs from what was saved",
                                        "model.pt is missing", "extra.pt is not in checksums.json"]
    lone.write_bytes(b"12")  # truncated
    assert seal_errors(str(lone)) == ["rollouts.pt differs from what was saved"]
    os.remove(lone)
    assert seal_errors(str(lone)) == ["rollouts.pt is missing"]


def test_a_part_that_cannot_be_saved_stops_the_run_and_leaves_nothing(tmp_path):
    """save_part (SPA's exploration rollouts and progress model, HISR's reward models): sealed
    when written whole; a write that fails part-way (a full disk) removes what it wrote, seal
    included, and stops the run with one line naming the part."""
    import errno

    from common import RunStopped
    from common.run import save_part, seal_errors

    def half(path):  # one file written, then the disk is full
        os.makedirs(path)
        (tmp_path / "model" / "head.pt").write_bytes(b"abc")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RunStopped, match=r"model could not be written \(OSError: .*No space"):
        save_part(str(tmp_path / "model"), half)
    save_part(str(tmp_path / "rollouts.pt"), lambda path: torch.save([1, 2], path))
    assert seal_errors(str(tmp_path / "rollouts.pt")) == []

    def truncated(path):  # as torch.save fails on a full tmpfs, the file half written
        with open(path, "wb") as f:
            f.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    with pytest.raises(RunStopped, match="rollouts.pt could not be written .RuntimeError"):
        save_part(str(tmp_path / "rollouts.pt"), truncated)
    assert os.listdir(tmp_path) == []


def test_a_full_disk_in_tensorboards_writer_thread_prints_no_traceback():
    """The writer's thread meets a full disk first and raises there; Run.log then stops the run
    with one line, so the thread's own traceback is not printed. Any other thread's error, or
    the writer's other errors, still reach the hook."""
    from types import SimpleNamespace

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    from common.run import _quiet_log_thread

    seen = []
    hook = _quiet_log_thread(seen.append)
    writer = _AsyncWriterThread.__new__(_AsyncWriterThread)
    cases = [SimpleNamespace(exc_type=OSError, thread=writer),
             SimpleNamespace(exc_type=ValueError, thread=writer),
             SimpleNamespace(exc_type=OSError, thread=threading.Thread())]
    for failed in cases:
        hook(failed)
    assert seen == cases[1:]


def test_a_folder_is_checked_before_the_work(tmp_path):
    """folder_error: a folder that is, or can become, a directory passes; one under a file or a
    link to nowhere is named; a read-only one fails only where it must be written."""
    from common import folder_error

    (tmp_path / "file").write_text("")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    assert folder_error("--runs", str(tmp_path / "new" / "deeper")) is None
    assert folder_error("--runs", str(tmp_path / "file" / "x")) == (
        f"--runs {tmp_path / 'file' / 'x'}: {tmp_path / 'file'} is a file, not a directory")
    assert folder_error("--runs", str(tmp_path / "dangling" / "x")) == (
        f"--runs {tmp_path / 'dangling' / 'x'}: {tmp_path / 'dangling'} is a link to nowhere, "
        "not a directory")
    if os.geteuid() != 0:  # root writes anywhere
        assert folder_error("--runs", str(tmp_path / "ro")).endswith("is not writable")
    assert folder_error("--runs", str(tmp_path / "ro"), writable=False) is None


def test_a_run_killed_while_writing_its_config_is_named_on_resume(tmp_path):
    """What a kill inside write_text leaves (config.json's partial, no config.json): --resume
    says the run stopped before any work, not that the folder is no run."""
    import proxmo

    (tmp_path / f"config.json.{os.getpid()}.partial").write_text('{"comm')
    with pytest.raises(UsageError, match="stopped while writing its config.json, before any work"):
        proxmo.parse_args(["--resume", str(tmp_path)])


def test_write_text_leaves_the_old_file_and_no_partial_on_a_full_disk(tmp_path, monkeypatch):
    """write_text is whole or nothing: a write that fails keeps what was there, and removes its
    own partial file."""
    import errno

    import common

    path = tmp_path / "summary.json"
    common.write_json(str(path), {"a": 1})

    def full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        common.write_json(str(path), {"a": 2})
    assert os.listdir(tmp_path) == ["summary.json"] and json.loads(path.read_text()) == {"a": 1}


def test_a_damaged_model_folder_is_one_line(tmp_path):
    """The shipped start copied and damaged: its chat template deleted (every prompt goes through
    it), or its config's vocabulary size changed (the weights no longer fit): a UsageError naming
    the folder, not a traceback at the first prompt or inside the loader."""
    import shutil

    from common.model import TINY_CHECKPOINT, load_model_and_tokenizer

    no_template = tmp_path / "no-template"
    shutil.copytree(TINY_CHECKPOINT, no_template)
    os.remove(no_template / "chat_template.jinja")
    with pytest.raises(UsageError, match="its tokenizer has no chat template"):
        load_model_and_tokenizer(str(no_template))
    other_vocab = tmp_path / "other-vocab"
    shutil.copytree(TINY_CHECKPOINT, other_vocab)
    config = json.load(open(other_vocab / "config.json"))
    json.dump({**config, "vocab_size": config["vocab_size"] + 7}, open(other_vocab / "config.json",
                                                                       "w"))
    with pytest.raises(UsageError, match="cannot load model"):
        load_model_and_tokenizer(str(other_vocab))
