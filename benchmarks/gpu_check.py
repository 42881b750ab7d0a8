"""The real run's parts on this machine, checked in one go and printed as one table.

On a GPU: random weights of the real architecture (Qwen2.5-1.5B by default, every layer, its
151,936-token embedding; nothing is downloaded: the words are the tiny model's tokenizer's), then
  1. the throughput benchmark (benchmarks/throughput.py): decode tokens/s against the bandwidth
     bound, the update's tokens/s and peak memory, without and with gradient checkpointing;
  2. a 2-iteration run of every method script on every backend (hf, hf-cb, and vllm where vLLM is
     installed), each with one epoch of behavior cloning first (the real presets of spa.py and
     hisr.py clone before RL), at a small batch: 2 tasks x 4 episodes of at most 3 steps;
  3. proxmo.py resumed for a third iteration, and on a GPU proxmo.py with --no-deterministic
     (what torch's deterministic kernels cost there).
Each row: whether the run passed, its seconds per iteration (the last iteration) by part, and its
peak memory (GPU: the device's, every process of the run together, vLLM's engine included; CPU:
the script's peak RSS). On CPU the same runs at a 2-layer Qwen2.5-0.5B with the tokenizer's
vocabulary, in minutes (tests/test_gpu_check.py runs a part of it).

    python benchmarks/gpu_check.py                     # the GPU check (about 20 min on an H100)
    python benchmarks/gpu_check.py --scripts proxmo.py --backends hf   # a part of it
    python benchmarks/gpu_check.py --model-only --out /tmp/qwen --layers 2  # a random local model
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import UsageError  # noqa: E402
from learning import training_curve  # noqa: E402
from throughput import QWEN25_SHAPES, load_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("proxmo.py", "spa.py", "istar.py", "hisr.py", "sspo.py")
# Small enough to finish in minutes, large enough that every part of every method runs.
SMALL = ["--iterations", "2", "--tasks-per-iteration", "2", "--group-size", "4",
         "--max-episode-steps", "3", "--eval-num-tasks", "2", "--eval-every", "2",
         "--save-every", "1", "--bc-epochs", "1", "--bc-num-tasks", "2"]
# spa.py: 2 iterations of 2 x 4 exploration rollouts; hisr.py: random weights never reply in
# the format the collection filter asks for.
EXTRA = {"proxmo.py": [], "istar.py": [], "sspo.py": ["--max-rollouts", "3"],
         "spa.py": ["--explore-num-tasks", "4", "--explore-rollouts", "4"],
         "hisr.py": ["--collect-num-tasks", "4", "--collect-rollouts", "2", "--collect-filter",
                     "none"]}
PARTS = ("generation", "env", "old_logprobs", "ref_logprobs", "update")


def build_model(path: str, shape: str, layers: int, vocab_size: int | None) -> int:
    """Random weights of a Qwen2.5 shape saved at `path` with the tiny model's tokenizer;
    returns the parameter count. vocab_size None: the tokenizer's."""
    from common.model import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer("tiny")
    model, _ = load_model(f"shape:{shape}", torch.float32, "cpu", layers,
                          vocab_size or len(tokenizer))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


class PeakMemory:
    """Polls, while a command runs, the GPU's used memory (device-wide, above what was used at
    the start) or, on CPU, the process's peak RSS (VmHWM), in GB."""

    def __init__(self, device: str, pid: int):
        self.device, self.pid, self.peak, self.done = device, pid, 0.0, False
        self.base = self._used() if device.startswith("cuda") else 0.0
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _used(self) -> float:
        free, total = torch.cuda.mem_get_info(self.device)
        return (total - free) / 1e9

    def _poll(self) -> None:
        while not self.done:
            if self.device.startswith("cuda"):
                self.peak = max(self.peak, self._used() - self.base)
            else:
                try:
                    with open(f"/proc/{self.pid}/status") as f:
                        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
                    self.peak = max(self.peak, kb / 1e6)
                except (OSError, StopIteration):
                    pass
            time.sleep(0.2)

    def stop(self) -> float:
        self.done = True
        self.thread.join()
        return self.peak


