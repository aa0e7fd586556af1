"""The trainer's background sender of late run metrics: one thread, step order, each step once,
bounded, errors logged, everything sent by `close()`."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from exgrpo_trainer.telemetry import RunMetricsSender


class FakeClient:
    """Records each post (step, thread, metrics); fails the steps in `fail`; each post waits for
    `gate` when one is given."""

    def __init__(self, fail: frozenset[int] = frozenset(), gate: threading.Event | None = None) -> None:
        self.posts: list[tuple[int, str, dict[str, float]]] = []
        self.fail = fail
        self.gate = gate

    def post_run_metrics(self, pool: str, run: str, step: int, metrics: dict[str, float]) -> None:
        assert (pool, run) == ("p", "r")
        if self.gate is not None:
            assert self.gate.wait(10)
        self.posts.append((step, threading.current_thread().name, metrics))
        if step in self.fail:
            raise ConnectionError(f"service down at step {step}")


def _sender(client: FakeClient, **kw: Any) -> RunMetricsSender:
    return RunMetricsSender(client, "p", "r", **kw)  # type: ignore[arg-type]  # a fake client


def test_steps_are_posted_once_each_in_order_from_one_background_thread() -> None:
    client = FakeClient()
    sender = _sender(client)
    metrics = {"timing/step": 0.5}
    for step in range(1, 41):
        sender.send(step, {**metrics, "step": float(step)})
    metrics["timing/step"] = 9.0  # the sender keeps its own copy
    sender.close()
    assert [step for step, _, _ in client.posts] == list(range(1, 41))
    assert {thread for _, thread, _ in client.posts} == {"exgrpo-run-metrics"}
    assert all(m == {"timing/step": 0.5, "step": float(s)} for s, _, m in client.posts)
    assert sender.num_sent == 40 and sender.failed_steps == []
    sender.close()  # closing again does nothing
    with pytest.raises(RuntimeError, match="closed"):
        sender.send(41, metrics)


def test_flush_waits_for_every_queued_step() -> None:
    gate = threading.Event()
    client = FakeClient(gate=gate)
    sender = _sender(client)
    sender.send(1, {"a": 1.0})
    sender.send(2, {"a": 2.0})
    threading.Timer(0.2, gate.set).start()
    sender.flush()
    assert [step for step, _, _ in client.posts] == [1, 2]
    sender.close()


def test_a_full_queue_makes_send_wait_and_drops_nothing() -> None:
    gate = threading.Event()
    client = FakeClient(gate=gate)
    sender = _sender(client, max_pending=2)
    for step in (1, 2, 3):  # step 1 is being posted (held at the gate), 2 and 3 fill the queue
        sender.send(step, {"a": float(step)})
    fourth = threading.Thread(target=sender.send, args=(4, {"a": 4.0}))
    fourth.start()
    fourth.join(0.3)
    assert fourth.is_alive(), "send should wait while max_pending steps are queued"
    gate.set()
    fourth.join(10)
    assert not fourth.is_alive()
    sender.close()
    assert [step for step, _, _ in client.posts] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="max_pending"):
        _sender(client, max_pending=0)


def test_a_failed_post_is_logged_not_retried_and_the_rest_still_go(caplog: pytest.LogCaptureFixture) -> None:
    client = FakeClient(fail=frozenset({2, 4}))
    sender = _sender(client)
    with caplog.at_level(logging.ERROR, logger="exgrpo.trainer"):
        for step in range(1, 6):
            sender.send(step, {"a": float(step)})
        sender.close()
    assert [step for step, _, _ in client.posts] == [1, 2, 3, 4, 5], "each step tried exactly once"
    assert sender.failed_steps == [2, 4] and sender.num_sent == 3
    messages = [r.getMessage() for r in caplog.records]
    assert "posting the run metrics of step 2 to the pool service failed" in messages
    assert "posting the run metrics of step 4 to the pool service failed" in messages
    assert any("of 2 of 5 steps did not reach the pool service (steps [2, 4])" in m for m in messages)
    assert all(r.exc_info for r in caplog.records if "failed" in r.getMessage()), "with the traceback"
