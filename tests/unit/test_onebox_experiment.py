"""Options of the calibrated-difficulty experiment: the seed lists of `exgrpo experiment --seeds` and
the level mix the calibration picks from measured solve rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from exgrpo_onebox.calibrate import mix_rate, pick_mix
from exgrpo_onebox.config import resolve
from exgrpo_onebox.experiment import ARMS, ExperimentOptions, parse_seeds, run_experiment, run_options


def test_seed_lists_counts_and_ranges() -> None:
    assert parse_seeds("3") == (0, 1, 2)
    assert parse_seeds("3,4,5") == (3, 4, 5)
    assert parse_seeds("10-14") == (10, 11, 12, 13, 14)
    assert parse_seeds(" 0, 5-7 ") == (0, 5, 6, 7)
    assert parse_seeds("7-7") == (7,)
    for bad in ("0", "a", "3-1", "1,1", "2-", "-3", "1;2"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def test_pick_mix_reaches_the_target_and_keeps_every_usable_level() -> None:
    rates = {1: 0.7, 2: 0.45, 3: 0.25, 4: 0.1, 5: 0.03, 6: 0.0}
    mix = pick_mix(rates, 0.2)
    assert set(mix) == {1, 2, 3, 4, 5}  # level 6 is never solved: no use for training
    assert sum(mix.values()) == pytest.approx(1.0, abs=0.03)
    assert mix_rate(rates, mix) == pytest.approx(0.2, abs=0.01)
    assert list(mix.values()) == sorted(mix.values())  # harder levels get more weight for a low target
    assert mix_rate(rates, pick_mix(rates, 0.5)) == pytest.approx(0.5, abs=0.01)
    # out of reach: the closest the usable levels get
    assert pick_mix({1: 0.3, 2: 0.2}, 0.05) == {2: 1.0}
    with pytest.raises(ValueError, match="no level"):
        pick_mix({1: 0.0, 2: 0.95}, 0.2)


def test_family_and_seeds_reach_every_run(tmp_path: Path) -> None:
    opts = ExperimentOptions(out=tmp_path, seeds=(10, 11), family="calibrated")
    arm = next(a for a in ARMS if a.name == "ratio-0.25")
    cfg = resolve(run_options(arm, 11, opts)).config
    assert cfg.job.family == "calibrated" and cfg.run.seed == 11 and cfg.experience.ratio == 0.25
    assert cfg.run.output_dir == (tmp_path / "ratio-0.25" / "seed-11").resolve()
    with pytest.raises(ValueError, match="unknown task family 'algebra'"):
        run_experiment(ExperimentOptions(out=tmp_path / "x", family="algebra"))
    with pytest.raises(ValueError, match="--seeds"):
        run_experiment(ExperimentOptions(out=tmp_path / "y", seeds=(1, 1)))
