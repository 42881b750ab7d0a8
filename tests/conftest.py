import os
import sys

import pytest

# Tests never reach a model hub: a hub id that is not cached must fail at once, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _run_dirs():
    runs = os.path.join(ROOT, "runs")
    return set(os.listdir(runs)) if os.path.isdir(runs) else set()


@pytest.fixture(scope="session", autouse=True)
def no_run_directories_in_the_checkout():
    """Every test writes its runs to a temporary directory, never to the checkout's runs/."""
    before = _run_dirs()
    yield
    assert _run_dirs() == before, "a test left a run directory in runs/"
