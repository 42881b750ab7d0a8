"""benchmarks/throughput.py: the bandwidth bound worked by hand, and the whole benchmark at a tiny
size (both backends and the update; one proxmo.py iteration with hf-cb) so that it cannot rot."""

import os
import re
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from common import UsageError  # noqa: E402
from throughput import ITERATION_PARTS, bandwidth_bound, iteration_breakdown, main  # noqa: E402


def test_bandwidth_bound_by_hand():
    # 1,000 float32 weights: 4,000 bytes. KV per token: 2 (K, V) x 2 layers x 1 KV head x 4 dims
    # (hidden 8 / 2 heads) x 4 bytes = 64. Batch 2 at context 10 + 4/2 = 12: 2 x 12 x 64 = 1,536.
    # A step reads 5,536 bytes; at 5,536,000 B/s that is 1,000 steps/s: 2,000 tokens/s.
    config = types.SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                                   num_hidden_layers=2, head_dim=None)
    model = types.SimpleNamespace(config=config, parameters=lambda: iter([torch.zeros(1000)]))
    assert bandwidth_bound(model, batch=2, prompt_tokens=10, new_tokens=4,
                           bandwidth=5_536_000) == pytest.approx(2000)


def run(*flags):
    return subprocess.run([sys.executable, "benchmarks/throughput.py", *flags], cwd=ROOT,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True,
                          text=True, timeout=600)


def test_the_benchmark_at_a_tiny_size():
    # A given bandwidth, not a measured one: the bound is arithmetic, whatever the machine's load
    # (the tiny model fits in cache, where a measured copy's bandwidth says nothing). 1 TB/s is
    # above what any CPU core reads, so decoding stays below the bound.
    result = run("--batch", "4", "--prompt-tokens", "24", "--new-tokens", "6", "--repeats", "1",
                 "--update-batch", "3", "--micro-batch", "2", "--gradient-checkpointing",
                 "--device", "cpu", "--bandwidth-gbs", "1000")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    rows = {m.group(1): m for m in re.finditer(
        r"^\| (hf|hf-cb) \| 4 \| ([\d,]+) \| ([\d,]+|not measurable) \| ([\d,]+) \| "
        r"([\d.]+|nan) \| (-|yes) \|", out, re.M)}
    assert set(rows) == {"hf", "hf-cb"} and rows["hf-cb"].group(6) == "yes"
    for row in rows.values():
        call, bound = (float(row.group(k).replace(",", "")) for k in (2, 4))
        assert 0 < call < bound
        if row.group(3) != "not measurable":  # a busy machine can leave no decoding time
            decode = float(row.group(3).replace(",", ""))
            assert 0 < decode < bound
            assert float(row.group(5)) == pytest.approx(decode / bound, abs=1e-3)
    assert re.search(r"^\| LoRA r16 \| 3 x 30 \| 2 \| yes \| [\d,]+ \| [\d.]+ \(peak RSS\) \|$",
                     out, re.M)


def test_one_iteration_split_into_its_parts():
    parts = iteration_breakdown("hf-cb", "cpu", tasks=1)
    assert set(parts) == {*ITERATION_PARTS, "iteration"}
    assert parts["generation"] > 0 and parts["update"] > 0
    assert sum(parts[p] for p in ITERATION_PARTS) <= parts["iteration"]


@pytest.mark.parametrize("flags, message", [
    (["--batch", "0"], "--batch must be >= 1"),
    (["--model", "shape:Qwen9-1B"], "known shapes are"),
    (["--layers", "2"], "--layers is for shape:NAME models only"),
    (["--bandwidth-gbs", "-1"], "--bandwidth-gbs must be > 0"),
    (["--bandwidth-gbs", "nan"], "--bandwidth-gbs must be > 0 (got nan)"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--device", "tpu"], "--device tpu: cpu, cuda or cuda:N"),
])
def test_bad_input_is_a_clear_error(flags, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        main(flags)


def test_bad_input_exits_2_without_a_traceback():
    result = run("--batch", "0", "--new-tokens", "1")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--batch must be >= 1" in result.stderr and "--new-tokens must be >= 2" in result.stderr
    assert "Traceback" not in result.stderr
