"""benchmarks/gpu_check.py on CPU at a 1-layer Qwen2.5-0.5B shape (random weights): one script on
one backend and its resume, each row passed and timed by part."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_check_runs_on_cpu_and_tables_every_run(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--scripts", "proxmo.py",
                             "--backends", "hf", "--skip-throughput", "--layers", "1",
                             "--new-tokens", "4",
                             "--out", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "gpu_check.md") as f:
        text = f.read()
    assert "random Qwen2.5-0.5B weights, 1 layer(s)" in text
    rows = [line.strip("| ").split(" | ") for line in text.splitlines()
            if line.startswith("| proxmo.py")]
    assert [r[0] for r in rows] == ["proxmo.py hf", "proxmo.py hf --resume (iteration 3)"]
    header = [c.strip() for c in text.split("| run |")[1].split("\n")[0].strip(" |").split(" | ")]
    for row in rows:
        cells = dict(zip(["run", *header], row))
        assert cells["passed"] == "yes"
        assert float(cells["s / iteration"]) > float(cells["update"]) > 0
        assert float(cells["generation"]) > 0 and float(cells["peak RSS GB"]) > 0.1


def test_the_gpu_check_refuses_a_nonsensical_flag():
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--layers", "0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--layers must be >= 1 (got 0)" in result.stderr
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--timeout", "nan"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--timeout must be >= 1 (got nan)" in result.stderr