def slug(label: str) -> str:
    """A run's label as a file or directory name."""
    return label.replace(" ", "_").replace("/", "")


def run_script(label: str, command: list[str], runs_dir: str, device: str, log_dir: str,
               timeout: float) -> dict:
    """Run one command whose run directory is the only one in `runs_dir`; its row: passed,
    seconds of its last iteration by part, peak memory."""
    print(f"[{time.strftime('%H:%M:%S')}] {label}", file=sys.stderr, flush=True)
    log_file = os.path.join(log_dir, slug(label) + ".log")
    began = time.time()
    with open(log_file, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        memory = PeakMemory(device, process.pid)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            code = "timeout"
        peak = memory.stop()
    row = {"label": label, "passed": code == 0, "wall": time.time() - began, "peak": peak,
           "log": log_file}
    found = glob.glob(os.path.join(runs_dir, "*"))
    run_dir = found[0] if len(found) == 1 else None
    if code == 0 and run_dir:
        row["run_dir"] = run_dir
        for part in ("iteration", "rollout", *PARTS):
            values = training_curve(run_dir, f"time/{part}_seconds")
            row[part] = values[-1] if values else float("nan")
    else:
        with open(log_file) as f:
            row["error"] = f.read().strip().splitlines()[-1:] or ["(no output)"]
    return row


def table(rows: list[dict], memory: str) -> list[str]:
    lines = ["| run | passed | s / iteration | rollout | " + " | ".join(PARTS)
             + f" | run's wall s | peak {memory} GB |",
             "| --- " * (6 + len(PARTS)) + "|"]
    for r in rows:
        cells = [f"{r.get(k, float('nan')):.1f}" for k in ("iteration", "rollout", *PARTS)]
        passed = "yes" if r["passed"] else f"**no**: {r['error'][0][:80]}"
        lines.append(f"| {r['label']} | {passed} | " + " | ".join(cells)
                     + f" | {r['wall']:.0f} | {r['peak']:.2f} |")
    return lines


def main(argv: list[str]) -> str:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--shape", default=None, choices=list(QWEN25_SHAPES),
                        help="default: Qwen2.5-1.5B on CUDA, Qwen2.5-0.5B on CPU")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: all on CUDA, 2 on CPU)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="embedding rows (default: Qwen2.5's 151936 on CUDA, the "
                        "tokenizer's on CPU)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="--max-new-tokens of the runs (default: 128 on CUDA, 8 on CPU)")
    parser.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=SCRIPTS)
    parser.add_argument("--backends", nargs="+", default=None, choices=["hf", "hf-cb", "vllm"],
                        help="default: hf and hf-cb, and vllm where it is installed (CUDA)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--model-only", action="store_true",
                        help="only build the random-weight model in OUT/model, a local model "
                             "directory any script takes (--model OUT/model), and stop")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--out", default=None, help="where the model, runs and logs go "
                        "(default: a temporary directory); the table goes to OUT/gpu_check.md")
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not cuda:
        raise UsageError(f"--device {args.device}: no CUDA device here")
    for flag, value in (("--layers", args.layers), ("--vocab-size", args.vocab_size),
                        ("--new-tokens", args.new_tokens), ("--timeout", args.timeout)):
        if value is not None and not (math.isfinite(value) and value >= 1):
            raise UsageError(f"{flag} must be >= 1 (got {value})")
    has_vllm = importlib.util.find_spec("vllm") is not None
    backends = args.backends or ["hf", "hf-cb"] + (["vllm"] if on_gpu and has_vllm else [])
    if "vllm" in backends and not (on_gpu and has_vllm):
        raise UsageError("--backends vllm needs vLLM installed and a CUDA device")
    shape = args.shape or ("Qwen2.5-1.5B" if on_gpu else "Qwen2.5-0.5B")
    layers = args.layers or (None if on_gpu else 2)
    vocab_size = args.vocab_size or (151936 if on_gpu else None)
    new_tokens = args.new_tokens or (128 if on_gpu else 8)
    out = args.out or tempfile.mkdtemp(prefix="gpu_check_")
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    device_name = (torch.cuda.get_device_name(args.device) if on_gpu
                   else f"CPU, {os.cpu_count()} cores")

    model_dir = os.path.join(out, "model")
    print(f"building {shape} ({layers or 'all'} layers) in {model_dir} ...", file=sys.stderr)
    n_params = build_model(model_dir, shape, layers, vocab_size)
    if args.model_only:
        print(f"random {shape} weights ({n_params / 1e6:.0f}M parameters) in {model_dir}; try: "
              f"python proxmo.py --model {model_dir} --iterations 1 --tasks-per-iteration 2 "
              "--max-new-tokens 16 --eval-num-tasks 2 --max-episode-steps 5")
        return model_dir
    lines = [f"# GPU check: {time.strftime('%Y-%m-%d')}, {device_name}", "",
             f"Model: random {shape} weights, {layers or 'all'} layer(s), {n_params / 1e6:.0f}M "
             f"parameters; runs: --max-new-tokens {new_tokens}, " + " ".join(SMALL), ""]
    if not args.skip_throughput:
        for checkpointing in ([], ["--gradient-checkpointing"]):
            shape_args = ["--model", f"shape:{shape}", "--device", args.device]
            if layers:
                shape_args += ["--layers", str(layers)]
            sizes = [] if on_gpu else ["--batch", "8", "--prompt-tokens", "64", "--new-tokens",
                                       "8", "--repeats", "1"]
            # A process of its own each: on CPU the update's peak is the process's peak RSS.
            print(f"throughput {' '.join(checkpointing)} ...", file=sys.stderr, flush=True)
            result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                                  "throughput.py"),
                                     *shape_args, *sizes, *checkpointing],
                                    capture_output=True, text=True, cwd=ROOT)
            if result.returncode != 0:
                raise SystemExit(f"benchmarks/throughput.py failed:\n{result.stderr[-2000:]}")
            lines += [result.stdout.strip(), ""]

    def run(script: str, backend: str, label: str, *more: str) -> dict:
        runs_dir = os.path.join(out, "runs", slug(label))
        command = [sys.executable, os.path.join(ROOT, script), "--model", model_dir, "--device",
                   args.device, "--backend", backend, "--max-new-tokens", str(new_tokens),
                   "--run-dir", runs_dir, *SMALL, *EXTRA[script], *more]
        return run_script(label, command, runs_dir, args.device, os.path.join(out, "logs"),
                          args.timeout)

    def save(rows: list[dict]) -> str:
        """The table so far, written after every run: a check cut short keeps its rows."""
        text = "\n".join(lines + table(rows, "GPU" if on_gpu else "RSS")
                         + ["", f"Logs of every run: {os.path.join(out, 'logs')}"])
        with open(os.path.join(out, "gpu_check.md"), "w") as f:
            f.write(text + "\n")
        return text

    rows = []
    save(rows)  # the throughput tables
    for script in args.scripts:
        for backend in backends:
            rows.append(run(script, backend, f"{script} {backend}"))
            save(rows)
    first = rows[0] if rows else None
    if first and first["label"].startswith("proxmo.py") and first.get("run_dir"):
        resume = [sys.executable, os.path.join(ROOT, "proxmo.py"), "--resume",
                  first["run_dir"], "--iterations", "3"]
        rows.append(run_script(f"{first['label']} --resume (iteration 3)", resume,
                               os.path.dirname(first["run_dir"]), args.device,
                               os.path.join(out, "logs"), args.timeout))
        save(rows)
        if on_gpu:  # on CPU torch's deterministic kernels cost nothing measurable
            backend = first["label"].split()[1]
            rows.append(run("proxmo.py", backend, f"{first['label']} --no-deterministic",
                            "--no-deterministic"))
    text = save(rows)
    print(text)
    if not all(r["passed"] for r in rows):
        raise SystemExit(1)
    return text


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
