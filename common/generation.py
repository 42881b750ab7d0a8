"""Batched generation through the three --backend choices (docs/running.md, "Generation
backends"): hf_generate, ContinuousBatching and vllm_generate, behind Policy. Prompts and
responses are token ids, so every backend returns exactly the tokens the policy is trained on.

Sampling is exactly softmax(logits / temperature), optionally top-p truncated, and nothing else:
a checkpoint's own generation config (Qwen2.5-Instruct ships repetition_penalty, top_k, top_p
and temperature) is ignored, because PPO scores the sampled tokens under softmax(logits / T) and
any other logits processor would make the rollout policy differ from the one being trained."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
import threading
from collections import defaultdict

import torch
from accelerate import PartialState

from common import UsageError
from common.model import (eos_token_ids, length_sorted_chunks, pad_prompt_response,
                          response_logprobs)


def sampling_config(*, temperature: float, top_p: float, max_new_tokens: int, eos_ids: list[int],
                    pad_id: int):
    """A complete GenerationConfig: sampling at `temperature` (0 = greedy) with top-p, every other
    logits processor explicitly neutral (transformers fills unset fields from the checkpoint)."""
    from transformers import GenerationConfig

    sampling = temperature > 0
    return GenerationConfig(
        do_sample=sampling, temperature=temperature if sampling else 1.0,
        top_p=top_p if sampling else 1.0, top_k=0 if sampling else None, min_p=None,
        typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
        encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0, num_beams=1,
        num_return_sequences=1, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids),
        pad_token_id=pad_id, renormalize_logits=False, use_cache=True)


@contextlib.contextmanager
def _without_checkpoint_generation_config(model):
    """Hide the checkpoint's generation_config during generate(): transformers fills every field
    a passed config leaves unset (bad_words_ids, suppress_tokens, forced ids...) from it."""
    from transformers import GenerationConfig

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = inner.generation_config
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = saved


class SampledLogprobs:
    """A logits processor that keeps, for each drawn token, log softmax(logits / T)[token]:
    the old log-probs PPO needs, without a second forward pass and with one (B, V) row in memory.

    generate() applies custom processors before its temperature and top-p warpers, so the scores
    seen here are the raw logits (every other processor is neutral, see sampling_config) and the
    temperature is applied here. The token drawn from step t's scores is the last input id at step
    t + 1; the final step's token is read by `finish`."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None
        self.chosen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.chosen.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) generated ids -> (B, L) their log-probs."""
        last = self.previous.gather(-1, new_tokens[:, -1:]).squeeze(-1)
        return torch.stack([*self.chosen, last], dim=1)


# ---- Keyed sampling (--sampler keyed): a draw is a function of where its token stands --------
def key_seed(key: tuple) -> int:
    """A 63-bit integer for a draw's key, a tuple of ints and strings (e.g. seed, "train",
    iteration, group, episode, step, token position): its blake2b digest."""
    digest = hashlib.blake2b(repr(tuple(key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) and c < 2**32, without int64 overflow."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection of [0, 2**32) that mixes every bit)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def keyed_uniforms(seeds: list[int], size: int, device=None) -> torch.Tensor:
    """(len(seeds), size) float32 uniforms in (0, 1): entry [r, v] a hash of (seeds[r], v) alone,
    the same on every device and in any batch (a counter-based generator, 24 bits each)."""
    seeds_t = torch.tensor(seeds, dtype=torch.int64, device=device)[:, None]
    column = _mul32(torch.arange(size, dtype=torch.int64, device=device), 0x9E3779B1)[None, :]
    x = _fmix32(column ^ (seeds_t & _M32))
    x = _fmix32(x ^ (seeds_t >> 32))
    x = _fmix32(x ^ (seeds_t & _M32))
    return ((x >> 8).float() + 0.5) * 2.0 ** -24


def keyed_draw(logits: torch.Tensor, temperature: float, seeds: list[int],
               top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race (Gumbel-max): row r draws argmax_v p_v / E_v with p = softmax(logits
    / T) (top-p truncated if top_p < 1) and E_v = -log U_v ~ Exp(1), U = keyed_uniforms(seeds):
    a draw from p, fixed by its seed. logits (B, V) -> (tokens (B,), log p (B, V), float32)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        from transformers import TopPLogitsWarper

        logp = torch.log_softmax(TopPLogitsWarper(top_p)(None, logp), dim=-1)
    exponential = -torch.log(keyed_uniforms(seeds, logits.shape[-1], logits.device))
    return (logp - torch.log(exponential)).argmax(dim=-1), logp


def episode_keys(prefix: tuple, groups: list[int]) -> list[tuple]:
    """A rollout's keys: episode k gets (*prefix, groups[k], its place among its group's episodes
    so far), so that a group's episodes key alike in any batch layout or process."""
    seen: dict[int, int] = defaultdict(int)
    keys = []
    for group in groups:
        keys.append((*prefix, group, seen[group]))
        seen[group] += 1
    return keys


