"""Bucket weights and probabilities (spec 4.1) and validation of ExperienceRules."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_client.schemas import PoolConfig
from exgrpo_pool.domain import ExperienceRules, bucket_probs, bucket_weight, check_weights

TOL = 1e-6
ALL_WEIGHTINGS = ["normal", "linear", "sqrt", "linear_clip", "uniform"]

TV1_WEIGHTS = {
    1: 0.004432,
    2: 0.053991,
    3: 0.241971,
    4: 0.398942,
    5: 0.241971,
    6: 0.053991,
    7: 0.004432,
}
TV1_PROBS = {
    1: 0.004433,
    2: 0.054006,
    3: 0.242036,
    4: 0.399050,
    5: 0.242036,
    6: 0.054006,
    7: 0.004433,
}
TV1_EXPECTED_64 = {1: 0.284, 2: 3.456, 3: 15.490, 4: 25.539, 5: 15.490, 6: 3.456, 7: 0.284}


# --------------------------------------------------------------------------- TV1 / TV2 / TV2'


def test_tv1_default_rules_give_count_space_gaussian_weights() -> None:
    rules = ExperienceRules()
    for k, expected in TV1_WEIGHTS.items():
        assert bucket_weight(k, rules) == pytest.approx(expected, abs=TOL)


def test_tv1_probabilities_over_all_seven_buckets() -> None:
    probs = bucket_probs(range(1, 8), ExperienceRules())
    assert list(probs) == list(range(1, 8))
    for k, expected in TV1_PROBS.items():
        assert probs[k] == pytest.approx(expected, abs=TOL)
    assert math.fsum(probs.values()) == pytest.approx(1.0, abs=1e-12)


def test_tv1_expected_questions_per_bucket_for_64_draws() -> None:
    probs = bucket_probs(range(1, 8), ExperienceRules())
    for k, expected in TV1_EXPECTED_64.items():
        assert 64 * probs[k] == pytest.approx(expected, abs=5e-4)


def test_tv1_mass_on_buckets_three_to_five_is_about_88_percent() -> None:
    probs = bucket_probs(range(1, 8), ExperienceRules())
    assert probs[3] + probs[4] + probs[5] == pytest.approx(0.883122, abs=TOL)


def test_tv2_probabilities_renormalise_over_nonempty_buckets_only() -> None:
    probs = bucket_probs([7, 2, 4], ExperienceRules())
    assert list(probs) == [2, 4, 7]
    assert probs[2] == pytest.approx(0.118048, abs=TOL)
    assert probs[4] == pytest.approx(0.872262, abs=TOL)
    assert probs[7] == pytest.approx(0.009690, abs=TOL)


def test_tv2_accuracy_unit_with_sigma_one_eighth_matches_count_unit() -> None:
    count = bucket_probs([2, 4, 7], ExperienceRules())
    accuracy = bucket_probs([2, 4, 7], ExperienceRules(unit="accuracy", sigma=0.125))
    for k in (2, 4, 7):
        assert accuracy[k] == pytest.approx(count[k], abs=1e-12)


def test_tv2_prime_literal_accuracy_gaussian_with_sigma_one_is_nearly_flat() -> None:
    probs = bucket_probs([2, 4, 7], ExperienceRules(unit="accuracy", sigma=1.0))
    assert probs[2] == pytest.approx(0.334064, abs=TOL)
    assert probs[4] == pytest.approx(0.344669, abs=TOL)
    assert probs[7] == pytest.approx(0.321267, abs=TOL)


def test_accuracy_unit_weight_is_density_over_k_over_k() -> None:
    rules = ExperienceRules(unit="accuracy", sigma=0.25)
    x, mu, sigma = 3 / 8, 0.5, 0.25
    expected = math.exp(-((x - mu) ** 2) / (2 * sigma**2)) / math.sqrt(2 * math.pi * sigma**2)
    assert bucket_weight(3, rules) == pytest.approx(expected, rel=1e-12)


def test_explicit_mu_moves_the_peak_of_the_gaussian() -> None:
    probs = bucket_probs(range(1, 8), ExperienceRules(mu=6.0))
    assert max(probs, key=probs.__getitem__) == 6
    assert probs[5] == pytest.approx(probs[7], abs=1e-12)


# --------------------------------------------------------------------------- other weightings


@pytest.mark.parametrize(
    ("weighting", "k", "expected"),
    [
        ("linear", 3, 3 / 8),
        ("linear", 7, 7 / 8),
        ("sqrt", 2, 0.5),
        ("sqrt", 7, math.sqrt(7 / 8)),
        ("linear_clip", 3, 3 / 8),
        ("linear_clip", 4, 0.5),
        ("linear_clip", 5, 0.5),
        ("linear_clip", 7, 0.5),
        ("uniform", 1, 1.0),
        ("uniform", 7, 1.0),
    ],
)
def test_non_gaussian_weightings_follow_their_formulas(weighting: str, k: int, expected: float) -> None:
    assert bucket_weight(k, ExperienceRules(weighting=weighting)) == pytest.approx(expected, abs=1e-12)


def test_linear_clip_with_odd_group_size_clips_above_half() -> None:
    rules = ExperienceRules(k=5, weighting="linear_clip")
    assert bucket_weight(2, rules) == pytest.approx(0.4)
    assert bucket_weight(3, rules) == 0.5


def test_linear_probabilities_are_proportional_to_k() -> None:
    probs = bucket_probs([1, 3], ExperienceRules(weighting="linear"))
    assert probs == {1: pytest.approx(0.25), 3: pytest.approx(0.75)}


def test_uniform_weighting_gives_equal_bucket_probabilities() -> None:
    probs = bucket_probs([1, 5, 6, 7], ExperienceRules(weighting="uniform"))
    assert all(p == pytest.approx(0.25) for p in probs.values())


@given(
    keys=st.sets(st.integers(min_value=1, max_value=7), min_size=1),
    weighting=st.sampled_from(ALL_WEIGHTINGS),
)
def test_bucket_probs_are_a_distribution_over_exactly_the_given_buckets(
    keys: set[int], weighting: str
) -> None:
    rules = ExperienceRules(weighting=weighting)
    probs = bucket_probs(keys, rules)
    assert set(probs) == keys
    assert all(p > 0 for p in probs.values())
    assert math.fsum(probs.values()) == pytest.approx(1.0, abs=1e-12)
    total = math.fsum(bucket_weight(k, rules) for k in keys)
    for k in keys:
        assert probs[k] == pytest.approx(bucket_weight(k, rules) / total, rel=1e-9)


def test_narrow_gaussian_does_not_underflow_to_an_error() -> None:
    rules = ExperienceRules(sigma=0.01)
    assert bucket_weight(3, rules) == 0.0
    assert bucket_weight(7, rules) == 0.0
    probs = bucket_probs([3, 7], rules)
    assert probs == {3: 1.0, 7: 0.0}


def test_duplicate_bucket_keys_are_counted_once() -> None:
    assert bucket_probs([4, 4, 2], ExperienceRules()) == bucket_probs([2, 4], ExperienceRules())


def test_bucket_probs_rejects_no_buckets() -> None:
    with pytest.raises(ValueError, match="at least one"):
        bucket_probs([], ExperienceRules())


def test_bucket_probs_rejects_all_zero_weights() -> None:
    with pytest.raises(ValueError, match="zero"):
        bucket_probs([0], ExperienceRules(weighting="linear"))


@pytest.mark.parametrize("k", [-1, 9])
def test_bucket_keys_outside_zero_to_k_are_rejected(k: int) -> None:
    with pytest.raises(ValueError, match="bucket key"):
        bucket_weight(k, ExperienceRules())


def test_non_integer_bucket_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="integer"):
        bucket_probs([2.5], ExperienceRules())  # type: ignore[list-item]  # a float key on purpose


# --------------------------------------------------------------------------- ExperienceRules


def test_default_rules_match_the_official_run() -> None:
    rules = ExperienceRules()
    assert (rules.k, rules.lbound, rules.rbound_eff) == (8, 0, 7)
    assert rules.weighting == "normal" and rules.unit == "count"
    assert rules.mu_eff == 4.0 and rules.sigma == 1.0
    assert (rules.experience_ratio, rules.batch_size, rules.start_threshold) == (0.5, 128, 0.35)
    assert rules.active_refresh_margin == 20


def test_default_mu_in_accuracy_unit_is_one_half() -> None:
    assert ExperienceRules(unit="accuracy").mu_eff == 0.5


def test_rbound_none_means_k_minus_one() -> None:
    assert ExperienceRules(k=4).rbound_eff == 3
    assert ExperienceRules(k=4, rbound=2).rbound_eff == 2


def test_rules_are_immutable() -> None:
    rules = ExperienceRules()
    with pytest.raises(AttributeError):
        rules.k = 4  # type: ignore[misc]  # frozen: the assignment must fail


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"k": 1}, "k"),
        ({"k": True}, "k"),
        ({"lbound": -1}, "lbound"),
        ({"lbound": 7}, "rbound"),
        ({"lbound": 3, "rbound": 3}, "rbound"),
        ({"rbound": 8}, "rbound"),
        ({"rbound": 0}, "rbound"),
        ({"weighting": "cubic"}, "weighting"),
        ({"unit": "percent"}, "unit"),
        ({"mu": math.nan}, "mu"),
        ({"sigma": 0.0}, "sigma"),
        ({"sigma": -1.0}, "sigma"),
        ({"sigma": math.inf}, "sigma"),
        ({"experience_ratio": -0.1}, "experience_ratio"),
        ({"experience_ratio": 1.5}, "experience_ratio"),
        ({"batch_size": 0}, "batch_size"),
        ({"start_threshold": 1.01}, "start_threshold"),
        ({"active_refresh_margin": -1}, "active_refresh_margin"),
    ],
)
def test_invalid_rules_raise_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ExperienceRules(**kwargs)  # type: ignore[arg-type]  # bad values on purpose


def test_boundary_rules_are_accepted() -> None:
    rules = ExperienceRules(k=2, lbound=0, rbound=1, experience_ratio=1.0, start_threshold=0.0, sigma=1e-3)
    assert rules.rbound_eff == 1


# ------------------------------------------------------------------------- config validation
@pytest.mark.parametrize(
    "rules",
    [
        ExperienceRules(sigma=1e-200),  # 2 sigma^2 underflows to 0
        ExperienceRules(mu=1e308),  # (k - mu)^2 overflows
        ExperienceRules(sigma=1e-160),  # log-weights of every bucket but K/2 are -inf
        ExperienceRules(unit="accuracy", sigma=1e-170),
        ExperienceRules(mu=-1e200, sigma=1e-3),
    ],
    ids=["tiny-sigma", "huge-mu", "underflow", "accuracy-underflow", "far-mu"],
)
def test_check_weights_refuses_rules_the_sampler_cannot_weight(rules: ExperienceRules) -> None:
    with pytest.raises(ValueError, match="mu and sigma"):
        check_weights(rules)


def test_check_weights_shows_the_defect_it_guards() -> None:
    """Without the check these rules fail inside the sampler, on a later plan."""
    with pytest.raises(ZeroDivisionError):
        bucket_probs([1, 2], ExperienceRules(sigma=1e-200))
    with pytest.raises(OverflowError):
        bucket_probs([1, 2], ExperienceRules(mu=1e308))
    with pytest.raises(ValueError, match="all bucket weights are zero"):
        bucket_probs([1, 3], ExperienceRules(k=4, sigma=1e-160))


_CONFIG = PoolConfig.model_json_schema()["properties"]
_SIGMA = (_CONFIG["sigma"]["minimum"], _CONFIG["sigma"]["maximum"])
_MU = next(b for b in _CONFIG["mu"]["anyOf"] if b.get("type") == "number")


@given(
    k=st.integers(2, 1024),
    mu=st.none() | st.floats(_MU["minimum"], _MU["maximum"]),
    sigma=st.floats(*_SIGMA),
    unit=st.sampled_from(["count", "accuracy"]),
    weighting=st.sampled_from(ALL_WEIGHTINGS),
    data=st.data(),
)
def test_every_config_within_the_wire_bounds_passes_and_normalises(
    k: int, mu: float | None, sigma: float, unit: str, weighting: str, data: st.DataObject
) -> None:
    """The wire bounds of mu and sigma (schemas.PoolConfig) are enough: any such config passes
    the check, and any set of buckets then gets finite probabilities summing to 1."""
    rules = ExperienceRules(k=k, mu=mu, sigma=sigma, unit=unit, weighting=weighting)  # type: ignore[arg-type]  # drawn from the literals
    check_weights(rules)
    keys = data.draw(st.sets(st.integers(1, k - 1), min_size=1, max_size=8))
    probs = bucket_probs(keys, rules)
    assert math.fsum(probs.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(math.isfinite(p) and p >= 0 for p in probs.values())
