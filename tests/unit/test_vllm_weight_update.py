"""vLLM weight updates, the parts that run without a GPU: the RPC methods the engine calls, the
(name, dtype, shape) protocol of the NCCL broadcast and the order tensors arrive in, the
http:// / shm:// fetch inside a worker, and the trainer-side orchestration (`push_weights`). The
NCCL transfer itself needs two GPUs: scripts/vllm_nccl_check.py."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from exgrpo_rollout.engines import vllm_nccl
from exgrpo_rollout.engines.vllm_ext import WeightReloader, spec_dtype, weight_specs
from exgrpo_rollout.weights import decode_state, encode_state, load_policy

STATE = {
    "model.embed_tokens.weight": torch.randn(11, 4),
    "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4).to(torch.bfloat16),
    "model.norm.weight": torch.randn(4).half(),
    "step": torch.tensor(3, dtype=torch.int64),
}


class _Model:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: Any) -> set[str]:
        self.loaded.extend(weights)
        return {n for n, _ in self.loaded}


def _reloader() -> tuple[WeightReloader, _Model]:
    model = _Model()
    r = WeightReloader()
    r.model_runner = types.SimpleNamespace(model=model)
    r.device = torch.device("cpu")
    return r, model


class _Comm:
    """Stands in for PyNcclCommunicator: each broadcast receives the next tensor the trainer sent."""

    def __init__(self, sent: list[torch.Tensor]) -> None:
        self.sent = list(sent)
        self.calls: list[tuple[tuple[int, ...], torch.dtype, int]] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        source = self.sent.pop(0)
        self.calls.append((tuple(tensor.shape), tensor.dtype, src))
        assert tensor.shape == source.shape and tensor.dtype == source.dtype
        tensor.copy_(source)


def _assert_loaded(model: _Model) -> None:
    assert [n for n, _ in model.loaded] == list(STATE)
    for name, t in model.loaded:
        assert t.dtype == STATE[name].dtype and torch.equal(t, STATE[name]), name


def test_specs_name_dtype_and_shape_in_send_order() -> None:
    specs = weight_specs(STATE)
    assert specs == [
        ("model.embed_tokens.weight", "float32", [11, 4]),
        ("model.layers.0.self_attn.q_proj.weight", "bfloat16", [4, 4]),
        ("model.norm.weight", "float16", [4]),
        ("step", "int64", []),
    ]
    assert [spec_dtype(d) for _, d, _ in specs] == [t.dtype for t in STATE.values()]
    with pytest.raises(ValueError, match="not a torch dtype"):
        spec_dtype("Tensor")


def test_worker_receives_each_broadcast_into_its_weight_loader() -> None:
    reloader, model = _reloader()
    with pytest.raises(RuntimeError, match="before exgrpo_init_weight_group"):
        reloader.exgrpo_receive_weights(weight_specs(STATE))
    comm = _Comm(list(STATE.values()))
    reloader._exgrpo_comm = comm
    specs = [list(s) for s in weight_specs(STATE)]  # as msgpack hands them over: lists
    assert reloader.exgrpo_receive_weights(specs) == len(STATE)
    assert [src for _, _, src in comm.calls] == [0] * len(STATE) and not comm.sent
    _assert_loaded(model)
    reloader.exgrpo_close_weight_group()
    assert reloader._exgrpo_comm is None


def test_worker_fetches_http_and_shm_uris_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    reloader, model = _reloader()
    fetched: list[str] = []

    @contextlib.contextmanager
    def policy_state(uri: str) -> Iterator[dict[str, torch.Tensor]]:
        fetched.append(uri)
        yield decode_state(encode_state(STATE))

    monkeypatch.setattr("exgrpo_rollout.weights.policy_state", policy_state)
    assert reloader.exgrpo_load_uri("shm://seg.v000001") == len(STATE)
    assert fetched == ["shm://seg.v000001"]
    # encode_state lays tensors out by element size; the loader gets every one, bit for bit
    assert sorted(n for n, _ in model.loaded) == sorted(STATE)
    for name, t in model.loaded:
        assert torch.equal(t, STATE[name])


class _LLM:
    def __init__(self, **kwargs: Any) -> None:
        self.rpc: list[tuple[str, tuple[Any, ...]]] = []
        self.resets = 0
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=None))

    def get_tokenizer(self) -> Any:
        return types.SimpleNamespace(eos_token_id=2)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[int]:
        self.rpc.append((method, args))
        return [len(args[0])] if method == "exgrpo_receive_weights" else [1]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = types.ModuleType("vllm")
    module.LLM = _LLM  # type: ignore[attr-defined]  # a stand-in vllm module
    monkeypatch.setitem(sys.modules, "vllm", module)
    from exgrpo_rollout.engines.vllm import VLLMEngine

    return VLLMEngine("/m")


def test_engine_rpc_names_and_arguments(engine: Any) -> None:
    llm: _LLM = engine.llm
    load_policy(engine, "http://127.0.0.1:1/policies/p/r/v000002")  # vLLM workers fetch it themselves
    load_policy(engine, "shm://seg.v000003")
    assert llm.rpc == [
        ("exgrpo_load_uri", ("http://127.0.0.1:1/policies/p/r/v000002",)),
        ("exgrpo_load_uri", ("shm://seg.v000003",)),
    ]
    assert llm.resets == 2
    assert engine.init_weight_group("10.0.0.1", 29600, 1, 3) == [1]
    assert llm.rpc[-1] == ("exgrpo_init_weight_group", ("10.0.0.1", 29600, 1, 3))
    specs = weight_specs(STATE)
    assert engine.receive_weights(specs) == [len(STATE)]
    assert llm.rpc[-1] == ("exgrpo_receive_weights", (specs,)) and llm.resets == 3


class _Sender:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[str] = []
        self.fail = fail

    def send(self, tensors: dict[str, torch.Tensor]) -> list[Any]:
        if self.fail:
            raise RuntimeError("NCCL error")
        self.sent = list(tensors)
        return weight_specs(tensors)


class _Engine:
    def __init__(self) -> None:
        self.specs: list[Any] = []

    def receive_weights(self, specs: list[Any]) -> list[int]:
        self.specs = specs
        return [len(specs), len(specs)]  # two tensor-parallel workers

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int) -> list[int]:
        return list(range(rank_offset, world_size))


def test_push_weights_sends_what_the_workers_expect() -> None:
    engine, sender = _Engine(), _Sender()
    counts = vllm_nccl.push_weights(cast(Any, engine), cast(Any, sender), STATE)
    assert counts == [len(STATE)] * 2
    assert sender.sent == list(STATE) and engine.specs == weight_specs(STATE)
    with pytest.raises(RuntimeError, match="NCCL error"):
        vllm_nccl.push_weights(cast(Any, engine), cast(Any, _Sender(fail=True)), STATE)


def test_connect_builds_rank_zero_beside_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[Any, ...]] = []

    def sender(host: str, port: int, world_size: int, device: Any) -> Any:
        made.append((host, port, world_size, device))
        return "sender"

    monkeypatch.setattr(vllm_nccl, "NcclWeightSender", sender)
    assert vllm_nccl.connect(cast(Any, _Engine()), "h", 5, "cuda:0", workers=2) == "sender"
    assert made == [("h", 5, 3, "cuda:0")]
