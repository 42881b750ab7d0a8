"""benchmarks/learning.py: its statistics by hand, the pairing and the verdict, and the whole
protocol at a tiny size (two estimators x two seeds, a few tasks), resumed from its records, so
that the script cannot rot."""

import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from learning import (PROTOCOL_FLAGS, as_taken, check_record, curve_table,  # noqa: E402
                      detectable_lead, evaluation_variance, mean_and_se,
                      paired_differences, paired_table, start_or_resume, table, verdict)


def _record(start, end, minutes=10.0):
    return {"minutes": minutes, "train_success": [0.5, 0.6], "sampler": "global", "evaluations": {
        "0": {"eval_test/success": start, "eval_test/grounding": 0.5,
              "eval_test/episode_length": 20.0, "eval_test/success_heat": start},
        "10": {"eval_test/success": end, "eval_test/grounding": 0.7,
               "eval_test/episode_length": 18.5, "eval_test/success_heat": end}}}


def test_mean_and_standard_error_by_hand():
    # gains 0.02, 0.04, 0.09: mean 0.05; deviations -0.03, -0.01, 0.04; sample variance
    # (0.0009 + 0.0001 + 0.0016) / 2 = 0.0013; SE = sqrt(0.0013 / 3) = 0.020817
    mean, se = mean_and_se([0.02, 0.04, 0.09])
    assert mean == pytest.approx(0.05) and se == pytest.approx(math.sqrt(0.0013 / 3))
    mean, se = mean_and_se([0.3])
    assert mean == 0.3 and math.isnan(se)


def test_table_pairs_each_seed_start_with_its_end():
    markdown = table("proxmo.py", "test",
                     {"proxmo": {1: _record(0.30, 0.35, 10.0), 2: _record(0.40, 0.41, 12.0)}})
    # gains 0.05 and 0.01: mean 0.03, SE = |0.05 - 0.01| / 2 = 0.02
    assert ("| proxmo.py | proxmo | 2 | 0.350 | 0.380 | +0.030 +- 0.020 | 0.500 -> 0.700 | "
            "20.0 -> 18.5 | 11.0 |" in markdown)
    assert "| proxmo | heat | 0.350 | 0.380 | +0.030 +- 0.020 |" in markdown


def test_paired_differences_use_the_seeds_both_ran():
    results = {"proxmo": {1: _record(0.5, 0.60), 2: _record(0.4, 0.46), 3: _record(0.5, 0.5)},
               "grpo": {1: _record(0.5, 0.55), 2: _record(0.4, 0.42)}}
    pairs = paired_differences("test", results)
    # seed 1: 0.10 - 0.05; seed 2: 0.06 - 0.02; seed 3 has no baseline run
    assert list(pairs) == ["proxmo"] and pairs["proxmo"]["seeds"] == [1, 2]
    assert pairs["proxmo"]["differences"] == pytest.approx([0.05, 0.04])
    # mean 0.045, SE = 0.01 / 2 = 0.005; 2 seeds make no claim
    assert ("| proxmo | grpo | 2 | +0.050 / +0.040 | +0.045 +- 0.005 | not distinguishable "
            "(2 < 6 seeds) | 0.007 |" in paired_table(pairs))


def test_a_seeds_spread_splits_into_its_evaluations_and_training():
    """End evaluations that played each of 2 games twice: won (1, 0) and (1, 1) give the draws'
    variances 0.5 and 0, so an evaluation's variance is 0.25 / (2 games x 2 draws) = 0.0625; a
    pair of them 0.125. Differences 0.6 and 0.1: SD 0.354 = sqrt(0.125), all evaluation's."""
    def record(start, end):
        outcomes = [[0, 1, 5], [0, 0, 50], [1, 1, 3], [1, 1, 4]]
        return {**_record(start, end), "evaluations": {
            "0": {"eval_test/success": start},
            "10": {"eval_test/success": end, "eval_test/outcomes": outcomes}}}

    assert evaluation_variance(record(0, 0.75), "eval_test/success") == 0.0625
    assert evaluation_variance(_record(0, 0.75), "eval_test/success") is None
    results = {"proxmo": {1: record(0.0, 0.8), 2: record(0.0, 0.3)},
               "grpo": {1: record(0.0, 0.2), 2: record(0.0, 0.2)}}
    pairs = paired_differences("test", results)
    assert pairs["proxmo"]["evaluation_variance"] == pytest.approx(0.125)
    assert "| 0.354 (0.354, 0.000) |" in paired_table(pairs)


