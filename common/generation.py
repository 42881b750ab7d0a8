"""Batched generation: transformers `generate` with a KV cache (default, CPU or GPU) or vLLM with
the current LoRA adapter (GPU, optional). Prompts and responses are token ids, so both backends
return exactly the tokens the policy is later trained on."""

from __future__ import annotations

import torch

from common import UsageError


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], *, pad_id: int, eos_ids: list[int],
                max_new_tokens: int, temperature: float, top_p: float = 1.0,
                batch_size: int = 64) -> list[list[int]]:
    """Response ids for each prompt, cut after the first eos (which is kept). temperature 0 = greedy.
    Sampling draws from torch's global generator, which --seed fixes."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
            else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        seqs = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                              max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids,
                              **sampling)
        for row in seqs[:, width:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))
            out.append(row[:cut])
    model.train(was_training)
    return out


def make_vllm_engine(model_path: str, *, max_lora_rank: int, gpu_memory_utilization: float,
                     max_model_len: int, seed: int):
    """A vLLM engine over the base weights at `model_path` with LoRA enabled."""
    try:
        from vllm import LLM
    except ImportError as e:
        raise UsageError("--backend vllm needs vLLM on a CUDA machine: pip install -r requirements-gpu.txt"
                         f" ({e})") from e
    return LLM(model=model_path, enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1,
               gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, seed=seed,
               enable_prefix_caching=True)


def vllm_generate(engine, prompts: list[list[int]], *, adapter_path: str, adapter_version: int,
                  eos_ids: list[int], max_new_tokens: int, temperature: float,
                  top_p: float = 1.0) -> list[list[int]]:
    """Same contract as hf_generate. `adapter_version` must change whenever the adapter on disk
    changes: vLLM caches adapters by id."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    params = SamplingParams(temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                            max_tokens=max_new_tokens, stop_token_ids=eos_ids)
    request = LoRARequest(f"policy-{adapter_version}", adapter_version, adapter_path)
    outs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           lora_request=request, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
