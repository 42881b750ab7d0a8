"""istar.py's learning rates and std rule in the release's relation (spec revision 2026-11-24,
item 1): iStar's policy at half its baselines' rate, the PRM at twice iStar's policy rate, chosen
by --advantage, never by --step-weight; a flag on the command line always wins."""

import pytest

from istar import PRESETS, parse_args, preset_args

REAL = "Qwen2.5-1.5B-Instruct"


@pytest.mark.parametrize("argv, policy, prm, use_std", [
    ([], 2.5e-4, 5e-4, False),                                  # iStar on RLOO
    (["--estimator", "grpo"], 2.5e-4, 5e-4, False),             # iStar on GRPO, mean_norm
    (["--step-weight", "0"], 2.5e-4, 5e-4, False),              # the control: iStar's rates
    (["--step-weight", "0", "--estimator", "grpo"], 2.5e-4, 5e-4, False),
    (["--advantage", "rloo"], 5e-4, 5e-4, True),                # the baselines: twice iStar's
    (["--advantage=grpo"], 5e-4, 5e-4, True),
    (["--model", "tiny-scratch", "--advantage", "rloo"], 5e-4, 5e-4, True),
    (["--model", REAL], 5e-6, 1e-5, False),                      # real: the same relation
    (["--model", REAL, "--step-weight", "0"], 5e-6, 1e-5, False),
    (["--model", REAL, "--advantage", "grpo"], 1e-5, 1e-5, True),
])
def test_rates_follow_the_advantage(argv, policy, prm, use_std):
    args = parse_args(argv)
    assert (args.learning_rate, args.prm_learning_rate, args.use_std) == (policy, prm, use_std)


@pytest.mark.parametrize("argv, policy, prm, use_std", [
    (["--learning-rate", "5e-4"], 5e-4, 5e-4, False),
    (["--advantage", "rloo", "--learning-rate", "1e-3"], 1e-3, 5e-4, True),
    (["--learning-rate", "1e-3", "--advantage", "grpo"], 1e-3, 5e-4, True),  # order: no matter
    (["--prm-learning-rate", "2e-3", "--step-weight", "0"], 2.5e-4, 2e-3, False),
    (["--model", REAL, "--advantage", "rloo", "--learning-rate", "5e-6"], 5e-6, 1e-5, True),
    (["--advantage", "grpo", "--no-use-std"], 5e-4, 5e-4, False),
    (["--estimator", "grpo", "--use-std"], 2.5e-4, 5e-4, True),
])
def test_an_explicit_flag_wins(argv, policy, prm, use_std):
    args = parse_args(argv)
    assert (args.learning_rate, args.prm_learning_rate, args.use_std) == (policy, prm, use_std)


def test_the_presets_keep_the_release_relation():
    """run_webshop.sh: iStar 5e-7, PRM 1e-6, RLOO / GRPO 1e-6: baseline = PRM = 2 x iStar."""
    for model, size in (("tiny", "tiny"), ("tiny-scratch", "tiny"), (REAL, "real")):
        istar, rloo = preset_args(model), preset_args(model, advantage="rloo")
        assert rloo.learning_rate == 2 * istar.learning_rate == istar.prm_learning_rate
        assert rloo.learning_rate == PRESETS[f"{size} baseline"]["learning_rate"]
        assert rloo.advantage == "rloo" and istar.advantage == "istar"
    assert PRESETS["real"]["prm_learning_rate"] == 2 * PRESETS["real"]["learning_rate"]
    # nothing else differs between iStar's defaults and a baseline's
    istar, grpo = preset_args(), preset_args(advantage="grpo")
    differ = {k for k in vars(istar) if getattr(istar, k) != getattr(grpo, k)}
    assert differ == {"advantage", "learning_rate", "use_std"}
