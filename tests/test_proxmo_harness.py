"""proxmo.py's harness in-process: prompts that keep their head, the update's NaN guard, the
generation backend's eos ids, command-line presets, validation and resume reconciliation."""

import json
import os
from dataclasses import asdict

import pytest
import torch

import envs
from common import UsageError
from common.model import add_lora, load_model_and_tokenizer, scored_logprobs
from envs.text import PROMPT_WORDS, build_prompt, chat_ids, encode_prompt
from proxmo import Args, Policy, StepSample, parse_args, policy_update, validate_args

TASK = "put a mug in desk."
OBS = "You arrive at desk 1. On the desk 1, you see a mug 1, and a pen 2."
ADMISSIBLE = ["go to desk 1", "go to shelf 2", "take mug 1 from desk 1", "look", "inventory"]
HISTORY = [("You arrive at shelf 1. On the shelf 1, you see nothing.", "go to shelf 1"),
           ("You arrive at shelf 2. On the shelf 2, you see a book 1.", "go to shelf 2"),
           ("You arrive at drawer 1. The drawer 1 is closed.", "go to drawer 1")]


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny-scratch",
                                    vocabulary=envs.vocabulary("household") + PROMPT_WORDS,
                                    seed=0)


def prompt_with(tokenizer, history_length):
    text = build_prompt(TASK, HISTORY, OBS, ADMISSIBLE, 4, history_length, reasoning=False)
    return chat_ids(tokenizer, text)


def test_a_long_prompt_drops_its_oldest_history_not_its_head(tiny):
    _, tok = tiny
    with_two, with_one = prompt_with(tok, 2), prompt_with(tok, 1)
    assert len(with_two) > len(with_one)
    args = Args(history_length=2, max_prompt_tokens=len(with_two) - 1)
    ids = encode_prompt(args, tok, TASK, HISTORY, OBS, ADMISSIBLE, 4)
    assert ids == with_one  # the last pair stays, the older one goes
    text = tok.decode(ids)
    assert text.startswith("<|im_start|> user") and "task is to : put a mug in desk" in text
    assert text.rstrip().endswith("assistant")
    # Room for everything: nothing is dropped.
    assert encode_prompt(Args(history_length=2, max_prompt_tokens=len(with_two)), tok, TASK,
                         HISTORY, OBS, ADMISSIBLE, 4) == with_two


def test_a_prompt_too_long_without_history_is_a_clear_error(tiny):
    _, tok = tiny
    bare = len(prompt_with(tok, 0))
    with pytest.raises(UsageError) as err:
        encode_prompt(Args(history_length=2, max_prompt_tokens=bare - 1), tok, TASK, HISTORY, OBS,
                      ADMISSIBLE, 4)
    message = str(err.value)
    assert f"a prompt of {bare} tokens" in message and f"--max-prompt-tokens {bare - 1}" in message