class KeyedRace:
    """A logits processor that draws each row's token by keyed_draw, its seed the row's key plus
    the token's position in the response, and hands generate() (greedy) only that token; it keeps
    the drawn tokens' log softmax(logits / T), as SampledLogprobs does."""

    def __init__(self, temperature: float, top_p: float, keys: list[tuple], width: int):
        self.temperature, self.top_p, self.keys, self.width = temperature, top_p, keys, width
        self.chosen: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.width
        seeds = [key_seed((*key, position)) for key in self.keys]
        tokens, logp = keyed_draw(scores, self.temperature, seeds, self.top_p)
        self.chosen.append(logp.gather(-1, tokens[:, None]).squeeze(-1))
        only = torch.full_like(scores, -math.inf)
        return only.scatter_(-1, tokens[:, None], 0.0)

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) generated ids -> (B, L) their log-probs."""
        return torch.stack(self.chosen[:new_tokens.shape[1]], dim=1)


def _check_recordable(return_logprobs: bool, temperature: float, top_p: float) -> None:
    """Recorded log-probs are those of softmax(logits / T): plain sampling only."""
    if return_logprobs and (temperature <= 0 or top_p < 1):
        raise ValueError("return_logprobs needs temperature > 0 and top_p == 1")


def _through_first_eos(tokens: list[int], eos_ids: list[int]) -> int:
    """How many of `tokens` a response keeps: up to and including the first eos."""
    return next((j + 1 for j, t in enumerate(tokens) if t in eos_ids), len(tokens))


# Prompts per prefill forward pass (16 x ~200 tokens ran fastest per token on 2 CPU cores; on a
# GPU, 16 prompts of a real model's length fill a forward pass too).
PREFILL_ROWS = 16
# A model smaller than this decodes on one CPU thread (see _decode_threads).
ONE_THREAD_DECODE_PARAMETERS = 50_000_000


def _prefilled_cache(model, prompts: list[list[int]], width: int, pad_id: int, device):
    """The KV cache of every prompt but its last token, laid out as generate() lays out its own
    (left-padded to width - 1), each distinct prompt computed once (a group's episodes often
    reach the same step with the same prompt), PREFILL_ROWS at a time sorted by length so that
    padding costs little. Pad positions hold whatever the attention mask hides. None when there
    is nothing to cache, or the model's cache is not a plain one (sliding windows and other
    layouts are left to generate())."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    distinct = list(dict.fromkeys(tuple(p) for p in prompts))
    cached = [k for k, p in enumerate(distinct) if len(p) > 1]  # one token: its slot stays padding
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for group in length_sorted_chunks(cached, [len(p) for p in distinct], PREFILL_ROWS):
        heads = [distinct[k][:-1] for k in group]
        group_width = max(len(h) for h in heads)
        ids, mask, position_ids, _, _ = pad_prompt_response(heads, [[]] * len(heads), pad_id)
        cache = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                      position_ids=position_ids.to(device), use_cache=True,
                      logits_to_keep=1).past_key_values
        if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer
                                                      for layer in cache.layers):
            return None
        for n, layer in enumerate(cache.layers):
            if n == len(keys):
                heads_kv, _, head_dim = layer.keys.shape[1:]
                shape = (len(distinct), heads_kv, width - 1, head_dim)
                keys.append(layer.keys.new_zeros(shape))
                values.append(layer.values.new_zeros(shape))
            slots = torch.tensor(group, device=layer.keys.device)
            keys[n][slots, :, width - 1 - group_width:] = layer.keys
            values[n][slots, :, width - 1 - group_width:] = layer.values
    if not keys:
        return None
    slot_of = {p: k for k, p in enumerate(distinct)}
    rows = [slot_of[tuple(p)] for p in prompts]
    repeated = len(distinct) < len(prompts)

    def layers():  # one layer at a time, each freed once the cache holds its own copy
        while keys:
            layer_keys, layer_values = keys.pop(0), values.pop(0)
            if repeated:
                index = torch.tensor(rows, device=layer_keys.device)
                layer_keys, layer_values = layer_keys[index], layer_values[index]
            yield layer_keys, layer_values

    return DynamicCache(ddp_cache_data=layers())


