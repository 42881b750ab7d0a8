"""requirements-gpu.txt installs beside requirements.txt: the pinned vLLM's own pins of torch and
transformers (read by pip's resolver from the package index) admit requirements.txt's."""

import json
import os
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pins(path: str) -> dict[str, str]:
    """name -> version of every `name==version` line."""
    found = {}
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", line.strip())
            if match:
                found[match.group(1).lower()] = match.group(2)
    return found


def test_the_pinned_vllm_admits_the_pinned_torch_and_transformers(tmp_path):
    cpu, gpu = pins("requirements.txt"), pins("requirements-gpu.txt")
    assert "vllm" in gpu and {"torch", "transformers"} <= cpu.keys()
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
         "--quiet", f"vllm=={gpu['vllm']}", "--report", str(report)],
        capture_output=True, text=True, timeout=300)
    if result.returncode:
        pytest.skip(f"the package index is unreachable: {result.stderr.strip()[-300:]}")
    (package,) = json.loads(report.read_text())["install"]
    requires = {}
    for line in package["metadata"].get("requires_dist", []):
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate():
            requires[requirement.name.lower()] = requirement.specifier
    for name in ("torch", "transformers"):
        assert requires[name].contains(cpu[name], prereleases=True), (name, requires[name])