def test_a_nan_update_stops_before_the_weights_change(tiny):
    base, tok = tiny
    model = add_lora(base, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    try:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        samples = [StepSample([5, 6, 7], [8, 9], float("nan"), [-1.0, -2.0]),
                   StepSample([5, 7], [9], 1.0, [-1.5])]
        with pytest.raises(FloatingPointError, match="iteration 3.*non-finite loss"):
            policy_update(Args(micro_batch_size=4, minibatch_size=4), model, tok, optimizer,
                          samples, torch.Generator().manual_seed(0), iteration=3)
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert torch.equal(p, before[n]), n
    finally:
        model.unload()


def _update_from(start: dict, args, model, tok, samples) -> tuple[dict, dict]:
    """The LoRA weights set to `start`, then one policy_update with SGD on `samples`: (its stats,
    the new LoRA weights). SGD: Adam's first steps are sign-like and would amplify float noise in
    tiny gradients."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(start[n])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    stats = policy_update(args, model, tok, optimizer, samples,
                          torch.Generator().manual_seed(0), 1)
    return stats, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_recorded_old_logprobs_give_the_update_of_scored_ones(tiny):
    """The old log-probs the hf backend records while sampling are those a scoring pass gives:
    the same batch gives the same loss and the same new LoRA weights either way (to float
    tolerance), so the update needs no scoring pass of its own."""
    base, tok = tiny
    args = Args(micro_batch_size=3, minibatch_size=4, ppo_epochs=2, rollout_temperature=0.8)
    prompts = [chat_ids(tok, build_prompt(TASK, HISTORY[:k], OBS, ADMISSIBLE, k + 1, 1, False))
               for k in range(6)]
    model = add_lora(base, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    try:
        start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.manual_seed(0)
        responses, logprobs = Policy(args, model, tok).generate(prompts, args.rollout_temperature)
        assert all(len(r) == len(lp) for r, lp in zip(responses, logprobs))
        scored = [lp.tolist() for lp in scored_logprobs(
            model, prompts, responses, tok.pad_token_id, 3, args.rollout_temperature)]
        results = []
        for recorded in (logprobs, scored):
            samples = [StepSample(p, r, (-1.0) ** k, lp)
                       for k, (p, r, lp) in enumerate(zip(prompts, responses, recorded))]
            results.append(_update_from(start, args, model, tok, samples))
    finally:
        model.unload()
    (recorded_stats, recorded_weights), (scored_stats, scored_weights) = results
    assert recorded_stats["train/loss"] == pytest.approx(scored_stats["train/loss"], abs=1e-5)
    assert recorded_stats["train/loss"] != 0
    for n, w in scored_weights.items():
        assert not torch.equal(w, start[n]) or "lora_B" not in n  # the update moved the adapter
        assert torch.allclose(recorded_weights[n], w, atol=1e-5), n


def test_gradient_checkpointing_gives_the_same_update(tiny):
    """--gradient-checkpointing recomputes activations in the backward pass: the same batch gives
    the same loss and the same new LoRA weights (to float tolerance) as keeping them."""
    base, tok = tiny
    args = Args(micro_batch_size=3, minibatch_size=4, ppo_epochs=2)
    prompts = [chat_ids(tok, build_prompt(TASK, HISTORY[:k], OBS, ADMISSIBLE, k + 1, 1, False))
               for k in range(6)]
    model = add_lora(base, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    try:
        start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.manual_seed(0)
        responses, logprobs = Policy(args, model, tok).generate(prompts, args.rollout_temperature)
        samples = [StepSample(p, r, (-1.0) ** k, lp)
                   for k, (p, r, lp) in enumerate(zip(prompts, responses, logprobs))]
        results = []
        for checkpointing in (False, True):
            if checkpointing:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            stats, weights = _update_from(start, args, model, tok, samples)
            results.append((stats["train/loss"], weights))
        assert model.base_model.model.model.gradient_checkpointing
    finally:
        model.gradient_checkpointing_disable()
        model.unload()
    (kept_loss, kept), (recomputed_loss, recomputed) = results
    assert kept_loss == pytest.approx(recomputed_loss, abs=1e-6) and kept_loss != 0
    assert any(not torch.equal(w, start[n]) for n, w in kept.items())
    for n, w in kept.items():
        assert torch.allclose(recomputed[n], w, atol=1e-6), n


def test_policy_generates_until_any_eos_of_the_generation_config(tiny):
    model, tok = tiny
    saved = model.generation_config.eos_token_id
    try:
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.pad_token_id]
        assert Policy(Args(), model, tok).eos_ids == [tok.eos_token_id, tok.pad_token_id]
    finally:
        model.generation_config.eos_token_id = saved


def test_presets_follow_the_model():
    tiny = parse_args([])
    assert (tiny.model, tiny.bc_epochs, tiny.reasoning,
            tiny.eval_splits) == ("tiny", 0, False, ("test",))
    scratch = parse_args(["--model", "tiny-scratch"])
    assert (scratch.bc_epochs, scratch.bc_full_params,
            scratch.iterations) == (3, True, tiny.iterations)
    errors = validate_args(parse_args(["--env", "alfworld", "--model", "tiny"]))
    assert any(e.startswith("--model tiny knows only the household") for e in errors)
    weak = parse_args(["--model", "tiny-weak"])  # the second shipped start: the tiny presets
    assert asdict(weak) == {**asdict(tiny), "model": "tiny-weak"}
    errors = validate_args(parse_args(["--env", "alfworld", "--model", "tiny-weak"]))
    assert any(e.startswith("--model tiny-weak knows only the household") for e in errors)
    # each environment's own shipped start without --model, with its preset (ALFWorld's 50 steps,
    # every valid_unseen game); it plays only its own environment
    alfworld = parse_args(["--env", "alfworld"])
    assert asdict(alfworld) == {**asdict(parse_args(["--env", "alfworld", "--model", "tiny"])),
                                "model": "tiny-alfworld", "max_episode_steps": 50,
                                "eval_splits": ("valid_unseen",), "eval_num_tasks": 0}
    errors = validate_args(parse_args(["--model", "tiny-alfworld"]))
    assert any(e.startswith("--model tiny-alfworld knows only the alfworld's words; for --env "
                            "household use --model tiny") for e in errors)
    # tiny-scratch builds its tokenizer over the environment's words, ALFWorld's included
    assert validate_args(parse_args(["--env", "alfworld", "--model", "tiny-scratch"])) == []
    real = parse_args(["--model", "Qwen2.5-1.5B-Instruct", "--env", "alfworld"])
    assert (real.iterations, real.bc_epochs, real.reasoning,
            real.learning_rate) == (150, 0, True, 1e-5)
    assert real.eval_splits == ("valid_unseen", "valid_seen")
    assert parse_args(["--model", "Qwen2.5-1.5B-Instruct", "--no-reasoning", "--iterations",
                       "3"]).reasoning is False


def test_every_nonsensical_value_gets_its_own_line():
    errors = validate_args(Args(group_size=0, tasks_per_iteration=0, eval_num_tasks=-1,
                                learning_rate=-1.0, max_new_tokens=0, gamma=1.5, clip_ratio_c=0.5,
                                eval_splits=("valid_unseen",)))
    for flag in ("--group-size", "--tasks-per-iteration", "--eval-num-tasks", "--learning-rate",
                 "--max-new-tokens", "--gamma", "--clip-ratio-c", "--eval-splits"):
        assert sum(line.startswith(flag) for line in errors) == 1, flag
    assert validate_args(Args()) == []
    errors = validate_args(Args(seed=-1, kl_coef=float("inf"), device="gpu"))
    assert [e.split()[0] for e in errors] == ["--kl-coef", "--seed", "--device"], errors


def saved_run(tmp_path, **overrides):
    run = tmp_path / "run"
    run.mkdir()
    args = json.loads(json.dumps(Args(advantage="grpo", iterations=4, **overrides).__dict__))
    (run / "config.json").write_text(json.dumps({"command": "python proxmo.py --advantage grpo",
                                                 "args": args}))
    return str(run)


def test_resume_takes_the_saved_configuration(tmp_path, capsys):
    run = saved_run(tmp_path, group_size=3)
    args = parse_args(["--resume", run])
    assert (args.advantage, args.group_size, args.iterations, args.resume) == ("grpo", 3, 4, run)
    longer = parse_args(["--resume", run, "--iterations", "6", "--group-size", "3"])
    assert longer.iterations == 6 and "overrides the saved 4" in capsys.readouterr().out


def test_resume_fills_settings_missing_from_an_old_config_with_its_model_presets(tmp_path, capsys):
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"args": {"model": "Qwen2.5-1.5B-Instruct",
                                                          "env": "alfworld", "device": "cuda"}}))
    args = parse_args(["--resume", str(run), "--device", "cpu"])
    assert (args.iterations, args.reasoning,
            args.eval_splits) == (150, True, ("valid_unseen", "valid_seen"))
    assert args.device == "cpu" and "--device cpu overrides the saved" in capsys.readouterr().out


def test_resume_with_a_contradicting_flag_is_an_error(tmp_path):
    run = saved_run(tmp_path)
    with pytest.raises(UsageError) as err:
        parse_args(["--resume", run, "--advantage", "proxmo", "--kl-coef", "0"])
    assert ("--advantage proxmo (saved: grpo)" in str(err.value)
            and "--kl-coef 0.0 (saved: 0.01)" in str(err.value))
    with pytest.raises(UsageError, match="no config.json"):
        parse_args(["--resume", str(tmp_path)])
    assert os.path.isdir(run)


@pytest.mark.parametrize("script", ["spa.py", "istar.py", "hisr.py", "sspo.py"])
def test_every_script_carries_proxmos_harness_text(script):
    """diff proxmo.py <script> shows only what a method changes: its rollouts, behavior cloning
    and evaluation sections are proxmo.py's text, and the plumbing is imported from common/ and
    envs/, not written again."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def read(name):
        with open(os.path.join(root, name)) as f:
            return f.read()

    def sections(text):
        parts = re.split(r"(?m)^(?=# ---- \d+\. )", text)
        return {p.split("\n", 1)[0][7:].split(" ---")[0]: p for p in parts
                if p.startswith("# ---- ")}

    mine, theirs = sections(read(script)), sections(read("proxmo.py"))
    for title in ("5. Rollouts", "6. Behavior cloning on expert trajectories", "7. Evaluation"):
        assert mine[title] == theirs[title], title
    if script == "istar.py":  # the same PPO update as proxmo.py's (sspo.py's: its own test)
        import importlib
        import inspect

        import proxmo

        mine = inspect.getsource(importlib.import_module(script[:-3]).policy_update)
        assert mine == inspect.getsource(proxmo.policy_update)
    for plumbing in ("def process_share", "def save_checkpoint", "def sum_across_processes",
                     "def build_prompt", "class Policy", "SummaryWriter("):
        assert plumbing not in read(script), plumbing


@pytest.mark.parametrize("script", ["proxmo", "spa", "istar", "hisr", "sspo"])
def test_every_args_takes_the_harness_settings_from_one_place(script):
    """The settings only the harness reads are HarnessArgs' fields, declared once in
    common/config.py: every script's Args extends it and declares none of them again."""
    import dataclasses
    import importlib

    from common.config import HarnessArgs

    Args = importlib.import_module(script).Args
    harness = {f.name for f in dataclasses.fields(HarnessArgs)}
    assert issubclass(Args, HarnessArgs)
    assert not harness & set(vars(Args)["__annotations__"])
    assert harness < {f.name for f in dataclasses.fields(Args)}


@pytest.mark.parametrize("script", ["proxmo", "spa", "istar", "hisr", "sspo"])
def test_help_shows_every_flag_once_in_its_group(script, capfd):
    """--help groups the flags: the run first, then the method's, training, LoRA, behavior
    cloning, evaluation, and the backends and data parallel last; every field of Args appears
    in exactly one group, with its comment as help."""
    import dataclasses
    import importlib
    import re

    from common.config import HELP_SECTIONS, print_help

    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as done:
        print_help(module.Args, module.preset_args())
    assert done.value.code == 0
    out = capfd.readouterr().out
    titles = re.findall(r"╭─ (.*?) options ─", out)
    assert titles == ["run", *(t for t, _ in HELP_SECTIONS), "backends, memory and data parallel"]
    flags = re.findall(r"│ (--[a-z0-9-]+)", out)
    names = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(module.Args)]
    assert sorted(flags) == sorted(names)
    eval_group = out.split("╭─ evaluation and checkpoints options")[1].split("╰")[0]
    assert "--eval-top-p FLOAT" in eval_group and "nucleus sampling" in eval_group
    assert "(default: 8)" in out.split("--iterations INT")[1].split("│ --")[0]
