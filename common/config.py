"""A script's configuration: its Args dataclass with the defaults of the --model, --env and
--advantage given (preset_args), parsed with tyro, or on --resume the run's saved configuration,
which the command line may not contradict (parse_args); then its checks (errors)."""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import shlex
import sys
import types
import typing
from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

import envs
from common import RunStopped, UsageError, error_line
from common.model import DEFAULT_MODEL, TINY_ENV, TINY_NAMES, TINY_STARTS

OVERRIDABLE = ("iterations", "device", "process_timeout_minutes")  # what --resume may change


@dataclass
class HarnessArgs:
    """Where and how a run goes: settings only the harness reads, the same in every script.
    A script's Args extends this class; --help shows its fields in groups (print_help)."""

    device: str = "cpu"  # torch device (cuda when available, else cpu)
    deterministic: bool = True  # deterministic torch kernels (free on CPU; CUDA: gpu_check.py)
    run_dir: str = "runs"  # where run directories are created
    # folder of start evaluations shared by runs of one start, seed and evaluation settings: one
    # that matches is read instead of played; else the run's own is written there
    start_evaluations: str | None = None
    resume: str | None = None  # run to continue; only --iterations, --device, timeouts may differ
    track: bool = False  # also log to Weights & Biases (it syncs the TensorBoard logs)
    wandb_project: str = "llm-agent-credit-assignment"  # Weights & Biases project of --track
    # a sampled token's draw: keyed by where it stands (seed, iteration, group, episode, step,
    # position: paired runs share draws), or torch's global stream (runs before keyed sampling)
    sampler: Literal["keyed", "global"] = "keyed"
    env_workers: int = 0  # processes that step a batch's games at once (0: this process)
    process_timeout_minutes: float = 120.0  # data parallel: wait for the others (NCCL's own: 10)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, slower
    max_prompt_tokens: int = 2048  # prompt length limit; longer prompts lose oldest history first
    vllm_gpu_memory_utilization: float = 0.35  # GPU memory vLLM may take (the rest: the trainer)
    vllm_sleep: bool = False  # vLLM: weights to host, KV cache freed in each update (small GPUs)


def preset_args(Args, presets: dict, model: str = "tiny", env: str = "household",
                advantage: str | None = None):
    """The defaults for `model`, `env` and `advantage` (None: the method's own): the dataclass's
    (the tiny models'; the env's eval splits and workers, this machine's device), then a tiny
    model's own presets[model] (tiny-scratch, tiny-alfworld) or, for a model not tiny,
    presets["real"], then for another --advantage presets["tiny baseline"] or
    presets["real baseline"], if any."""
    import torch

    args = Args(model=model, env=env, eval_splits=envs.EVAL_SPLITS.get(env, ()),
                device="cuda" if torch.cuda.is_available() else "cpu",
                env_workers=envs.default_env_workers(env))
    if model in TINY_NAMES and model in presets:
        args = replace(args, **presets[model])
    elif model not in TINY_NAMES:
        args = replace(args, **presets["real"])
    size = "tiny" if model in TINY_NAMES else "real"
    if advantage is None or advantage == args.advantage:
        return args
    return replace(args, advantage=advantage, **presets.get(f"{size} baseline", {}))


def choices(Args, name: str) -> tuple:
    """The values a Literal field of Args accepts."""
    return typing.get_args(typing.get_type_hints(Args)[name])


RUN_FIELDS = ("exp_name", "seed", "env", "model", "device", "run_dir", "resume",
              "start_evaluations", "deterministic", "track", "wandb_project")
HELP_SECTIONS = (("method", "advantage"), ("training", "iterations"), ("LoRA", "lora_r"),
                 ("behavior cloning", "bc_epochs"), ("evaluation and checkpoints", "eval_splits"))


