"""How `bench/pool_bench.py` measures, where a choice of its own could bias what it reports.

- The service/floor ratios and their intervals hold for requests of a millisecond or two (a run's
  stats, a page of questions), not only for the long ones: the latencies a summary keeps, which
  the interval is drawn from, keep their microseconds, so the interval is the ratio's own spread
  and holds the ratio it is reported beside.
- The encodings of one request take turns going first: the first finds the rows it reads outside
  the database's cache, the one after inside it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import pool_bench as pb


def _latencies(rng: np.random.Generator, p50_ms: float, n: int) -> np.ndarray:
    """Latencies as a loaded server answers: most near the median, a slow tail."""
    return rng.normal(p50_ms, 0.05 * p50_ms, n).clip(0.5 * p50_ms) + rng.exponential(0.02 * p50_ms, n)


def _summary(ms: np.ndarray) -> dict[str, Any]:
    return pb.summarize([pb.Sample(ms=float(x), cpu_ms=float(x) / 2) for x in ms])


@pytest.mark.parametrize(("service_ms", "floor_ms"), [(1.50, 1.23), (1.21, 1.17), (2.6, 2.0), (45.0, 38.0)])
def test_the_interval_holds_the_ratio_it_is_reported_beside(service_ms: float, floor_ms: float) -> None:
    rng = np.random.default_rng(7)
    raw_a, raw_b = _latencies(rng, service_ms, 360), _latencies(rng, floor_ms, 360)
    a, b = _summary(raw_a), _summary(raw_b)
    ratio = a["p50_ms"] / b["p50_ms"]
    # the ratio is the latencies' own, within a rounding of the medians
    assert ratio == pytest.approx(np.median(raw_a) / np.median(raw_b), rel=2e-3)
    interval = pb.p50_ratio_interval(a["samples_ms"], b["samples_ms"])
    assert interval is not None
    lo, hi = interval
    assert lo <= round(ratio, 2) <= hi, (ratio, interval)
    # a spread, not the one value that quantised latencies make every resample give
    assert hi - lo >= 0.01, interval


@pytest.mark.parametrize("encodings", [["json", "binary"], ["binary"], ["json", "binary", "x"]])
def test_each_encoding_goes_first_as_often_as_the_others(encodings: list[str]) -> None:
    rounds = 6 * len(encodings)
    orders = [pb.in_turn(encodings, i) for i in range(rounds)]
    assert all(sorted(o) == sorted(encodings) for o in orders)  # every encoding, once a round
    firsts = [o[0] for o in orders]
    assert {e: firsts.count(e) for e in encodings} == dict.fromkeys(encodings, rounds // len(encodings))
    # and each one follows each other one as often: the rows it reads were read just before it
    # by each of the others in turn
    if len(encodings) > 1:
        seconds = [o[1] for o in orders]
        assert {e: seconds.count(e) for e in encodings} == dict.fromkeys(encodings, rounds // len(encodings))
