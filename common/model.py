"""Model and tokenizer loading (what --model accepts: docs/running.md, "Models and presets"),
LoRA adapters, and log-probabilities of responses."""

from __future__ import annotations

import json
import os
import re
import socket
import string
from urllib.parse import urlparse
from urllib.request import getproxies

import torch
from torch import Tensor

from common import UsageError, error_line

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
# The shipped starts (each folder's README.md says how it was built): "tiny", a 2-layer Qwen2
# behavior-cloned on the household expert, the stand-in for an Instruct model; "tiny-weak", the
# same cloned on fewer demonstrations, a start that fails more often; "tiny-alfworld", the same
# architecture cloned on ALFWorld's expert. "tiny-scratch" is that architecture with random
# weights and build_tiny_tokenizer's words: behavior cloning comes first.
TINY_CHECKPOINT = os.path.join(ASSETS, "tiny-household")
TINY_STARTS = {"tiny": TINY_CHECKPOINT, "tiny-weak": os.path.join(ASSETS, "tiny-household-weak"),
               "tiny-alfworld": os.path.join(ASSETS, "tiny-alfworld")}
TINY_ENV = {"tiny": "household", "tiny-weak": "household", "tiny-alfworld": "alfworld"}
DEFAULT_MODEL = {"household": "tiny", "alfworld": "tiny-alfworld"}  # without --model
TINY_NAMES = (*TINY_STARTS, "tiny-scratch")  # the models the tiny presets are for
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
# Kept as ordinary (decodable) tokens: responses decode to "<action> go to desk 1 </action>".
TINY_TAG_TOKENS = ["<think>", "</think>", "<action>", "</action>"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(words: list[str]):
    """Word-level tokenizer: one id per word of `words` (plus 0-99, single letters and ASCII
    punctuation), special tokens and the reasoning/action tags. "cabinet 3" is two tokens, the same
    "cabinet" as in the goal sentence, so copying an entity from the prompt is compositional
    (measured: whole-entity tokens such as "cabinet 3" made behavior cloning generalise far worse,
    2% vs 21% test success after the same 130 s)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_words = (set(words) | {str(i) for i in range(100)} | set(string.ascii_lowercase)
                   | set(string.punctuation) | {"user", "assistant", "system"})
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + TINY_TAG_TOKENS)}
    for w in sorted(vocab_words - set(vocab)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    # Keep runs of word characters and single punctuation marks; drop the white space between them.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), behavior="removed",
                                             invert=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                        pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.add_tokens(TINY_TAG_TOKENS)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def build_tiny_model(vocab_size: int, seed: int, hidden_size: int = 128, num_layers: int = 2):
    """A small Qwen2 (same code path as Qwen2.5) with random weights, deterministic given `seed`.
    8 heads of 16 dims: at equal cost, more heads learn to copy an action from the prompt much
    sooner than 4 (measured: 61% vs 7% exact `move` actions after 150 s of BC)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         rope_theta=10000.0)
    with torch.random.fork_rng(devices=[]):  # the caller's CPU stream goes on as it was
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def resolve_model_name(name: str) -> list[str]:
    """Where `name` may be found, in the order tried: the local directory, then hub ids."""
    if name in TINY_STARTS:
        return [TINY_STARTS[name]]
    if os.path.isdir(os.path.expanduser(name)):
        return [os.path.expanduser(name)]
    if "/" not in name and re.match(r"(?i)qwen", name):
        return [f"Qwen/{name}"]
    return [name]


def _missing_start(name: str) -> UsageError:
    return UsageError(f"the shipped {name} model is missing: copy the repository's "
                      f"assets/{os.path.basename(TINY_STARTS[name])}/ to {TINY_STARTS[name]} "
                      "(beside common/ and envs/; in a checkout, restore it from git), or use "
                      "--model tiny-scratch (random weights, behavior cloning)")


def check_model(name: str, env: str) -> None:
    """A UsageError before anything else is read when `name` surely cannot load: a shipped start
    whose folder is missing, or a hub id that is no local directory, with the hub unreachable and
    the id not in the local cache. The fallback named is `env`'s shipped start."""
    if name == "tiny-scratch" or os.path.isdir(os.path.expanduser(name)):
        return
    fallback = (f"for a CPU run on --env {env}, --model {DEFAULT_MODEL[env]} (its shipped "
                "start) or tiny-scratch")
    if name in TINY_STARTS:
        if not os.path.isdir(TINY_STARTS[name]):
            raise _missing_start(name)
        return
    if _hub_reachable():
        return
    from huggingface_hub import try_to_load_from_cache

    repo = resolve_model_name(name)[-1]
    try:
        cached = try_to_load_from_cache(repo, "config.json")
    except ValueError:  # not a hub id either (a path that does not exist, say)
        cached = None
    if not isinstance(cached, str):
        raise UsageError(f"cannot load model {name!r}: the hub is unreachable (offline) and "
                         f"{repo} is not in the local Hugging Face cache, nor is {name!r} a local "
                         f"directory. Pass a directory saved with save_pretrained, or {fallback}")