def print_help(Args, default) -> None:
    """--help in groups: the run, then each HELP_SECTIONS entry (from its first field to the next
    entry's, in the order of Args), then the backends, memory and data parallel; the defaults
    shown are `default`'s. tyro draws a group per nested dataclass, so the groups are dataclasses
    made here for the help alone, each field keeping its type and its comment as help."""
    import tyro
    from tyro._docstrings import get_field_docstring  # tyro's comment reader (tyro==1.0.17)

    hints = typing.get_type_hints(Args)
    names = [f.name for f in fields(Args)]
    starts = [names.index(first) for _, first in HELP_SECTIONS] + [len(names)]
    groups = [("run", list(RUN_FIELDS))]
    groups += [(title, names[a:b]) for (title, _), a, b in zip(HELP_SECTIONS, starts, starts[1:])]
    placed = {name for _, group in groups for name in group}
    groups.append(("backends, memory and data parallel",
                   ["backend"] + [n for n in names if n not in placed and n != "backend"]))
    views = []
    for title, group in groups:
        members = [(name, typing.Annotated[hints[name], tyro.conf.arg(
            help=get_field_docstring(Args, name, ()))], getattr(default, name)) for name in group]
        view = dataclass_view(title, members)
        views.append((view.__name__, typing.Annotated[
            view, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name=title)], view()))
    cli = dataclass_view("Args", views)
    title = (Args.__doc__ or "").strip().split("\n\n")[0]
    cli.__doc__ = (f"{title}\n\nThe defaults shown are those of --model {default.model} --env "
                   f"{default.env} --advantage {default.advantage} (with --resume too): add any "
                   "of these flags to --help for another's. The device, evaluation splits and "
                   "env workers follow the machine and the env; config.json in a run's directory "
                   "holds every value.")
    tyro.cli(cli, args=["--help"], prog=os.path.basename(sys.argv[0]))


def dataclass_view(name: str, members: list[tuple]):
    """A dataclass of (name, type, default) members, for print_help."""
    from dataclasses import field, make_dataclass

    view = make_dataclass(name.replace(" ", "_").replace(",", ""),
                          [(n, hint, field(default_factory=lambda d=d: d))
                           for n, hint, d in members])
    view.__doc__ = ""
    return view


def parse_args(Args, presets: dict, argv: list[str], old_defaults: dict | None = None):
    """Command line -> Args. Defaults are the presets of the --model, --env and --advantage given;
    with --resume, the run's saved configuration, which flags on the command line may not
    contradict (only OVERRIDABLE settings may change, with a printed note). old_defaults:
    the values of settings a saved configuration lacks (it was written before they existed)."""
    import tyro

    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--model", default=None)
    peek.add_argument("--env", default="household")
    peek.add_argument("--advantage", default=None)
    peek.add_argument("--resume", default=None)
    peek.add_argument("-h", "--help", action="store_true")
    known, _ = peek.parse_known_args(argv)
    env = known.env if known.env in envs.ENV_NAMES else "household"  # tyro rejects others
    known.model = known.model or DEFAULT_MODEL[env]  # each env's shipped start
    advantage = known.advantage if known.advantage in choices(Args, "advantage") else None
    if known.help:
        print_help(Args, preset_args(Args, presets, known.model, env, advantage))
    if known.resume is None:
        return tyro.cli(Args, args=argv, default=preset_args(Args, presets, known.model, env,
                                                             advantage))
    config_file = os.path.join(known.resume, "config.json")
    if not os.path.isdir(known.resume):
        raise UsageError(f"--resume {known.resume}: no such run directory")
    if glob.glob(f"{glob.escape(config_file)}.*partial") and not os.path.isfile(config_file):
        raise UsageError(f"--resume {known.resume}: the run stopped while writing its config.json"
                         ", before any work: nothing to resume, start it again")
    if not os.path.isfile(config_file):
        raise UsageError(f"--resume {known.resume}: no config.json in it (not a run directory of "
                         "this script?)")
    try:
        with open(config_file) as f:
            config = json.load(f)
        if not isinstance(config.get("command", ""), str):  # shlex.split(None) reads stdin
            raise TypeError(f"its command is {config.get('command')!r}, not a command line")
        if not isinstance(config.get("resumed_by", []), list):
            raise TypeError(f"its resumed_by is {config.get('resumed_by')!r}, not a list")
        edited = ("args_sha256" in config
                  and config["args_sha256"] != settings_digest(config["args"]))
        # A setting a config lacks was not there when it was written: its value then.
        saved = {"sampler": "global", **(old_defaults or {}), **config["args"]}
        command = shlex.split(config.get("command", ""))
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        message = f"--resume {known.resume}: {config_file} is damaged ({error_line(e)})"
        raise UsageError(message) from None
    script = os.path.basename(sys.modules[Args.__module__].__file__)
    ran = next((os.path.basename(a) for a in command if a.endswith(".py")), None)
    if ran is not None and ran != script:
        raise UsageError(f"--resume {known.resume}: a run of {ran}, not of {script}; resume it "
                         f"with {ran}")
    unknown = sorted(set(saved) - {f.name for f in fields(Args)})
    if unknown:
        raise UsageError(f"--resume {known.resume}: its config.json has settings this version of "
                         f"the script does not know: {', '.join(unknown)}")
    hints = typing.get_type_hints(Args)  # values their fields cannot hold: a string seed, a NaN
    damaged = [f"{name} is {value!r}" for name, value in saved.items()
               if name in hints and not _fits(value, hints[name])]
    if edited and not damaged:  # a key deleted, or a value changed that still fits its type
        damaged = ["its settings are not the ones the script wrote: their digest differs"]
    if damaged:
        raise UsageError(f"--resume {known.resume}: {config_file} is damaged ("
                         f"{'; '.join(damaged)}); a run's config.json is written by the script, "
                         "never by hand")
    defaults = asdict(preset_args(Args, presets, saved.get("model", "tiny"),
                                  saved.get("env", "household"), saved.get("advantage")))
    merged = {**defaults, **saved}
    saved = Args(**{**merged, "eval_splits": tuple(merged["eval_splits"])})
    args = tyro.cli(Args, args=argv, default=saved)
    changed = [f.name for f in fields(Args) if f.name not in ("resume", *OVERRIDABLE)
               and getattr(args, f.name) != getattr(saved, f.name)]
    if changed:
        contradictions = [f"--{n.replace('_', '-')} {getattr(args, n)} "
                          f"(saved: {getattr(saved, n)})" for n in changed]
        raise UsageError("--resume continues the saved configuration; these flags contradict it: "
                         + ", ".join(contradictions))
    for name in OVERRIDABLE:
        given, before = getattr(args, name), getattr(saved, name)
        if given != before:
            print(f"note: --{name} {given} overrides the saved {before}")
    return args