def test_the_lead_seen_at_80_percent_power_is_the_rule_applied():
    """At 400 seeds the rule (mean > 2 SE) is the normal test: (2 + 0.8416) sd / sqrt(400) =
    0.142 for sd 1. At 6 seeds and sd 0.053 (t with 5 degrees of freedom): 0.063, where the
    noncentral t gives 80.5 % (scipy.stats.nct, checked once)."""
    assert detectable_lead(1.0, 400) == pytest.approx(0.1421, abs=0.002)
    assert detectable_lead(0.053, 6) == pytest.approx(0.063, abs=0.001)
    assert detectable_lead(0.053, 12) < detectable_lead(0.053, 6)


def test_a_claim_needs_six_seeds_and_two_standard_errors():
    assert verdict([0.05] * 5) == "not distinguishable (5 < 6 seeds)"
    # 0.01, 0.02, ..., 0.06: mean 0.035, sample std 0.018708, SE 0.0076376: 4.6 SE
    assert verdict([0.01, 0.02, 0.03, 0.04, 0.05, 0.06]) == "beats"
    assert verdict([-0.01, -0.02, -0.03, -0.04, -0.05, -0.06]) == "loses to"
    # mean 0.01, SE = sqrt((4 * 0.05^2 + 2 * 0.03^2) / 5 / 6) = 0.0198: 0.5 SE
    assert verdict([0.06, -0.04, 0.06, -0.04, 0.04, -0.02]) == "not distinguishable"


def _protocol(tmp_path, *extra):
    return subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--estimators", "proxmo", "grpo",
         "--seeds", "1", "2", "--split", "valid", "--eval-num-tasks", "4",
         "--results", str(tmp_path / "records"), "--runs", str(tmp_path / "runs"), *extra, "--",
         "--iterations", "1", "--tasks-per-iteration", "2", "--group-size", "2",
         "--max-episode-steps", "5"],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=600)


