"""benchmarks/same_behaviour.py's comparison: what counts as the same run and what does not."""

import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import same_behaviour  # noqa: E402


def case(loss=0.5, adapter="ab12", success=0.25):
    return {"scalars": {"train/loss": [[1, loss]], "credit/auc": [[1, math.nan]]},
            "files": {"adapter_model.safetensors": adapter},
            "evaluations": {"0": {"eval_test/success": success, "eval_test/tasks": 6}}}


def test_equal_runs_have_no_differences_and_nan_equals_nan():
    assert same_behaviour.differences({"a": case()}, {"a": case()}) == []


def test_each_changed_part_is_named():
    before = {"a": case(), "b": case()}
    after = {"a": case(loss=0.6, adapter="cd34"), "c": case()}
    found = same_behaviour.differences(before, after)
    assert "a: scalars train/loss: [[1, 0.5]] -> [[1, 0.6]]" in found
    assert "a: files adapter_model.safetensors: ab12 -> cd34" in found
    assert "b: only in before" in found and "c: only in after" in found
    assert len(found) == 4


def test_tensors_are_compared_by_content_not_by_pickle():
    state = {"torch": torch.arange(4, dtype=torch.uint8), "numpy": ("MT", np.arange(3), 2)}
    copy = {"numpy": ("MT", np.arange(3), 2), "torch": torch.arange(4, dtype=torch.uint8)}
    assert same_behaviour.digest(state) == same_behaviour.digest(copy)
    copy["torch"][0] = 9
    assert same_behaviour.digest(state) != same_behaviour.digest(copy)


def test_timing_scalars_count_by_their_steps_not_their_values():
    """A timing's value measures the machine; which timings are logged, and at which steps, is
    the run's. Fingerprints saved before timings were kept compare without them."""
    before = {"a": {**case(), "timings": {"time/env_seconds": [1, 2]}}}
    same = {"a": {**case(), "timings": {"time/env_seconds": [1, 2]}}}
    fewer = {"a": {**case(), "timings": {"time/env_seconds": [1]}}}
    assert same_behaviour.differences(before, same) == []
    assert same_behaviour.differences(before, fewer) == [
        "a: timings time/env_seconds: [1, 2] -> [1]"]
    assert same_behaviour.differences({"a": case()}, fewer) == []
