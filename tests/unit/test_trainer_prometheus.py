"""The trainer's Prometheus exporter serves the names the Grafana dashboard queries."""

from __future__ import annotations

import socket
import urllib.request

from exgrpo_trainer.telemetry import PrometheusExporter, metrics_port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_exporter_serves_step_split_and_solved_fraction() -> None:
    port = _free_port()
    exporter = PrometheusExporter(port)
    try:
        exporter.update(
            7, {"timing/generate": 1.5, "timing/update": 0.25, "batch/solved": 0.375, "loss/total": 1.0}
        )
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        exporter.close()
    assert 'exgrpo_trainer_step_seconds{part="generate"} 1.5' in body
    assert 'exgrpo_trainer_step_seconds{part="update"} 0.25' in body
    assert "exgrpo_trainer_solved_fraction 0.375" in body
    assert "exgrpo_trainer_step 7.0" in body


def test_port_from_config_or_environment(monkeypatch) -> None:
    monkeypatch.delenv("EXGRPO_TRAINER_METRICS_PORT", raising=False)
    assert metrics_port(None) is None
    assert metrics_port(9401) == 9401
    monkeypatch.setenv("EXGRPO_TRAINER_METRICS_PORT", "9400")
    assert metrics_port(None) == 9400
    assert metrics_port(9401) == 9401
