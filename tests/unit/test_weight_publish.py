"""Weight publication: what the trainer publishes (file folder, http from memory, shared memory) is
what a worker's engine holds after `load_policy`, bit for bit; the byte format is safetensors both
ways; old versions are dropped; bad uris and versions no longer served fail with clear errors."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from exgrpo_onebox.tiny import build_tokenizer, tiny_qwen2
from exgrpo_rollout.engines.base import SamplingConfig
from exgrpo_rollout.engines.factory import load_engine
from exgrpo_rollout.engines.hf import TransformersEngine
from exgrpo_rollout.weights import (
    decode_state,
    encode_state,
    fetch_model_dir,
    load_policy,
    path_from_uri,
    policy_state,
    shm_path,
)
from exgrpo_trainer.publisher import (
    FilePublisher,
    HttpPublisher,
    ShmPublisher,
    WeightPublisher,
    make_publisher,
)

KINDS = ["file", "http", "shm"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def _model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    return tiny_qwen2(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden=32,
        max_positions=128,
        seed=seed,
    )


@pytest.fixture
def publisher(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[WeightPublisher]:
    kind = request.param
    pub: WeightPublisher
    if kind == "file":
        pub = FilePublisher(tmp_path / "published")
    elif kind == "http":
        pub = HttpPublisher(keep=2)
    else:
        if not Path("/dev/shm").is_dir():
            pytest.skip("POSIX shared memory (/dev/shm) is Linux only")
        pub = ShmPublisher(keep=2)
    try:
        yield pub
    finally:
        pub.close()


def _assert_same_weights(engine: TransformersEngine, trainer: Qwen2ForCausalLM) -> None:
    got, want = engine.model.state_dict(), trainer.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("publisher", KINDS, indirect=True)
def test_worker_engine_holds_the_trainers_weights_bit_for_bit(
    publisher: WeightPublisher, tokenizer: PreTrainedTokenizerFast
) -> None:
    trainer = _model(tokenizer, seed=1)
    engine = TransformersEngine(_model(tokenizer, seed=2), tokenizer)
    assert not torch.equal(engine.model.model.embed_tokens.weight, trainer.model.embed_tokens.weight)
    for version in range(5):  # from the fourth on, memory of dropped versions is reused
        with torch.no_grad():  # an "update": every weight moves
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        uri = publisher.publish(trainer, tokenizer, "pool-a", "run-1", version)
        assert uri.startswith(f"{publisher.kind}:"), uri
        assert uri.endswith(f"v{version:06d}")
        load_policy(engine, uri)
        _assert_same_weights(engine, trainer)
    # tied LM head follows the embedding; the engine still generates
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    out = engine.generate([[5, 6, 7]], SamplingConfig(n=2, max_new_tokens=4, min_new_tokens=4, seed=0))
    assert [len(c.token_ids) for c in out[0]] == [4, 4]


@pytest.mark.parametrize("publisher", ["http", "shm"], indirect=True)
def test_a_worker_without_a_model_folder_builds_its_engine_from_the_uri(
    publisher: WeightPublisher, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    trainer = _model(tokenizer, seed=3)
    uri = publisher.publish(trainer, tokenizer, "pool-a", "run-1", 0)
    folder = fetch_model_dir(uri, tmp_path / "model")
    engine, tok = load_engine("transformers", str(folder), device="cpu", dtype="float32", seed=0)
    assert isinstance(engine, TransformersEngine)
    _assert_same_weights(engine, trainer)
    assert tok.chat_template == tokenizer.chat_template


@pytest.mark.parametrize("publisher", ["http", "shm"], indirect=True)
def test_only_the_newest_versions_are_kept(
    publisher: WeightPublisher, tokenizer: PreTrainedTokenizerFast
) -> None:
    trainer = _model(tokenizer, seed=4)
    engine = TransformersEngine(_model(tokenizer, seed=5), tokenizer)
    uris = [publisher.publish(trainer, tokenizer, "pool-a", "run-1", v) for v in range(3)]
    other = publisher.publish(trainer, tokenizer, "pool-a", "run-2", 0)  # another run keeps its own
    with pytest.raises(FileNotFoundError, match=r"not served|no shared-memory segment"):
        load_policy(engine, uris[0])
    for uri in (*uris[1:], other):
        load_policy(engine, uri)
    publisher.close()
    with pytest.raises((FileNotFoundError, ConnectionError)):
        load_policy(engine, uris[2])


def test_the_byte_format_is_safetensors_both_ways() -> None:
    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.bf16": torch.randn(7).to(torch.bfloat16),
        "c.half": torch.randn(2, 2).to(torch.float16),
        "d.ids": torch.arange(5, dtype=torch.int64),
        "e.empty": torch.zeros(0, 4),
        "f.scalar": torch.tensor(1.5),
    }
    mine = encode_state(tensors, {"format": "pt"})
    theirs = st_load(bytes(mine))
    assert theirs.keys() == tensors.keys()
    for k, t in tensors.items():
        assert theirs[k].dtype == t.dtype and torch.equal(theirs[k], t), k
    back = decode_state(bytearray(st_save(tensors)))
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k


def test_decode_refuses_damaged_bytes() -> None:
    good = encode_state({"w": torch.ones(4)})
    with pytest.raises(ValueError, match="truncated"):
        decode_state(bytearray(b"\x01"))
    with pytest.raises(ValueError, match="does not fit"):
        decode_state(good[:-4])
    with pytest.raises(ValueError, match="header"):
        decode_state(bytearray((10**9).to_bytes(8, "little")) + bytearray(8))


def test_bad_uris_fail_with_a_clear_error(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    engine = TransformersEngine(_model(tokenizer, seed=6), tokenizer)
    with pytest.raises(ValueError, match="scheme 's3' is not supported"):
        load_policy(engine, "s3://bucket/v000001")
    with pytest.raises(ValueError, match="names host"):
        load_policy(engine, "file://otherhost/srv/v000001")
    with pytest.raises(FileNotFoundError):
        load_policy(engine, (tmp_path / "missing").as_uri())
    with pytest.raises(ValueError, match="one name"):
        load_policy(engine, "shm://a/b")
    with pytest.raises(FileNotFoundError, match="no shared-memory segment"):
        load_policy(engine, f"shm://exgrpo-missing-{os.getpid()}")
    server = HttpPublisher()
    server.start()
    port = server.port
    try:
        with pytest.raises(FileNotFoundError, match="HTTP 404"):
            load_policy(engine, f"http://127.0.0.1:{port}/policies/p/r/v000001")
        with pytest.raises(FileNotFoundError, match=r"HTTP 404 not a policy path"):
            load_policy(engine, f"http://127.0.0.1:{port}/elsewhere")
    finally:
        server.close()
    with pytest.raises(ConnectionError, match="cannot be reached"):
        load_policy(engine, f"http://127.0.0.1:{port}/policies/p/r/v000001")
    assert path_from_uri("file:///srv/out/v000010") == "/srv/out/v000010"


def test_a_state_dict_of_another_model_is_refused(tokenizer: PreTrainedTokenizerFast) -> None:
    engine = TransformersEngine(_model(tokenizer, seed=7), tokenizer)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = engine.model.model.norm.weight.clone()
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="shapes"):
        engine.load_state_dict(wrong)
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing"):
        engine.load_state_dict(missing)
    assert torch.equal(engine.model.model.norm.weight, before), "a refused load changes nothing"


def test_a_shm_segment_rewritten_during_a_load_is_detected(tokenizer: PreTrainedTokenizerFast) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("POSIX shared memory (/dev/shm) is Linux only")
    trainer = _model(tokenizer, seed=8)
    pub = ShmPublisher(keep=1)
    try:
        first = pub.publish(trainer, tokenizer, "pool-a", "run-1", 0)
        rewritten = pytest.raises(ValueError, match="rewrote the segment during the load")
        with rewritten, policy_state(first) as tensors:
            assert tensors
            pub.publish(trainer, tokenizer, "pool-a", "run-1", 1)  # drops v0
            newest = pub.publish(trainer, tokenizer, "pool-a", "run-1", 2)  # rewrites v0's pages
        assert shm_path(newest).exists() and not shm_path(first).exists()
        with policy_state(newest) as tensors:  # an undisturbed load passes the check
            assert torch.equal(tensors["model.norm.weight"], trainer.model.norm.weight)
    finally:
        pub.close()
    assert not shm_path(newest).exists()


def test_an_http_buffer_being_sent_is_not_reused(tokenizer: PreTrainedTokenizerFast) -> None:
    trainer = _model(tokenizer, seed=9)
    pub = HttpPublisher(keep=1)
    try:
        pub.publish(trainer, tokenizer, "pool-a", "run-1", 0)
        sending = pub.checkout(("pool-a", "run-1", 0))  # an answer is sending v0
        assert sending is not None
        pub.publish(trainer, tokenizer, "pool-a", "run-1", 1)  # drops v0
        v1 = pub.versions.get(("pool-a", "run-1", 1))
        pub.publish(trainer, tokenizer, "pool-a", "run-1", 2)  # drops v1
        assert pub.versions.get(("pool-a", "run-1", 2)) is not sending, "v0's buffer is still being sent"
        pub.checkin(sending)
        pub.publish(trainer, tokenizer, "pool-a", "run-1", 3)
        assert pub.versions.get(("pool-a", "run-1", 3)) is v1, "a dropped buffer nobody sends is reused"
    finally:
        pub.close()


def test_a_restarted_trainer_publishes_shm_under_the_same_uri(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("POSIX shared memory (/dev/shm) is Linux only")
    trainer = _model(tokenizer, seed=10)
    engine = TransformersEngine(_model(tokenizer, seed=11), tokenizer)
    crashed = make_publisher("shm", tmp_path / "published")
    uri = crashed.publish(trainer, tokenizer, "pool-a", "run-1", 3)  # never closed: the process died
    restarted = make_publisher("shm", tmp_path / "published")
    other = make_publisher("shm", tmp_path / "elsewhere")
    try:
        with torch.no_grad():
            trainer.model.norm.weight.add_(1.0)  # the restarted trainer's weights of that version
        assert restarted.publish(trainer, tokenizer, "pool-a", "run-1", 3) == uri
        load_policy(engine, uri)
        _assert_same_weights(engine, trainer)
        assert other.publish(trainer, tokenizer, "pool-a", "run-1", 3) != uri
    finally:
        restarted.close()
        other.close()
    assert not shm_path(uri).exists()