def settings_digest(settings: dict) -> str:
    """A digest of a run's settings as config.json keeps them, written beside them: a setting
    edited or deleted by hand is then found on --resume."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _fits(value, hint) -> bool:
    """Whether a JSON value can be the value of a field typed `hint`."""
    origin, options = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return value in options
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in options)
    if origin in (tuple, list):
        return isinstance(value, (list, tuple)) and all(_fits(v, options[0]) for v in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    return isinstance(value, hint) if isinstance(hint, type) else True


# The harness's ranges, the same in every script; a script adds its method's. A range is ">= x",
# "> x" or an interval "in [x, y)" (brackets as in mathematics), then optionally a hint; None
# passes (an unset optional value).
RANGES = {
    "seed": "in [0, 2**32)", "iterations": "in [0, 10**6]", "tasks_per_iteration": ">= 1",
    "group_size": "in [1, 1024]", "max_episode_steps": "in [1, 10000]",
    "env_workers": "in [0, 256] (0 = step the games in this process)",
    "learning_rate": "in (0, 1]",
    "weight_decay": ">= 0", "clip_eps": "in (0, 1)", "clip_ratio_c": "> 1", "kl_coef": ">= 0",
    "entropy_coef": ">= 0", "ppo_epochs": ">= 1", "minibatch_size": ">= 1",
    "micro_batch_size": ">= 1", "max_grad_norm": "> 0",
    "rollout_temperature": "> 0: the N trajectories of a group must be sampled",
    "eval_top_p": "in (0, 1]", "max_new_tokens": "in [1, 32768]",
    "max_prompt_tokens": "in [1, 131072]", "history_length": ">= 0", "lora_r": "in [1, 1024]",
    "lora_alpha": "> 0", "lora_dropout": "in [0, 1)",
    "bc_epochs": ">= 0", "bc_num_tasks": ">= 1", "bc_noise": "in [0, 1]",
    "bc_prompt_loss_weight": ">= 0", "bc_learning_rate": "in (0, 1]", "bc_batch_size": ">= 1",
    "eval_every": ">= 1", "eval_num_tasks": ">= 0 (0 = the whole split)",
    "eval_draws": "in [1, 64]",
    "eval_temperature": ">= 0 (0 = greedy)", "save_every": ">= 1",
    "vllm_gpu_memory_utilization": "in (0, 1]", "process_timeout_minutes": "in (0, 10080]",
}
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py, MaxLoRARanks


def _number(text: str) -> float:
    base, _, power = text.partition("**")
    return float(base) ** float(power) if power else float(text)


def in_range(value: float, rule: str) -> bool:
    """Whether `value` satisfies a range of RANGES' form."""
    interval = re.match(r"in ([\[(])([^,]+), ([^\])]+)([\])])", rule)
    if interval:
        left, low, high, right = interval.groups()
        low, high = _number(low), _number(high)
        above = value >= low if left == "[" else value > low
        below = value <= high if right == "]" else value < high
        return above and below
    op, bound = rule.split()[:2]
    if op not in (">=", ">"):
        raise ValueError(f"a range is '>= x', '> x' or 'in [x, y)', not {rule!r}")
    bound = _number(bound.rstrip(":"))
    return value >= bound if op == ">=" else value > bound


