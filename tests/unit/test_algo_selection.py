"""Trajectory selection for replayed questions (spec 4.2, quirk Q1, TV10)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from exgrpo_trainer.algo import (
    choose_trajectories,
    choose_trajectory,
    mean_token_entropy,
    official_compat_score,
    perplexity,
    score_candidates,
)

# TV10: prompt of 200 tokens with entropy 1.0 at each of its 199 prediction positions.
PROMPT = np.full(199, 1.0)
TRAJECTORIES = {
    "A": np.full(2000, 0.30),
    "B": np.full(800, 0.50),
    "C": np.full(1500, 0.35),
}


def _padded(trajectories: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(t) for t in trajectories)
    entropy = torch.full((len(trajectories), width), 99.0, dtype=torch.float64)  # junk in padding
    mask = torch.zeros((len(trajectories), width), dtype=torch.bool)
    for i, t in enumerate(trajectories):
        entropy[i, : len(t)] = torch.from_numpy(t)
        mask[i, : len(t)] = True
    return entropy, mask


def test_tv10_intended_rule_selects_the_lowest_mean_entropy() -> None:
    entropy, mask = _padded(list(TRAJECTORIES.values()))
    scores = mean_token_entropy(entropy, mask)
    np.testing.assert_allclose(scores.numpy(), [0.30, 0.50, 0.35])
    assert list(TRAJECTORIES)[choose_trajectory(scores.numpy())] == "A"


def test_tv10_official_compat_score_selects_b() -> None:
    scores = {name: official_compat_score(PROMPT, t) for name, t in TRAJECTORIES.items()}
    assert scores == pytest.approx({"A": 0.129037, "B": 0.081034, "C": 0.108189}, abs=1e-6)
    for name, t in TRAJECTORIES.items():  # closed form for L <= L_max / 2
        assert scores[name] == pytest.approx((t.sum() + PROMPT.sum()) / (8192 - len(t)), rel=1e-12)
    assert list(scores)[choose_trajectory(list(scores.values()))] == "B"


def test_tv10_official_compat_score_of_a_long_trajectory_averages_its_tail() -> None:
    long = np.concatenate([np.full(4192, 2.0), np.full(1000, 0.1)])
    assert official_compat_score(PROMPT, long) == pytest.approx(1.366667, abs=1e-6)
    assert official_compat_score(PROMPT, long) == pytest.approx(long[-3000:].mean(), rel=1e-12)
    entropy, mask = _padded([long])
    assert float(mean_token_entropy(entropy, mask)[0]) == pytest.approx(8484 / 5192, rel=1e-12)


def test_official_compat_score_with_a_borrowed_mask_and_limits() -> None:
    short = np.full(10, 0.5)
    # The mask of a 8000-token row of the last chunk: only the last 192 positions are averaged.
    assert official_compat_score(PROMPT, short, mask_len=8000) == pytest.approx((5.0 + 182.0) / 192)
    assert np.isnan(official_compat_score(PROMPT, short, mask_len=8192))
    with pytest.raises(ValueError, match="longer than"):
        official_compat_score(np.zeros(1024), short)
    with pytest.raises(ValueError, match="mask_len"):
        official_compat_score(PROMPT, short, mask_len=9000)


def test_ties_go_to_the_first_candidate_in_both_modes() -> None:
    assert choose_trajectory([0.2, 0.1, 0.1, 0.3, 0.3]) == 1
    assert choose_trajectory([0.2, 0.1, 0.1, 0.3, 0.3], mode="argmax") == 3


@pytest.mark.parametrize("scores", [[], [float("nan"), 1.0]], ids=["empty", "nan"])
def test_choose_trajectory_refuses_bad_scores(scores: list[float]) -> None:
    with pytest.raises(ValueError):
        choose_trajectory(scores)


def test_choose_trajectory_refuses_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        choose_trajectory([1.0], mode="median")  # type: ignore[arg-type]  # an unknown mode on purpose


def test_choose_trajectories_picks_within_each_question() -> None:
    scores = [0.5, 0.1, 0.9, 0.3, 0.3, 0.7]
    assert choose_trajectories(scores, [2, 1, 3]) == [1, 0, 0]
    assert choose_trajectories(scores, [2, 1, 3], mode="argmax") == [0, 0, 2]
    with pytest.raises(ValueError, match="counts"):
        choose_trajectories(scores, [2, 2])
    with pytest.raises(ValueError, match="counts"):
        choose_trajectories(scores, [0, 6])


def test_ppl_prefers_the_most_likely_trajectory() -> None:
    logprobs = torch.tensor([[-1.0, -1.0, 0.0], [-0.2, -0.4, -0.3]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    ppl = perplexity(logprobs, mask)
    np.testing.assert_allclose(ppl.numpy(), [np.e, np.exp(0.3)], rtol=1e-6)
    scores = score_candidates("ppl", num_candidates=2, logprobs=logprobs, mask=mask)
    assert choose_trajectory(scores) == 1


def test_ent_scores_through_the_dispatcher() -> None:
    entropy, mask = _padded(list(TRAJECTORIES.values()))
    scores = score_candidates("ent", num_candidates=3, entropy=entropy, mask=mask)
    np.testing.assert_allclose(scores, [0.30, 0.50, 0.35])
    with pytest.raises(ValueError, match="expected 4 candidates"):
        score_candidates("ent", num_candidates=4, entropy=entropy, mask=mask)


def test_random_scores_are_reproducible_and_uniform() -> None:
    first = score_candidates("random", num_candidates=5, rng=np.random.default_rng(7))
    again = score_candidates("random", num_candidates=5, rng=np.random.default_rng(7))
    assert first.tolist() == again.tolist()
    rng = np.random.default_rng(0)
    picks = [choose_trajectory(score_candidates("random", num_candidates=4, rng=rng)) for _ in range(4000)]
    counts = np.bincount(picks, minlength=4)
    assert counts.min() > 850  # ~1000 each


@pytest.mark.parametrize(
    ("metric", "kwargs", "match"),
    [
        ("ent", {}, "entropy and mask"),
        ("ppl", {"mask": torch.ones(1, 1, dtype=torch.bool)}, "logprobs and mask"),
        ("random", {}, "Generator"),
        ("loss", {}, "metric must be one of"),
    ],
    ids=["ent", "ppl", "random", "unknown"],
)
def test_score_candidates_names_missing_inputs(metric: str, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        score_candidates(metric, num_candidates=1, **kwargs)  # type: ignore[arg-type]  # inputs left out on purpose


def test_mean_token_entropy_needs_a_token_per_row_and_matching_shapes() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        mean_token_entropy(torch.ones(2, 3), torch.tensor([[True, False, False], [False] * 3]))
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        mean_token_entropy(torch.ones(2, 3), torch.ones(2, 2, dtype=torch.bool))