def test_the_protocol_runs_at_a_tiny_size_and_resumes_from_its_records(tmp_path):
    result = _protocol(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = re.findall(r"^\| proxmo\.py \| (\w+) \| 2 \| ([\d.]+) \| ([\d.]+) \| "
                      r"([+-][\d.]+) \+- ([\d.]+) \|",
                      result.stdout, re.MULTILINE)
    assert [r[0] for r in rows] == ["proxmo", "grpo"]
    for _, start, end, gain, se in rows:
        assert float(gain) == pytest.approx(float(end) - float(start), abs=1.5e-3)
    assert re.search(r"^\| proxmo \| grpo \| 2 \| [+-][\d.]+ / [+-][\d.]+ \| .* \| not "
                     r"distinguishable \(2 < 6 seeds\) \| [\d.]+ \| ", result.stdout,
                     re.MULTILINE)
    records = tmp_path / "records"
    assert sorted(os.listdir(records)) == ["grpo-seed1.json", "grpo-seed2.json",
                                           "learning.png", "proxmo-seed1.json",
                                           "proxmo-seed2.json", "starts", "table.md"]
    # One start evaluation per seed, shared by both arms: their records hold the same one.
    assert len(os.listdir(records / "starts")) == 2
    record = json.loads((records / "proxmo-seed1.json").read_text())
    baseline = json.loads((records / "grpo-seed1.json").read_text())
    assert record["evaluations"]["0"] == baseline["evaluations"]["0"]
    assert len(record["evaluations"]["0"]["eval_valid/outcomes"]) == 4  # [task, won, steps]
    assert record["flags"] == PROTOCOL_FLAGS + ["--iterations", "1", "--tasks-per-iteration",
                                                "2", "--group-size", "2",
                                                "--max-episode-steps", "5"]
    assert len(record["train_success"]) == 1 and record["minutes"] > 0
    assert (record["script"], record["split"], record["eval_num_tasks"]) == ("proxmo.py",
                                                                            "valid", 4)
    # The header names each flag once, as the runs took it: the extra --iterations 1 wins.
    assert ("flags: --iterations 1 --tasks-per-iteration 2 --group-size 2 --max-episode-steps 5;"
            in (records / "table.md").read_text())
    logs = sorted(f for _, _, files in os.walk(tmp_path / "runs") for f in files
                  if f.endswith(".log"))
    assert logs == ["grpo-seed1.log", "grpo-seed2.log", "proxmo-seed1.log", "proxmo-seed2.log"]

    # Again: every run is read from its record, or from its finished run directory when the
    # record is gone; none runs again, and the tables are the same.
    os.remove(records / "grpo-seed2.json")
    again = _protocol(tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "grpo-seed2: finished in" in again.stdout and "--advantage" not in again.stdout
    assert again.stdout.split("| script |")[1] == result.stdout.split("| script |")[1]
    assert json.loads((records / "grpo-seed2.json").read_text())["flags"] == record["flags"]
    # A finished run whose settings the script no longer gives its command (a default changed
    # since) is refused, not recorded.
    os.remove(records / "grpo-seed2.json")
    (config_file,) = (tmp_path / "runs").rglob("grpo-seed2/*/config.json")
    config = json.loads(config_file.read_text())
    config["args"]["psc_beta"] = 0.5
    config_file.write_text(json.dumps(config))
    stale = _protocol(tmp_path)
    assert stale.returncode != 0 and "ran with --psc-beta 0.5 (now 0.1)" in stale.stderr
    config["args"]["psc_beta"] = 0.1
    config_file.write_text(json.dumps(config))
    # A record of another evaluation is refused, not reused.
    (records / "proxmo-seed1.json").write_text(json.dumps({**record, "split": "test"}))
    refused = _protocol(tmp_path)
    assert refused.returncode != 0 and "was run with split 'test', not 'valid'" in refused.stderr
    os.remove(records / "proxmo-seed1.json")
    only = _protocol(tmp_path, "--finished-only", "--seeds", "1", "2", "3")
    assert only.returncode == 0, only.stdout[-2000:] + only.stderr[-2000:]
    assert "| proxmo | grpo | 2 |" in only.stdout and "--advantage" not in only.stdout


def test_spa_runs_its_own_estimators_by_default(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/learning.py", "--script", "spa.py", "--seeds", "1",
         "--split", "valid", "--eval-num-tasks", "3", "--results", str(tmp_path / "records"),
         "--runs", str(tmp_path / "runs"), "--",
         "--iterations", "1", "--tasks-per-iteration", "2", "--group-size", "2",
         "--max-episode-steps", "4", "--explore-num-tasks", "3", "--explore-rollouts", "2"],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = re.findall(r"^\| spa\.py \| (\w+) \| 1 \|", result.stdout, re.MULTILINE)
    assert rows == ["spa", "ppo"]
    assert "| spa | ppo | 1 |" in result.stdout


def _protocol_from_records(tmp_path, monkeypatch, capsys, script, records):
    """learning.py --finished-only on test seed 1 of `script`, from records written under a
    temporary RESULTS: (script, estimator, extra flags) each, in the script's place. Returns
    what it printed."""
    import learning

    monkeypatch.setattr(learning, "RESULTS", str(tmp_path / "results"))
    for place_script, name, flags in records:
        record = {**_record(0.5, 0.6), "script": place_script, "estimator": name, "seed": 1,
                  "split": "test", "eval_num_tasks": 0, "flags": PROTOCOL_FLAGS + flags,
                  "command": f"python {place_script} --advantage {name} --seed 1"}
        place = tmp_path / "results" / "test" / place_script
        place.mkdir(parents=True)
        (place / f"{name}-seed1.json").write_text(json.dumps(record))
    learning.main(["--script", script, "--seeds", "1", "--finished-only", "--runs",
                   str(tmp_path / "runs")])
    return capsys.readouterr().out


def test_a_keyed_protocol_reads_keyed_records_only(tmp_path, monkeypatch, capsys):
    """--sampler keyed (ALFWorld's default) keeps its records under keyed/ and refuses one drawn
    from torch's global stream (every record made before keyed draws has no "sampler")."""
    import learning

    monkeypatch.setattr(learning, "RESULTS", str(tmp_path / "results"))
    place = tmp_path / "results" / "keyed" / "test" / "proxmo.py"
    place.mkdir(parents=True)
    record = {**_record(0.5, 0.6), "sampler": "keyed", "script": "proxmo.py",
              "estimator": "grpo", "seed": 1, "split": "test", "eval_num_tasks": 0,
              "flags": PROTOCOL_FLAGS, "command": "python proxmo.py --advantage grpo --seed 1"}
    (place / "grpo-seed1.json").write_text(json.dumps(record))
    argv = ["--estimators", "grpo", "--seeds", "1", "--finished-only", "--sampler", "keyed",
            "--runs", str(tmp_path / "runs")]
    learning.main(argv)
    assert "grpo-seed1: recorded" in capsys.readouterr().out
    del record["sampler"]
    (place / "grpo-seed1.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit):
        learning.main(argv)
    assert "drew its samples by 'global', not 'keyed'" in capsys.readouterr().err


def test_spa_reads_hisr_ppo_records(tmp_path, monkeypatch, capsys):
    """spa.py's protocol takes its PPO baseline from hisr.py's records (the same update), in
    hisr.py's place, with hisr.py's flags; its own SPA records in spa.py's place, with
    --rl-data online. No run starts (--finished-only)."""
    out = _protocol_from_records(tmp_path, monkeypatch, capsys, "spa.py",
                                 [("spa.py", "spa", ["--rl-data", "online"]),
                                  ("hisr.py", "ppo", [])])
    assert "ppo: hisr.py's runs (the same update)" in out
    assert re.findall(r"^\| spa\.py \| (\w+) \| 1 \|", out, re.MULTILINE) == ["spa", "ppo"]
    assert (tmp_path / "results" / "test" / "spa.py" / "table.md").is_file()
    assert not (tmp_path / "results" / "test" / "hisr.py" / "table.md").exists()


def test_sspo_reads_proxmo_grpo_records(tmp_path, monkeypatch, capsys):
    """sspo.py's GRPO is proxmo.py's (the same run): its protocol reads proxmo.py's records."""
    out = _protocol_from_records(tmp_path, monkeypatch, capsys, "sspo.py",
                                 [("sspo.py", "sspo", []), ("proxmo.py", "grpo", [])])
    assert "grpo: proxmo.py's runs (the same update)" in out
    assert re.findall(r"^\| sspo\.py \| (\w+) \| 1 \|", out, re.MULTILINE) == ["sspo", "grpo"]


def test_a_record_filed_under_another_run_is_refused_by_name(tmp_path, monkeypatch, capsys):
    """rloo's record copied over iStar's: its content names another estimator (and its command
    another run), so the table is not built from it; exit status 2, the file named."""
    import learning

    monkeypatch.setattr(learning, "RESULTS", str(tmp_path / "results"))
    place = tmp_path / "results" / "test" / "istar.py"
    place.mkdir(parents=True)
    record = {**_record(0.5, 0.6), "script": "istar.py", "estimator": "rloo", "seed": 1,
              "split": "test", "eval_num_tasks": 0, "flags": PROTOCOL_FLAGS,
              "command": "python istar.py --advantage rloo --seed 1"}
    (place / "istar-seed1.json").write_text(json.dumps(record))
    argv = ["--script", "istar.py", "--estimators", "istar", "--seeds", "1", "--finished-only",
            "--runs", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as stop:
        learning.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "istar-seed1.json was run with estimator 'rloo', not 'istar'" in err
    (place / "istar-seed1.json").write_text(json.dumps({**record, "estimator": "istar"}))
    with pytest.raises(SystemExit) as stop:
        learning.main(argv)
    assert stop.value.code == 2 and "is not istar seed 1's" in capsys.readouterr().err
    (place / "istar-seed1.json").write_text('{"script": "istar.py", ')
    with pytest.raises(SystemExit) as stop:
        learning.main(argv)
    assert stop.value.code == 2 and "istar-seed1.json is damaged" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--estimators", "proxmo", "bogus"], "--estimators bogus: proxmo.py's --advantage takes"),
    (["--seeds", "1", "-1"], "--seeds -1: a seed is in [0, 2**32)"),
    (["--", "--learning-rate", "nan"], "--learning-rate must be finite"),
    (["--", "--group-size", "0"], "--group-size must be in [1, 1024]"),
])
def test_every_estimator_seed_and_flag_is_checked_before_the_first_run(argv, message, tmp_path,
                                                                       capsys):
    import learning

    with pytest.raises(SystemExit) as stop:
        learning.main(["--results", str(tmp_path / "records"), "--runs", str(tmp_path / "runs"),
                       *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "records").exists()


@pytest.mark.parametrize("flag", ["--results", "--runs"])
def test_a_results_or_runs_folder_under_a_file_is_refused_before_the_first_run(flag, tmp_path,
                                                                               capsys):
    import learning

    (tmp_path / "file").write_text("")
    folders = {"--results": str(tmp_path / "records"), "--runs": str(tmp_path / "runs"),
               flag: str(tmp_path / "file" / "below")}
    with pytest.raises(SystemExit) as stop:
        learning.main([item for pair in folders.items() for item in pair])
    assert stop.value.code == 2
    assert f"{flag} {tmp_path / 'file' / 'below'}: {tmp_path / 'file'} is a file" in (
        capsys.readouterr().err)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "records").exists()


@pytest.mark.parametrize("summary, config, says", [
    ({"evaluations": {}}, None, "config.json is missing"),
    ({"evaluations": {}}, {"command": "python proxmo.py"}, "config.json is damaged (no args)"),
    ({"minutes": 1.0}, {"args": {}, "command": "x"}, "summary.json is damaged (no evaluations)"),
])
def test_a_finished_run_with_a_damaged_summary_or_config_is_refused_by_name(summary, config, says,
                                                                            tmp_path, capsys):
    """A run directory without a record yet: its summary.json and config.json are read to make
    one, and one that lacks what a record needs is one line naming it, not a traceback."""
    import learning

    (tmp_path / "summary.json").write_text(json.dumps(summary))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as stop:
        learning.make_record(str(tmp_path / "summary.json"), "proxmo.py", "proxmo", 1, "test", 4,
                             [])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def _whole_record(**end):
    stats = {"eval_test/success": 0.5, "eval_test/grounding": 0.6, "eval_test/episode_length": 20}
    return {"minutes": 10.0, "evaluations": {"0": dict(stats), "20": {**stats, **end}}}


@pytest.mark.parametrize("record, says", [
    (_whole_record(**{"eval_test/success": float("nan")}), "eval_test/success is nan"),
    (_whole_record(**{"eval_test/success": float("inf")}), "eval_test/success is inf"),
    (_whole_record(**{"eval_test/success": 17.0}), "eval_test/success is 17.0"),
    (_whole_record(**{"eval_test/success": "0.6"}), "eval_test/success is '0.6'"),
    ({"minutes": 1.0, "evaluations": {"0": _whole_record()["evaluations"]["0"]}},
     "not the start and later iterations"),
    ({"minutes": 1.0}, "no start evaluation"),
    ({"minutes": 1.0, "evaluations": {"20": _whole_record()["evaluations"]["20"]}},
     "no start evaluation"),
    ({**_whole_record(), "evaluations": {k: {"eval_valid/success": 0.5}
                                   for k in ("0", "20")}}, "eval_test/success is None"),
    (_whole_record(**{"eval_test/success_heat": 17.0}), "eval_test/success_heat is 17.0"),
    (_whole_record(**{"eval_test/success_pick": "x"}), "eval_test/success_pick is 'x'"),
    ({**_whole_record(), "train_success": "0.5"}, "its train_success is '0.5'"),
    ({**_whole_record(), "evaluations": {"0": "x", "20": {}}}, "evaluation is 'x', not a table"),
])
def test_a_damaged_record_is_refused_by_name(record, says, capsys):
    """NaN, infinity, a success above 1 or a string, a record with only its start evaluation,
    none, or another split's keys: exit status 2 and one line, before any table is written."""
    check_record(_whole_record(), "test", "ok.json")  # a whole record passes
    with pytest.raises(SystemExit) as stopped:
        check_record(record, "test", "grpo-seed1.json")
    assert stopped.value.code == 2
    assert "grpo-seed1.json is damaged" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check_record(record, "test", "grpo-seed1.json")
    assert says in capsys.readouterr().err


def test_an_alfworld_protocol_without_games_says_how_to_get_them(tmp_path, monkeypatch, capsys):
    """ALFWORLD_DATA where there are no games: a usage error naming the ways to get them, before
    any run, not a traceback."""
    import learning

    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(SystemExit) as stopped:
        learning.main(["--env", "alfworld", "--runs", str(tmp_path / "runs")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "no ALFWorld games found" in err and "alfworld-download" in err
    assert not (tmp_path / "runs").exists()


def test_alfworld_tables_from_records_need_no_games(tmp_path, monkeypatch, capsys):
    """--finished-only reads records alone: the committed ALFWorld records of seed 1 (GRPO,
    ProxMO) give their table and paired difference with ALFWORLD_DATA where there are no
    games."""
    import learning

    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    committed = os.path.join(learning.RESULTS, "alfworld", "keyed", "valid_unseen", "proxmo.py")
    for name in ("grpo-seed1.json", "proxmo-seed1.json"):
        shutil.copy(os.path.join(committed, name), tmp_path / name)
    learning.main(["--env", "alfworld", "--estimators", "grpo", "proxmo", "--seeds", "1",
                   "--finished-only", "--results", str(tmp_path), "--runs", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert "| proxmo | grpo | 1 | -0.044 |" in out
    assert (tmp_path / "table.md").is_file() and not (tmp_path / "r").exists()


def test_the_keyed_alfworld_protocol_plays_each_game_three_times():
    """ALFWorld's keyed protocol evaluates with --eval-draws 3 (the size docs/environments.md
    chose); its previous protocol (--sampler global) and the household's draw once."""
    import learning

    keyed = learning.protocol_flags("alfworld", "keyed", 10)
    assert keyed == ["--iterations", "10", "--tasks-per-iteration", "8", "--env", "alfworld",
                     "--eval-draws", "3"]
    assert learning.protocol_flags("alfworld", "global", 10) == keyed[:-2]
    assert learning.protocol_flags("household", "global", 20) == PROTOCOL_FLAGS


@pytest.mark.parametrize("flag", ["--run-dir", "--seed", "--advantage", "--sampler",
                                  "--eval-draws"])
def test_a_flag_the_protocol_sets_is_refused_after_the_double_dash(flag, capsys):
    """learning.py -- --run-dir ELSEWHERE would finish the run where no record is made, and play
    it again at every sitting: refused before any run starts."""
    import learning

    with pytest.raises(SystemExit) as stopped:
        learning.main(["--seeds", "1", "--", flag, "x"])
    assert stopped.value.code == 2
    assert f"{flag} after --: the protocol sets them" in capsys.readouterr().err


def test_the_curve_pairs_every_evaluation_by_hand():
    """Two seeds, evaluations at 0, 20 and 40. oracle gains (0.1, 0.2) at 20 and (0.2, 0.3) at
    40, grpo (0.1, 0.1) and (0.1, 0.1): paired (0, 0.1) -> +0.050 +- 0.050, (0.1, 0.2) ->
    +0.150 +- 0.050."""
    def record(start, *later):
        steps = ("0", "20", "40")
        return {"evaluations": {k: {"eval_test/success": v} for k, v in zip(steps,
                                                                            (start, *later))}}

    results = {"oracle": {1: record(0.5, 0.6, 0.7), 2: record(0.4, 0.6, 0.7)},
               "grpo": {1: record(0.5, 0.6, 0.6), 2: record(0.4, 0.5, 0.5)}}
    rows = curve_table("test", results).splitlines()
    assert rows[2] == ("| 20 | oracle | 2 | 0.600 | +0.150 +- 0.050 | +0.050 +- 0.050 (2 seeds) "
                       "| not distinguishable (2 < 6 seeds) |")
    assert rows[3] == "| 20 | grpo | 2 | 0.550 | +0.100 +- 0.000 |  |  |"
    assert rows[4].startswith("| 40 | oracle | 2 | 0.700 | +0.250 +- 0.050 | +0.150 +- 0.050")


def test_an_unfinished_run_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """A run directory with a checkpoint and no summary (a sitting cut short): the run goes on
    with --resume, its log appended; one without a checkpoint is started anew."""
    import learning

    run_dir = tmp_path / "grpo-seed1"
    (run_dir / "proxmo__a" / "checkpoint").mkdir(parents=True)
    (run_dir / "proxmo__a" / "checkpoint" / "trainer_state.pt").write_text("")
    ran = []

    class Finished:  # the run, as subprocess.Popen would start it
        def __init__(self, command, **kwargs):
            ran.append(command)
            (run_dir / "proxmo__a" / "summary.json").write_text("{}")

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(learning.subprocess, "Popen", Finished)
    command = ["python", "proxmo.py", "--advantage", "grpo", "--iterations", "60"]
    summary = start_or_resume(command, str(run_dir), str(tmp_path), "grpo-seed1")
    assert ran == [["python", "proxmo.py", "--resume", str(run_dir / "proxmo__a"),
                    "--iterations", "60"]]
    assert summary == str(run_dir / "proxmo__a" / "summary.json")


def test_ctrl_c_stops_the_protocol_with_one_line_and_its_run_resumes(tmp_path):
    """Ctrl-C to the protocol's process group while a run goes on: learning.py waits for the run
    to stop (its log says how to resume), says the same command goes on, exit status 130; the
    same command then resumes the run from its checkpoint and records it."""
    command = [sys.executable, "benchmarks/learning.py", "--estimators", "grpo", "--seeds", "1",
               "--split", "valid", "--eval-num-tasks", "2", "--results", str(tmp_path / "records"),
               "--runs", str(tmp_path / "runs"), "--", "--iterations", "3",
               "--tasks-per-iteration", "2", "--group-size", "2", "--max-episode-steps", "5",
               "--save-every", "1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    protocol = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for _ in range(1200):
        if glob.glob(str(tmp_path / "runs" / "**" / "checkpoint"), recursive=True) or (
                protocol.poll() is not None):
            break
        time.sleep(0.2)
    os.killpg(protocol.pid, signal.SIGINT)
    _, stderr = protocol.communicate(timeout=600)
    assert protocol.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert "interrupted; the same command goes on" in stderr
    (log,) = glob.glob(str(tmp_path / "runs" / "**" / "grpo-seed1.log"), recursive=True)
    assert "Resume with: python" in open(log).read()
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and "--resume" in again.stdout, again.stderr[-2000:]
    assert (tmp_path / "records" / "grpo-seed1.json").is_file()


def test_a_run_another_process_is_running_is_skipped(tmp_path, monkeypatch, capsys):
    """Two processes on one folder share the runs: a run whose directory another process holds
    (its lock, on the directory: no lock file) is skipped, not run twice; once the lock is let
    go, the run goes ahead."""
    import learning

    from common.run import try_lock

    run_dir = tmp_path / "runs" / "grpo-seed1"
    run_dir.mkdir(parents=True)
    ran = []

    def fake(command, *where):
        ran.append(command)
        raise SystemExit("started")

    monkeypatch.setattr(learning, "start_or_resume", fake)
    lock = try_lock(str(run_dir))
    assert lock is not None and try_lock(str(run_dir)) is None  # one holder at a time
    try:
        assert learning.run_one("proxmo.py", "grpo", 1, "test", 4, str(tmp_path / "runs"),
                                str(tmp_path / "records"), []) is None
    finally:
        os.close(lock)
    assert "grpo-seed1: running in another process; skipped" in capsys.readouterr().out
    assert ran == [] and os.listdir(run_dir) == []
    with pytest.raises(SystemExit, match="started"):
        learning.run_one("proxmo.py", "grpo", 1, "test", 4, str(tmp_path / "runs"),
                         str(tmp_path / "records"), [], sampler="keyed")
    assert len(ran) == 1 and "--sampler keyed" in " ".join(ran[0])


def test_the_table_header_shows_each_flag_once_with_its_last_values():
    flags = ["--iterations", "20", "--tasks-per-iteration", "8", "--no-use-std",
             "--tasks-per-iteration", "2", "--eval-splits", "test", "valid", "--lr", "-1e-3"]
    assert as_taken(flags) == ["--iterations", "20", "--tasks-per-iteration", "2", "--no-use-std",
                               "--eval-splits", "test", "valid", "--lr", "-1e-3"]
