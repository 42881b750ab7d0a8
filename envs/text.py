"""How a text game is put to a model: the prompt of one step, the chat template around it, and
what is read back from a reply (its action, whether it is well formed). The same for every method
script; `args` is a script's Args (history_length, max_prompt_tokens, reasoning)."""

from __future__ import annotations

import re
import sys

from common import UsageError

PROMPT_INTRO = "You are an agent in a household. Your task is to: {task}"
PROMPT_HISTORY = "You have taken {steps} step(s). Your last {k} observation(s) and action(s):"
PROMPT_NOW = "Step {step}. Current observation: {obs}\nAdmissible actions: {actions}"
ASK_REASONING = ("First think step by step inside <think> </think>, then give exactly one "
                 "admissible action inside <action> </action>.")
ASK_ACTION = "Reply with exactly one admissible action inside <action> </action>."
PROMPT_WORDS = re.findall(r"[a-z]+", " ".join([PROMPT_INTRO, PROMPT_HISTORY, PROMPT_NOW,
                                               ASK_REASONING, ASK_ACTION,
                                               "observation action"]).lower())


def build_prompt(task: str, history: list[tuple[str, str]], obs: str, admissible: list[str],
                 step: int, history_length: int, reasoning: bool) -> str:
    """The user message at one step: task, last `history_length` (obs, action) pairs, current
    observation and admissible actions (the GiGPO/ProxMO ALFWorld template, in our own words)."""
    lines = [PROMPT_INTRO.format(task=task)]
    recent = history[-history_length:] if history_length > 0 else []
    if recent:
        lines.append(PROMPT_HISTORY.format(steps=len(history), k=len(recent)))
        first = len(history) - len(recent) + 1
        for k, (past_obs, past_action) in enumerate(recent):
            lines.append(f"[observation {first + k}] {past_obs} "
                         f"[action {first + k}] {past_action}")
    lines.append(PROMPT_NOW.format(step=step, obs=obs, actions=", ".join(admissible)))
    lines.append(ASK_REASONING if reasoning else ASK_ACTION)
    return "\n".join(lines)


_warned_history_cut = False


def chat_ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text` as the user turn of a chat, followed by the assistant's header."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(chat, add_special_tokens=False).input_ids


def encode_prompt(args, tokenizer, task: str, history: list[tuple[str, str]], obs: str,
                  admissible: list[str], step: int) -> list[int]:
    """Prompt ids of one step, at most --max-prompt-tokens long. A prompt that is too long drops
    its oldest history pairs first (with a warning, once); the chat header, the task, the current
    observation and the admissible actions are never cut. Without any history still too long: a
    UsageError naming the sizes and the flags to change."""
    global _warned_history_cut
    shown = min(args.history_length, len(history))
    for k in range(shown, -1, -1):
        text = build_prompt(task, history, obs, admissible, step, k, args.reasoning)
        ids = chat_ids(tokenizer, text)
        if len(ids) <= args.max_prompt_tokens:
            if k < shown and not _warned_history_cut:
                _warned_history_cut = True
                print(f"warning: a prompt with {shown} history pair(s) exceeded "
                      f"--max-prompt-tokens {args.max_prompt_tokens}; it keeps only the last {k} "
                      "(raise --max-prompt-tokens or lower --history-length)", file=sys.stderr)
            return ids
    raise UsageError(f"a prompt of {len(ids)} tokens without any history (task, observation and "
                     f"{len(admissible)} admissible actions) exceeds --max-prompt-tokens "
                     f"{args.max_prompt_tokens}; raise --max-prompt-tokens")


def expert_response(action: str, reasoning: bool) -> str:
    """The reply behavior cloning teaches for the expert's `action`."""
    return (f"<think>The expert's next step.</think><action>{action}</action>" if reasoning
            else f"<action>{action}</action>")


ACTION_RE = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)


def parse_action(response: str) -> str | None:
    """The lowercased text of the last <action>...</action>, or None when there is none."""
    found = ACTION_RE.findall(response)
    if not found:
        return None
    action = " ".join(found[-1].strip().strip('"').lower().split())
    return action or None


THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
CHINESE_RE = re.compile(r"[\u4e00-\u9fff]")


def is_well_formed(response: str, reasoning: bool) -> bool:
    """The spec's (and verl-agent's) validity flag of a reply: an <action>...</action>, with
    `reasoning` also a <think>...</think>, and no Chinese characters. Whether the action is
    admissible is the environment's business (grounding), not this flag's."""
    if parse_action(response) is None or CHINESE_RE.search(response):
        return False
    return not reasoning or THINK_RE.search(response) is not None
