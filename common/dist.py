"""Data parallel (`accelerate launch --num_processes K <script>.py ...`): every process holds the
same policy, plays a contiguous share of each iteration's task groups (a group never straddles two
processes) and of the evaluation tasks, and sums its gradients with the others' before every
optimizer step. `python <script>.py` is one process, and nothing here communicates then."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
from accelerate import PartialState
from accelerate.utils import broadcast, gather_object, reduce
from torch import Tensor


def start_processes(args) -> PartialState:
    """This process's PartialState (gloo between CPU processes, NCCL between GPUs), whose
    collectives wait up to --process-timeout-minutes for the slowest process (torch's own 10
    minutes for NCCL is too short for a long evaluation). Only the first PartialState of a
    process sets this: call it before any other (start_run refuses, before it, a timeout out
    of common/config.py's range, which no process group could start with)."""
    return PartialState(cpu=args.device == "cpu",
                        timeout=timedelta(minutes=args.process_timeout_minutes))


def launch_errors(args, dist: PartialState, script: str, also: str = "") -> list[str]:
    """What a data-parallel launch cannot do, one line each ([] with one process). `also`: more
    flags the RL launch after behavior cloning takes."""
    if dist.num_processes == 1:
        return []
    errors = []
    if args.tasks_per_iteration % dist.num_processes:
        errors.append(f"--tasks-per-iteration {args.tasks_per_iteration} must be a multiple "
                      f"of the {dist.num_processes} processes (whole groups per process)")
    if args.bc_epochs > 0 and not args.resume:
        errors.append(f"behavior cloning runs in one process: run `python {script} ... "
                      "--iterations 0` once, then launch RL with --model <its "
                      f"run>/base_model{also}")
    if args.backend == "vllm":  # each engine would pick its GPU itself: untested, refused
        errors.append("--backend vllm runs in one process; with several, use --backend hf")
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", dist.num_processes))
    if args.device.startswith("cuda") and per_machine > torch.cuda.device_count():
        errors.append(f"{per_machine} processes on a machine with "
                      f"{torch.cuda.device_count()} GPUs: one GPU per process (or --device cpu)")
    return errors


def process_share(n: int, index: int, count: int) -> range:
    """The contiguous block of range(n) that process `index` of `count` takes (sizes differ by at
    most one; in process order the blocks are range(n))."""
    return range(n * index // count, n * (index + 1) // count)


def my_share(batch: list, copies: int = 1) -> tuple[list, list[int]]:
    """This process's share of `batch` (an iteration's tasks, or an evaluation's): its items,
    each `copies` times (a task's group), and their indices in `batch` (the group ids). One
    process: every item, indices 0..len(batch) - 1."""
    dist = PartialState()
    share = process_share(len(batch), dist.process_index, dist.num_processes)
    return ([batch[i] for i in share for _ in range(copies)],
            [i for i in share for _ in range(copies)])


def whole_batch(mine: list) -> tuple[list, slice]:
    """Every process's items (`mine` on each), in process order, and where this process's lie
    in them. One process: (mine, slice(0, len(mine)))."""
    by_process = gather_object([mine])
    first = sum(len(items) for items in by_process[:PartialState().process_index])
    return [x for items in by_process for x in items], slice(first, first + len(mine))


def same_start(params: list[Tensor], seed: int) -> None:
    """Every process starts from process 0's trainable weights, whatever each device's init did;
    each process then samples its own draws (process 0 continues the one-process stream)."""
    dist = PartialState()
    if dist.num_processes == 1:
        return
    for p in params:
        if p.requires_grad:
            broadcast(p.data, from_process=0)
    if dist.process_index > 0:
        torch.manual_seed(seed + 100_003 * dist.process_index)


class MiniBatch(NamedTuple):
    epoch: int  # 0-based pass over the batch
    start: int  # where the mini-batch starts in the batch's shuffled order
    mine: list[int]  # its members among this process's samples (indices into them)
    size: int  # its members over every process
    tokens: int  # its response tokens over every process


def minibatches(response_lengths: list[int], size: int, epochs: int,
                generator: torch.Generator) -> Iterator[MiniBatch]:
    """The mini-batches of `epochs` passes over one batch, each pass a fresh shuffle by
    `generator`, cut into mini-batches of `size` samples. One process: its samples, as CleanRL
    draws them. Several: `response_lengths` is this process's share, in process order, of the
    batch, the shuffle is one process's draw of the whole batch, and each process gets the
    members of each mini-batch it holds (`mine`), with the mini-batch's size and token count over
    all processes, so that summed gradients are the whole mini-batch's."""
    lengths, where = whole_batch(response_lengths)  # every process's, and where this one's lie
    for epoch in range(epochs):
        order = torch.randperm(len(lengths), generator=generator).tolist()
        for start in range(0, len(order), size):
            members = order[start:start + size]  # indices into the whole batch
            mine = [i - where.start for i in members if where.start <= i < where.stop]
            yield MiniBatch(epoch, start, mine, len(members), sum(lengths[i] for i in members))


def sum_across_processes(params: list[Tensor], loss: float) -> float:
    """Replace each parameter's gradient by its sum over processes (one all-reduce), and return
    the summed loss. Each process's loss is already divided by the mini-batch's token count over
    all processes, so the sums are the token-mean of the whole mini-batch."""
    if PartialState().num_processes == 1:
        return loss
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    loss_row = torch.tensor([loss], device=grads[0].device)
    flat = reduce(torch.cat([g.float().flatten() for g in grads] + [loss_row]), "sum")
    for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
        p.grad = g.view_as(p).to(p.dtype)
    return flat[-1].item()


def mean_across_processes(stats: dict[str, list[float]]) -> dict[str, float]:
    """The mean of each list over every process's entries. A process may lack a key (no
    micro-batch of its own in an update): the names are the union over processes."""
    dist = PartialState()
    if dist.num_processes == 1:
        return {k: float(np.mean(v)) for k, v in stats.items()}
    names = sorted({k for keys in gather_object([sorted(stats)]) for k in keys})
    sums = torch.tensor([[sum(stats.get(k, [])), len(stats.get(k, []))] for k in names],
                        dtype=torch.float64, device=dist.device)
    sums = reduce(sums, "sum")
    return {k: (sums[i, 0] / sums[i, 1]).item() for i, k in enumerate(names)}

