"""Fixtures of the trainer tests: a tiny random Qwen2 in Hugging Face format, built once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores are shared by the test processes: one thread each keeps torch from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from exgrpo_onebox.tiny import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