def errors(args, ranges: dict[str, str]) -> list[str]:
    """One line per nonsensical value ([] when all are usable): a float that is not finite, a
    field outside its range (the harness's RANGES, then the method's `ranges`), then what a
    range cannot say about the harness's flags."""
    import torch

    floats = [f.name for f in fields(args) if isinstance(getattr(args, f.name), float)]
    found = [f"--{name.replace('_', '-')} must be finite" for name in floats
             if not math.isfinite(getattr(args, name))]
    if set(RANGES) & set(ranges):
        raise ValueError(f"ranges of the harness given again: {sorted(set(RANGES) & set(ranges))}")
    for name, rule in {**RANGES, **ranges}.items():
        value = getattr(args, name)
        if value is not None and math.isfinite(value) and not in_range(value, rule):
            found.append(f"--{name.replace('_', '-')} must be {rule}")
    a = args
    rules = [
        (a.device == "cpu" or (a.device.startswith("cuda") and torch.cuda.is_available()),
         f"--device {a.device}: use cpu, or cuda / cuda:N on a machine with a CUDA GPU"),
        (a.model not in TINY_STARTS or TINY_ENV[a.model] == a.env,
         f"--model {a.model} knows only the {TINY_ENV.get(a.model)}'s words; for --env {a.env} "
         f"use --model {DEFAULT_MODEL[a.env]} (its shipped start), tiny-scratch (behavior "
         "cloning first) or a real one, e.g. Qwen2.5-1.5B-Instruct"),
        (a.exp_name not in ("", ".", "..") and "/" not in a.exp_name and os.sep not in a.exp_name,
         f"--exp-name {a.exp_name!r}: a name, not a path (the run goes under --run-dir)"),
        (len(a.eval_splits) >= 1, "--eval-splits needs at least one split"),
        (all(s in envs.SPLITS[a.env] for s in a.eval_splits),
         f"--eval-splits must be among {', '.join(envs.SPLITS[a.env])} for --env {a.env}"),
        (a.backend != "vllm" or a.device.startswith("cuda"),
         "--backend vllm needs a CUDA GPU; use --backend hf or hf-cb on CPU"),
        (not a.vllm_sleep or a.backend == "vllm", "--vllm-sleep is for --backend vllm"),
        (a.sampler != "keyed" or a.backend != "hf-cb",
         "--backend hf-cb draws from torch's global stream, not by key: add --sampler global, "
         "or use --backend hf"),
        (a.backend != "vllm" or a.lora_r in VLLM_LORA_RANKS,
         f"--lora-r {a.lora_r}: vLLM serves LoRA ranks {', '.join(map(str, VLLM_LORA_RANKS))} "
         "only; pick one of them, or --backend hf"),
    ]
    return found + [message for ok, message in rules if not ok]


def run_command_line(main, parse_args) -> None:
    """`python <script>.py ...`: main(parse_args(its flags)). A bad flag or value (UsageError)
    ends with one line on stderr and exit status 2, a non-finite loss (FloatingPointError) or a
    run that cannot go on (RunStopped) with exit status 1, Ctrl-C with how to resume (130)."""
    try:
        main(parse_args(sys.argv[1:]))
    except (UsageError, FloatingPointError, RunStopped) as e:
        print(f"error: {e}", file=sys.stderr)
        if isinstance(e, RunStopped):  # the checkpoint is intact: how to go on from it
            from common.run import interrupted

            print(interrupted("stopped"), file=sys.stderr)
        sys.exit(2 if isinstance(e, UsageError) else 1)
    except KeyboardInterrupt:  # Ctrl-C: how to go on, not a traceback
        from common.run import interrupted

        print(f"\n{interrupted()}", file=sys.stderr)
        sys.exit(130)