def load_model_and_tokenizer(name: str, *, vocabulary: list[str] | None = None, seed: int = 0,
                             dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer). `vocabulary` (the env's words) is needed only for "tiny-scratch"."""
    if torch.device(device).type == "cuda":
        # cuDNN's attention builds a plan for every new sequence shape, and a rollout's shapes
        # are new at every step: keyed generation 1.6x slower on an H200 (docs/gpu-readiness.md)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if name == "tiny-scratch":
        if not vocabulary:
            raise UsageError("--model tiny-scratch needs the environment's vocabulary")
        tokenizer = build_tiny_tokenizer(vocabulary)
        model = build_tiny_model(len(tokenizer), seed=seed)
        return model.to(device=device, dtype=dtype), tokenizer

    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    if name in TINY_STARTS and not os.path.isdir(TINY_STARTS[name]):
        raise _missing_start(name)
    errors = []
    for candidate in resolve_model_name(name):
        # Without a reachable hub, loading a hub id retries for about a minute before failing:
        # ask the local cache only, and say so if the model is not there.
        cache_only = not os.path.isdir(candidate) and not _hub_reachable()
        try:
            tokenizer = _load_tokenizer(candidate, local_files_only=cache_only)
            model = AutoModelForCausalLM.from_pretrained(candidate, dtype=dtype,
                                                         local_files_only=cache_only)
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # missing, damaged
            reason = error_line(e)
            if cache_only:
                reason = f"the hub is unreachable (offline), local cache only: {reason}"
            errors.append(f"  {candidate}: {reason}")
            continue
        if tokenizer.chat_template is None:  # every prompt goes through it (envs/text.py)
            errors.append(f"  {candidate}: its tokenizer has no chat template")
            continue
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return model.to(device), tokenizer
    local = os.path.abspath(os.path.expanduser(name))
    if not os.path.isdir(local):
        errors.append(f"  (no local directory {local})")
    raise UsageError(f"cannot load model {name!r}. Tried:\n" + "\n".join(errors)
                     + "\nPass a local directory (a model saved with save_pretrained), a hub id "
                       "such as Qwen/Qwen2.5-1.5B-Instruct (needs the hub or a filled HF cache; "
                       "HF_HUB_OFFLINE=1 uses the cache only), a shipped start (tiny for the "
                       "household, tiny-alfworld for ALFWorld) or tiny-scratch.")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the hub endpoint cannot be connected to quickly.
    Behind a proxy the endpoint is not probed directly: True."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urlparse(constants.ENDPOINT)
    if getproxies().get(endpoint.scheme):
        return True
    address = (endpoint.hostname, endpoint.port or (80 if endpoint.scheme == "http" else 443))
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError:
        return False
    return True


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a response: the tokenizer's eos and the generation config's (Qwen2.5
    lists both <|im_end|> and <|endoftext|> there), tokenizer's first."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in configured if isinstance(configured, (list, tuple)) else [configured]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def _load_tokenizer(path: str, local_files_only: bool = False):
    """AutoTokenizer, except for a plain `tokenizers` tokenizer saved by us (the tiny one), which
    AutoTokenizer would rebuild as the model type's tokenizer class with another decoder."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            saved_class = json.load(f).get("tokenizer_class")
            if saved_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=local_files_only)


# ---- LoRA ---------------------------------------------------------------------------------------
def add_lora(model, r: int, alpha: int, dropout: float, target_modules: str | list[str]):
    """Wrap `model` with a fresh trainable LoRA adapter; only adapter weights require grad.
    target_modules: all-linear, module names comma-separated (--lora-target-modules), or a
    list of them."""
    from peft import LoraConfig, get_peft_model

    if isinstance(target_modules, str) and target_modules != "all-linear":
        target_modules = target_modules.split(",")  # names, not PEFT's regex of one string

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def check_lora_targets(model, target_modules: str) -> None:
    """A UsageError unless every name of a comma-separated --lora-target-modules names modules of
    `model` (as PEFT matches a list: the whole module name or its last parts); all-linear
    passes."""
    if target_modules == "all-linear":
        return
    names = [name for name, _ in model.named_modules()]
    unknown = [t for t in target_modules.split(",")
               if not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise UsageError(f"--lora-target-modules {target_modules}: no module named "
                         f"{', '.join(unknown)} in the model; its linear layers: "
                         f"{', '.join(linear)} (or all-linear)")


def load_lora(model, path: str):
    """Attach a saved adapter (trainable) to a base model."""
    from peft import PeftModel

    from safetensors import SafetensorError

    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise UsageError(f"no LoRA adapter at {path} (adapter_config.json missing)")
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        raise UsageError(f"no LoRA adapter at {path} (adapter_model.safetensors missing)")
    try:  # a damaged file: one line naming it, not the library's traceback
        return PeftModel.from_pretrained(model, path, is_trainable=True)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError) as e:
        message = f"the LoRA adapter at {path} cannot be loaded ({error_line(e)})"
        raise UsageError(message) from None


def merge_lora(model):
    """Fold the adapter into the base weights and return the plain model."""
    return model.merge_and_unload()


# ---- log-probabilities --------------------------------------------------------------------------
def pad_prompt_response(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Left-pad prompts to P and right-pad responses to R, so every response starts at column P.

    Returns input_ids (B, P+R), attention_mask (B, P+R), position_ids (B, P+R), response ids
    (B, R) and response_mask (B, R). With empty responses: the prompts as generation lays them
    out, right-aligned after pad tokens."""
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    B = len(prompts)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + R), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(r)] = torch.tensor(r, dtype=torch.long)
        attention[i, P - len(p):P + len(r)] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention, position_ids, input_ids[:, P:], attention[:, P:]


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                      with_entropy: bool = False, temperature: float = 1.0):
    """Per-token log pi(response token | prompt, earlier response tokens), pi = softmax(logits /
    temperature): the distribution the responses were sampled from.

    Returns (logp (B, R), mask (B, R), entropy (B, R) or None); R = longest response. Only the
    logits of response positions are materialised (logits_to_keep), which matters for 150k
    vocabs. A (prompt, response) pair that occurs more than once (a group's episodes often take
    the same step) goes through the model once and its rows are copies: gradients through the
    copies add up, and with dropout on they share one dropout mask."""
    device = next(model.parameters()).device
    row_of: dict[tuple, int] = {}
    rows = [row_of.setdefault((tuple(p), tuple(r)), len(row_of))
            for p, r in zip(prompts, responses)]
    distinct = list(row_of)
    input_ids, attention, position_ids, targets, mask = (
        t.to(device) for t in pad_prompt_response([p for p, _ in distinct],
                                                  [r for _, r in distinct], pad_id))
    R = targets.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                   logits_to_keep=R + 1, use_cache=False).logits[:, :-1].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    if len(distinct) < len(rows):
        index = torch.tensor(rows, device=device)
        logp, mask = logp[index], mask[index]
        entropy = entropy[index] if entropy is not None else None
    return logp, mask.float(), entropy


