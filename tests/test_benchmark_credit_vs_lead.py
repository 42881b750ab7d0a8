"""benchmarks/credit_vs_lead.py: the paired leads and the table worked by hand on made-up
records, and a method without records left out."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import credit_vs_lead  # noqa: E402

KEY = "eval_valid_unseen/success"


def record(folder, name, start, end):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump({"evaluations": {"0": {KEY: start}, "10": {KEY: end}}}, f)


def test_leads_and_table_by_hand(tmp_path):
    table = tmp_path / "table.md"
    table.write_text("header\n\n| estimator | same-state AUC | sign agreement |\n"
                     "| --- | --- | --- |\n"
                     "| oracle: GRPO + progress (reference, proxmo.py) | 0.990 +- 0.010 | 1 |\n"
                     "| GiGPO (proxmo.py) | 0.650 +- 0.040 | 1 |\n"
                     "| ProxMO (proxmo.py) | 0.640 +- 0.040 | 1 |\n")
    frame = tmp_path / "keyed" / "proxmo.py"
    for seed, (start, grpo, oracle, gigpo) in {1: (0.3, 0.4, 0.6, 0.5),
                                               2: (0.5, 0.5, 0.7, 0.5),
                                               3: (0.4, 0.6, 0.6, None)}.items():
        record(frame, f"grpo-seed{seed}", start, grpo)
        record(frame, f"oracle-seed{seed}", start, oracle)
        if gigpo is not None:
            record(frame, f"gigpo-seed{seed}", start, gigpo)
    placebo = tmp_path / "previous"
    record(placebo, "grpo-seed1", 0.3, 0.5)
    record(placebo, "placebo-seed1", 0.3, 0.4)
    rows, shuffled = credit_vs_lead.points(str(table), str(tmp_path / "keyed"), str(placebo))
    # oracle - GRPO: 0.2, 0.2, 0.0; GiGPO - GRPO over seeds 1-2: 0.1, 0.0; ProxMO never ran
    assert [r["name"] for r in rows] == ["oracle", "GiGPO"]
    assert rows[0]["differences"] == [0.19999999999999996, 0.19999999999999996, 0.0]
    assert rows[1]["differences"] == [0.09999999999999998, 0.0]
    assert shuffled["differences"] == [-0.09999999999999998]
    markdown = credit_vs_lead.table(rows, shuffled).splitlines()
    # oracle: mean 0.1333, SE = sqrt(((0.0667^2) * 2 + 0.1333^2) / 2 / 3) = 0.0667
    assert markdown[2] == "| oracle | 0.990 +- 0.010 | 3 | +0.133 +- 0.067 | 1.00 |"
    # GiGPO: mean 0.05, SE 0.05; its share 0.05 / 0.1333 = 0.375
    assert markdown[3] == "| GiGPO | 0.650 +- 0.040 | 2 | +0.050 +- 0.050 | 0.38 |"
    assert markdown[4].startswith("| placebo (the previous protocol") and "-0.100 +- nan" in (
        markdown[4])
