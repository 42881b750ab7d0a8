"""What the end-to-end tests share: a script run as a user runs it, offline, with no ALFWorld
data, its output kept for the assertions."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_env(tmp_path, **extra: str) -> dict:
    """The environment of a test's run: no hub, ALFWORLD_DATA at a folder that does not exist."""
    return dict(os.environ, HF_HUB_OFFLINE="1", ALFWORLD_DATA=str(tmp_path / "no_alfworld"),
                **extra)


def run_script(script: str, args: list[str], tmp_path, expect: int = 0):
    """`python <script> <args>` in the checkout; its exit status must be `expect` (else the
    output's tails are the failure message). Returns the CompletedProcess."""
    result = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=script_env(tmp_path),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == expect, result.stdout[-3000:] + result.stderr[-3000:]
    return result
