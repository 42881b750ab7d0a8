"""benchmarks/credit_vs_lead.py: the paired leads and the table worked by hand on made-up
records (PPO's in hisr.py's folder, a side run with extra flags beside it unread, 3SPO's at two
settings in the folders named by their flags), a method without records left out, and a share of
the oracle's lead only where the oracle leads."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import credit_vs_lead  # noqa: E402
from credit import LABELS  # noqa: E402

KEY = "eval_valid_unseen/"


def record(folder, name, start, end):
    os.makedirs(folder, exist_ok=True)
    evaluation = {KEY + "grounding": 0.5, KEY + "episode_length": 30.0}
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump({"evaluations": {"0": {**evaluation, KEY + "success": start},
                                   "10": {**evaluation, KEY + "success": end}},
                   "train_success": [], "minutes": 1.0}, f)


def test_leads_and_table_by_hand(tmp_path):
    table = tmp_path / "table.md"
    rows = [(LABELS["oracle"], 0.99), (LABELS["gigpo"], 0.65), (LABELS["proxmo"], 0.64),
            (LABELS["ppo"], 0.65), (LABELS["sspo"], 0.69)]
    table.write_text("header\n\n| estimator | same-state AUC | sign agreement |\n"
                     "| --- | --- | --- |\n"
                     + "".join(f"| {label} | {auc:.3f} +- 0.010 | 1 |\n" for label, auc in rows))
    keyed = tmp_path / "keyed"
    for seed, (start, grpo, oracle, gigpo) in {1: (0.3, 0.4, 0.6, 0.5),
                                               2: (0.5, 0.5, 0.7, 0.5),
                                               3: (0.4, 0.6, 0.6, None)}.items():
        record(keyed / "proxmo.py", f"grpo-seed{seed}", start, grpo)
        record(keyed / "proxmo.py", f"oracle-seed{seed}", start, oracle)
        if gigpo is not None:
            record(keyed / "proxmo.py", f"gigpo-seed{seed}", start, gigpo)
    record(keyed / "hisr.py", "ppo-seed1", 0.3, 0.3)
    record(keyed / "hisr.py" / "grounding-form-eq8", "ppo-seed1", 0.3, 0.9)  # a side run: unread
    record(keyed / "sspo.py" / "tasks-per-iteration-3", "sspo-seed2", 0.5, 0.6)
    record(keyed / "sspo.py" / "tasks-per-iteration-8", "sspo-seed1", 0.3, 0.2)
    record(keyed / "sspo.py" / "tasks-per-iteration-8", "sspo-seed3", 0.4, 0.7)
    (keyed / "proxmo.py" / "gigpo-seed1 copy.json").write_text("not a record")  # not read
    placebo = tmp_path / "previous"
    record(placebo, "grpo-seed1", 0.3, 0.5)
    record(placebo, "placebo-seed1", 0.3, 0.4)
    found, shuffled = credit_vs_lead.points(str(table), str(keyed), str(placebo))
    # oracle - GRPO: 0.2, 0.2, 0.0; GiGPO - GRPO over seeds 1-2: 0.1, 0.0; ProxMO never ran;
    # PPO seed 1: 0.0 - 0.1; 3SPO at N = 3, seed 2: 0.1 - 0.0; at N = 8, seeds 1 and 3:
    # -0.1 - 0.1 and 0.3 - 0.2
    assert [r["name"] for r in found] == ["oracle", "GiGPO", "PPO", "3SPO, N = 3",
                                          "3SPO, N = 8"]
    assert found[0]["differences"] == pytest.approx([0.2, 0.2, 0.0], abs=1e-12)
    assert found[1]["differences"] == pytest.approx([0.1, 0.0], abs=1e-12)
    assert found[2]["differences"] == pytest.approx([-0.1], abs=1e-12)
    assert found[3]["differences"] == pytest.approx([0.1], abs=1e-12)
    assert found[4]["differences"] == pytest.approx([-0.2, 0.1], abs=1e-12)
    assert found[3]["auc"] == found[4]["auc"] == 0.69  # one method, one credit row
    assert shuffled["differences"] == pytest.approx([-0.1], abs=1e-12)
    markdown = credit_vs_lead.table(found, shuffled).splitlines()
    # oracle: mean 0.1333, SE = sqrt((0.0667^2 * 2 + 0.1333^2) / 2 / 3) = 0.0667
    assert markdown[2] == "| oracle | 0.990 +- 0.010 | 3 | +0.133 +- 0.067 | 1.00 |"
    # GiGPO: mean 0.05, SE 0.05; its share 0.05 / 0.1333 = 0.375
    assert markdown[3] == "| GiGPO | 0.650 +- 0.010 | 2 | +0.050 +- 0.050 | 0.38 |"
    assert markdown[4] == "| PPO | 0.650 +- 0.010 | 1 | -0.100 +- nan | -0.75 |"
    # 3SPO at N = 8: mean -0.05, SE 0.15 (differences -0.2 and 0.1); share -0.05 / 0.1333
    assert markdown[6] == "| 3SPO, N = 8 | 0.690 +- 0.010 | 2 | -0.050 +- 0.150 | -0.38 |"
    assert markdown[7].startswith("| placebo (the previous protocol") and "-0.100 +- nan" in (
        markdown[7])
    # an oracle that does not lead: no shares
    found[0]["differences"] = [0.0, 0.0, 0.0]
    gigpo = credit_vs_lead.table(found, shuffled).splitlines()[3]
    assert gigpo.endswith("| +0.050 +- 0.050 | - |")