def next_token_losses(model, prompts: list[list[int]], responses: list[list[int]],
                      pad_id: int) -> tuple[Tensor, Tensor]:
    """(response loss, prompt loss): the mean next-token cross-entropy of the response tokens and
    of the prompt tokens after each prompt's first, from one forward pass over the whole text."""
    device = next(model.parameters()).device
    input_ids, attention, position_ids, _, response_mask = (
        t.to(device) for t in pad_prompt_response(prompts, responses, pad_id))
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                   use_cache=False).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:],
                                            reduction="none")
    # (B, L-1): the target and its context are real tokens
    valid = (attention[:, 1:] * attention[:, :-1]).float()
    # nll[:, j] scores token j + 1, so the response targets (columns P.. of input_ids) are
    # nll[:, P-1:].
    split = input_ids.shape[1] - response_mask.shape[1] - 1
    response_loss = (nll[:, split:] * valid[:, split:]).sum() / valid[:, split:].sum()
    prompt_loss = (nll[:, :split] * valid[:, :split]).sum() / valid[:, :split].sum().clamp(min=1)
    return response_loss, prompt_loss


def length_sorted_chunks(indices: list[int], lengths: list[int], size: int) -> list[list[int]]:
    """Split `indices` into chunks of `size` after sorting them by length, so that padding to the
    longest member of a chunk wastes little compute."""
    ordered = sorted(indices, key=lambda i: lengths[i])
    return [ordered[k:k + size] for k in range(0, len(ordered), size)]


def scored_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                    micro_batch_size: int, temperature: float = 1.0) -> list[Tensor]:
    """response_logprobs without grad, in micro-batches of similar length: one (len(response),)
    tensor per response, in the input order."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    out: list[Tensor] = [torch.empty(0)] * len(prompts)
    with torch.no_grad():
        for idx in length_sorted_chunks(list(range(len(prompts))), lengths, micro_batch_size):
            logp, _, _ = response_logprobs(model, [prompts[i] for i in idx],
                                           [responses[i] for i in idx], pad_id,
                                           temperature=temperature)
            for row, i in zip(logp, idx):
                out[i] = row[:len(responses[i])]
    return out


def pad_rows(rows: list[Tensor], length: int) -> Tensor:
    """Stack 1-D tensors right-padded with 0 to `length` -> (len(rows), length). The padded
    values never count: every loss and metric masks them before use."""
    return torch.stack([torch.nn.functional.pad(r, (0, length - len(r))) for r in rows])

