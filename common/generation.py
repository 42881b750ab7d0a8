"""Batched generation: transformers `generate` with a KV cache (default, CPU or GPU) or vLLM with
the current LoRA adapter (GPU, optional). Prompts and responses are token ids, so both backends
return exactly the tokens the policy is later trained on.

Sampling is exactly softmax(logits / temperature), optionally top-p truncated, and nothing else:
a checkpoint's own generation config (Qwen2.5-Instruct ships repetition_penalty, top_k, top_p
and temperature) is ignored, because PPO scores the sampled tokens under softmax(logits / T) and
any other logits processor would make the rollout policy differ from the one being trained."""

from __future__ import annotations

import contextlib

import torch

from common import UsageError


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


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], *, pad_id: int, eos_ids: list[int],
                max_new_tokens: int, temperature: float, top_p: float = 1.0,
                batch_size: int = 64, return_logprobs: bool = False):
    """Response ids for each prompt, cut after the first eos (which is kept). temperature 0 =
    greedy. Sampling draws from torch's global generator, which --seed fixes.

    With return_logprobs (sampling at temperature > 0 without top-p only), also the
    log-probability of each response token under softmax(logits / temperature), the distribution
    it was drawn from: (responses, logprobs), lists of equal lengths."""
    if return_logprobs and (temperature <= 0 or top_p < 1):
        raise ValueError("return_logprobs needs temperature > 0 and top_p == 1")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    config = sampling_config(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                             eos_ids=eos_ids, pad_id=pad_id)
    out: list[list[int]] = []
    logprobs: list[list[float]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        recorder = SampledLogprobs(temperature) if return_logprobs else None
        with _without_checkpoint_generation_config(model):
            generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                       generation_config=config,
                                       logits_processor=[recorder] if recorder else None)
        new_tokens = generated[:, width:]
        chosen = recorder.finish(new_tokens).cpu() if recorder else None
        for k, row in enumerate(new_tokens.tolist()):
            cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
            out.append(row[:cut])
            if recorder:
                logprobs.append(chosen[k, :cut].tolist())
    model.train(was_training)
    return (out, logprobs) if return_logprobs else out


def make_vllm_engine(model_path: str, *, max_lora_rank: int, gpu_memory_utilization: float,
                     max_model_len: int, seed: int):
    """A vLLM engine over the base weights at `model_path` with LoRA enabled. generation_config=
    "vllm" keeps the checkpoint's sampling defaults out, as in hf_generate."""
    try:
        from vllm import LLM
    except ImportError as e:
        raise UsageError("--backend vllm needs vLLM on a CUDA machine: pip install -r "
                         f"requirements.txt -r requirements-gpu.txt ({e})") from e
    return LLM(model=model_path, enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1,
               gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
               seed=seed, enable_prefix_caching=True, generation_config="vllm")


def vllm_generate(engine, prompts: list[list[int]], *, adapter_path: str, adapter_version: int,
                  eos_ids: list[int], max_new_tokens: int, temperature: float,
                  top_p: float = 1.0) -> list[list[int]]:
    """Same contract as hf_generate. `adapter_version` must change whenever the adapter on disk
    changes: vLLM caches adapters by id."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    params = SamplingParams(temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                            top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                            frequency_penalty=0.0, max_tokens=max_new_tokens,
                            stop_token_ids=eos_ids)
    request = LoRARequest(f"policy-{adapter_version}", adapter_version, adapter_path)
    outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           lora_request=request, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