@contextlib.contextmanager
def _decode_threads(model, device):
    """Decode a small model on one CPU thread: a tiny model's decoding step is a few hundred small
    operations, and with OpenMP's threads asleep between them (OMP_WAIT_POLICY=PASSIVE, as the
    scripts set) waking the second thread for each made the steps twice as slow as on one
    (docs/performance.md). A large model's step is bound by reading its weights, which every
    thread helps with."""
    small = sum(p.numel() for p in model.parameters()) < ONE_THREAD_DECODE_PARAMETERS
    if torch.device(device).type != "cpu" or not small:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], *, pad_id: int, eos_ids: list[int],
                max_new_tokens: int, temperature: float, top_p: float = 1.0,
                batch_size: int = 64, return_logprobs: bool = False,
                keys: list[tuple] | None = None):
    """Response ids for each prompt, cut after the first eos (which is kept); temperature 0 =
    greedy. Sampling draws from torch's global generator, which --seed fixes, or with `keys` (a
    tuple per prompt) by KeyedRace: token t of prompt k is fixed by (*keys[k], t), whatever the
    batch. With return_logprobs (temperature > 0 without top-p only): (responses, logprobs), each
    token's log-probability under softmax(logits / temperature), the distribution it was drawn
    from.

    Prompts go in batches of `batch_size`, each prefilled first, a distinct prompt once
    (_prefilled_cache); generate() continues from that cache: the same replies as generate() on
    the whole batch, with less work when prompts repeat or differ in length."""
    _check_recordable(return_logprobs, temperature, top_p)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    keyed = keys is not None and temperature > 0
    # Keyed: generate() takes the argmax of what KeyedRace leaves, the one token it drew.
    config = sampling_config(temperature=0.0 if keyed else temperature, top_p=top_p,
                             max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
    out: list[list[int]] = []
    logprobs: list[list[float]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids, mask = pad_prompt_response(chunk, [[]] * len(chunk), pad_id)[:2]
        cache = _prefilled_cache(model, chunk, width, pad_id, device)
        if keyed:
            recorder = KeyedRace(temperature, top_p, keys[start:start + batch_size], width)
        else:
            recorder = SampledLogprobs(temperature) if return_logprobs else None
        with _without_checkpoint_generation_config(model), _decode_threads(model, device):
            generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                       past_key_values=cache, generation_config=config,
                                       logits_processor=[recorder] if recorder else None)
        new_tokens = generated[:, width:]
        chosen = recorder.finish(new_tokens).cpu() if return_logprobs else None
        for k, row in enumerate(new_tokens.tolist()):
            cut = _through_first_eos(row, eos_ids)
            out.append(row[:cut])
            if return_logprobs:
                logprobs.append(chosen[k, :cut].tolist())
    model.train(was_training)
    return (out, logprobs) if return_logprobs else out


class ContinuousBatching:
    """transformers' continuous batching (`generate_batch`'s engine: a paged KV cache, prompt
    prefixes shared between requests) with one manager per sampling setting, kept for the whole
    run: a lock-step rollout generates at every environment step, and a manager made per call
    would allocate its cache and warm up every time. Same contract and tokens as hf_generate,
    drawing from torch's global generator too (docs/running.md says what is tested).

    A manager's KV cache holds `max_requests` sequences of `max_sequence_tokens` tokens (prompt +
    response); more requests wait for a slot. Built for a GPU with flash attention; on CPU it is
    slower than hf_generate (docs/performance.md, "Rollout speed"). close() frees the caches."""

    PAGE_TOKENS = 64  # a page of KV cache; sequences here are short (a few hundred to 2k tokens)
    # Tokens in one forward pass. Without flash attention the engine holds a dense mask of this
    # many rows over the whole cache (1024 rows: near 0.6 GB for 64 sequences of 2k tokens), and
    # every query attends over the keys of the whole batch: a decoding step costs batch^2.
    BATCH_TOKENS = 1024
    SAMPLING_PROCESSORS = {"TemperatureLogitsWarper", "TopPLogitsWarper"}

    def __init__(self, model, *, pad_id: int, eos_ids: list[int], max_new_tokens: int,
                 max_sequence_tokens: int, max_requests: int = 64):
        self.model, self.pad_id, self.eos_ids = model, pad_id, list(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.max_sequence_tokens, self.max_requests = max_sequence_tokens, max_requests
        self.managers: dict = {}

    def _manager(self, key: tuple[float, float, bool]):
        """The running manager of a (temperature, top_p, return_logprobs) setting: built on first
        use, and built again if an earlier call failed or was interrupted (its loop died, or
        still holds requests)."""
        manager = self.managers.get(key)
        if manager is not None:
            if manager.is_running() and not manager.batch_processor.has_pending_requests():
                return manager
            manager.destroy()
            del self.managers[key]
        temperature, top_p, return_logprobs = key
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        config = sampling_config(temperature=temperature, top_p=top_p,
                                 max_new_tokens=self.max_new_tokens, eos_ids=self.eos_ids,
                                 pad_id=self.pad_id)
        pages_per_sequence = math.ceil(self.max_sequence_tokens / self.PAGE_TOKENS) + 1
        # With flash attention installed the engine switches the model to it (its fast path:
        # no mask over the whole batch, CUDA graphs), until close(); the update runs with it too.
        cb_config = ContinuousBatchingConfig(
            page_size=self.PAGE_TOKENS, num_blocks=self.max_requests * pages_per_sequence,
            max_batch_tokens=self.BATCH_TOKENS, return_logprobs=return_logprobs)
        hints = WorkloadHints(max_prompt_length=self.max_sequence_tokens - self.max_new_tokens,
                              max_generated_length=self.max_new_tokens,
                              num_requests=self.max_requests)
        inner = self.model
        if hasattr(inner, "get_base_model"):  # a peft model: the engine drives the LoRA'd model
            inner = inner.get_base_model()
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            manager = inner.init_continuous_batching(generation_config=config,
                                                     continuous_batching_config=cb_config,
                                                     workload_hints=hints)
            manager.warmup()  # builds the cache and the batch processor, which reseeds torch
        processors = {type(p).__name__ for p in manager.logit_processor.logits_processor}
        if not processors <= self.SAMPLING_PROCESSORS:  # anything else would change the policy
            manager.destroy()
            raise RuntimeError(f"continuous batching would apply {sorted(processors)}")
        # The loop thread runs until close(): stopping it after every call costs a join and a
        # garbage collection (0.3 s a call on CPU). Between calls it waits for requests. It is
        # started as manager.start() does, but as a daemon, so that a run that ends without
        # close() (an error, Ctrl-C) is not kept alive by it.
        manager.background_thread_status.clear()
        manager._generation_thread = threading.Thread(target=manager._run_generation_loop,
                                                      daemon=True)
        manager._generation_thread.start()
        self.managers[key] = manager
        return manager

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, temperature: float, top_p: float = 1.0,
                 return_logprobs: bool = False):
        """Response ids for each prompt, cut after the first eos (kept); with return_logprobs
        (temperature > 0, top_p == 1), also their log-probs: as hf_generate."""
        _check_recordable(return_logprobs, temperature, top_p)
        if not prompts:
            return ([], []) if return_logprobs else []
        longest = self.max_sequence_tokens - self.max_new_tokens
        if not all(1 <= len(p) <= longest for p in prompts):  # the engine would fail the batch
            raise ValueError(f"every prompt needs 1 to {longest} tokens (max_sequence_tokens "
                             f"{self.max_sequence_tokens} - max_new_tokens "
                             f"{self.max_new_tokens}); got {min(map(len, prompts))} to "
                             f"{max(map(len, prompts))}")
        was_training = self.model.training  # building a manager sets eval mode
        self.model.eval()
        manager = self._manager((temperature, top_p if temperature > 0 else 1.0,
                                 return_logprobs))
        results = {}
        try:
            with manager.pause():  # the loop takes the requests only once all are queued
                # Prompt blocks cached by an earlier call hold keys and values of the weights of
                # then: shared prefixes are reused within a call only.
                manager.batch_processor.cache.reset()
                ids = manager.add_requests(inputs=prompts, max_new_tokens=self.max_new_tokens)
            wanted = set(ids)
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished() and result.request_id in wanted:
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("the continuous batching loop stopped: "
                                       f"{manager.background_thread_status.fatal_error}")
        finally:
            self.model.train(was_training)
        out, logprobs = [], []
        for request_id in ids:
            result = results[request_id]
            if result.error is not None:
                raise RuntimeError(f"continuous batching failed a request: {result.error}")
            tokens = list(result.generated_tokens)
            cut = _through_first_eos(tokens, self.eos_ids)
            out.append(tokens[:cut])
            logprobs.append(list(result.logprobs[:cut]))
        return (out, logprobs) if return_logprobs else out

    def close(self) -> None:
        """Stop every manager's loop thread and free its cache (and restore the attention
        implementation the engine may have switched to)."""
        for manager in self.managers.values():
            manager.stop(block=True)
            manager.destroy()
        self.managers.clear()


def release_cached_memory() -> None:
    """Hand the GPU memory this process's allocator keeps cached back to the device, for vLLM's
    engine (a process of its own) to take."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_vllm_engine(model_path: str, args):
    """A vLLM engine over the base weights at `model_path` with LoRA enabled (args: a script's
    Args). generation_config="vllm" keeps the checkpoint's sampling defaults out, as in
    hf_generate; processed log-probs are those of softmax(logits / temperature), the
    distribution a token was drawn from. vLLM refuses to start unless gpu_memory_utilization x
    the GPU's memory is free, so what this process's allocator keeps cached goes back first."""
    try:
        from vllm import LLM
    except ImportError as e:
        raise UsageError("--backend vllm needs vLLM on a CUDA machine: pip install -r "
                         f"requirements.txt -r requirements-gpu.txt ({e})") from e
    release_cached_memory()
    return LLM(model=model_path, enable_lora=True, max_lora_rank=args.lora_r, max_loras=1,
               gpu_memory_utilization=args.vllm_gpu_memory_utilization,
               max_model_len=args.max_prompt_tokens + args.max_new_tokens, seed=args.seed,
               enable_prefix_caching=True, generation_config="vllm",
               logprobs_mode="processed_logprobs", enable_sleep_mode=args.vllm_sleep)


def vllm_generate(engine, prompts: list[list[int]], *, adapter_path: str, adapter_version: int,
                  eos_ids: list[int], max_new_tokens: int, temperature: float,
                  top_p: float = 1.0, return_logprobs: bool = False,
                  keys: list[tuple] | None = None):
    """Same contract as hf_generate (with return_logprobs: the log-prob vLLM sampled each token
    with, logprobs=0 asking for the sampled token's alone). With `keys`, each request is seeded
    by key_seed of its key: vLLM's own race then fixes its draws by (seed, token position), not
    hf's noise (docs/running.md). `adapter_version` must change whenever the adapter on disk
    changes: vLLM caches adapters by id."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    _check_recordable(return_logprobs, temperature, top_p)
    sampling = dict(temperature=temperature, top_p=top_p if temperature > 0 else 1.0, top_k=0,
                    min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                    frequency_penalty=0.0, max_tokens=max_new_tokens, stop_token_ids=eos_ids,
                    detokenize=False, logprobs=0 if return_logprobs else None)
    if keys is not None and temperature > 0:
        params = [SamplingParams(**sampling, seed=key_seed(key)) for key in keys]
    else:
        params = SamplingParams(**sampling)
    request = LoRARequest(f"policy-{adapter_version}", adapter_version, adapter_path)
    outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           lora_request=request, use_tqdm=False)
    responses = [list(o.outputs[0].token_ids) for o in outs]
    if not return_logprobs:
        return responses
    logprobs = [[step[token].logprob for token, step in zip(c.token_ids, c.logprobs)]
                for c in (o.outputs[0] for o in outs)]
    return responses, logprobs


class Policy:
    """What a rollout needs to act: the model, its tokenizer and the chosen generation backend
    (args: a script's Args; backend, max_new_tokens, max_prompt_tokens, micro_batch_size)."""

    def __init__(self, args, model, tokenizer, engine=None):
        self.args, self.model, self.tokenizer, self.engine = args, model, tokenizer, engine
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.adapter_path, self.adapter_version = "", 0
        self.measure_gap, self.gaps = False, []  # vLLM's log-probs against the trainer's
        self.asleep = False
        self.batcher = None
        if args.backend == "hf-cb":  # its engines (one per sampling setting) live for the run
            self.batcher = ContinuousBatching(
                model, pad_id=tokenizer.pad_token_id, eos_ids=self.eos_ids,
                max_new_tokens=args.max_new_tokens,
                max_sequence_tokens=args.max_prompt_tokens + args.max_new_tokens,
                max_requests=max(args.micro_batch_size, 64))

    def sync(self, run_path: str) -> None:
        """vLLM reads the adapter from disk: write the current one under a new version id (one
        process writes it, every process has the same weights)."""
        if self.engine is not None:
            self.adapter_version += 1
            self.adapter_path = os.path.join(run_path, "vllm_adapter")
            if PartialState().is_main_process:  # no hub lookup of the base model
                self.model.save_pretrained(self.adapter_path, save_embedding_layers=False)
            PartialState().wait_for_everyone()
            self.measure_gap = True

    def generate(self, prompts: list[list[int]], temperature: float, top_p: float = 1.0,
                 keys: list[tuple] | None = None) -> tuple[list[list[int]], list | None]:
        """(responses, log-probs of their tokens or None). Sampling without top-p (every training
        rollout) records the log-probs the tokens were drawn with: PPO's old log-probs without
        another forward pass. vLLM's come from other kernels (bf16), so after each sync the first
        call also scores its first micro-batch with the trainer: stats() reports the gap.
        --sampler keyed: token t of prompt k is drawn by the key (*keys[k], t), where the step
        stands (a rollout's keys); a caller without keys gets keys drawn from torch's stream."""
        a = self.args
        record = temperature > 0 and top_p == 1
        if a.sampler != "keyed" or temperature == 0:
            keys = None
        elif keys is None:
            keys = [("torch", n) for n in torch.randint(2**62, (len(prompts),)).tolist()]
        if self.engine is not None:
            self.wake_up()
            out = vllm_generate(self.engine, prompts, adapter_path=self.adapter_path,
                                adapter_version=self.adapter_version, eos_ids=self.eos_ids,
                                max_new_tokens=a.max_new_tokens, temperature=temperature,
                                top_p=top_p, return_logprobs=record, keys=keys)
            if record and self.measure_gap:
                self.gaps.append(self.logprob_gap(prompts, *out, temperature))
                self.measure_gap = False
        elif self.batcher is not None:  # keys are refused with hf-cb (common/config.py)
            out = self.batcher.generate(prompts, temperature=temperature, top_p=top_p,
                                        return_logprobs=record)
        else:
            out = hf_generate(self.model, prompts, pad_id=self.tokenizer.pad_token_id,
                              eos_ids=self.eos_ids, max_new_tokens=a.max_new_tokens,
                              temperature=temperature, top_p=top_p,
                              batch_size=max(a.micro_batch_size, 64), return_logprobs=record,
                              keys=keys)
        return out if record else (out, None)

    def sleep(self) -> None:
        """With --vllm-sleep, free the engine's GPU memory for the update; generate wakes it."""
        if self.engine is not None and self.args.vllm_sleep and not self.asleep:
            self.engine.sleep(level=1)  # the weights (LoRA slots too) to host, KV cache dropped
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:  # what the update left in this process's cache goes back first
            release_cached_memory()
            self.engine.wake_up()
            self.asleep = False

    def close(self) -> None:
        """hf-cb: free its KV caches and give the model its attention back (the end of a run)."""
        if self.batcher is not None:
            self.batcher.close()

    def logprob_gap(self, prompts: list[list[int]], responses: list[list[int]],
                    logprobs: list[list[float]], temperature: float) -> float:
        """Mean |log pi_trainer - log pi_sampler| over the response tokens of the first
        micro-batch: 0 up to rounding when the sampler is the trainer's model. PPO's ratio starts
        at exp of this difference; a gap of 0.05 or more wants an importance correction."""
        n = self.args.micro_batch_size
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            trainer, _, _ = response_logprobs(self.model, prompts[:n], responses[:n],
                                              self.tokenizer.pad_token_id,
                                              temperature=temperature)
        self.model.train(was_training)
        gaps = [abs(t - s) for row, sampled in zip(trainer.tolist(), logprobs[:n])
                for t, s in zip(row, sampled)]
        return sum(gaps) / max(len(gaps), 1)

    def stats(self) -> dict:
        """What the backend measured since the last call: vLLM's log-prob gap ({} otherwise)."""
        if not self.gaps:
            return {}
        gap, self.gaps = sum(self.gaps) / len(self.gaps), []
        return {"rollout/sampler_logprob_gap": gap}
