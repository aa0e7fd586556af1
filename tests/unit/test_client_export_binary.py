"""The SDK's pool export and import in both forms: binary by default (`Client(binary=...)`, or
`binary=` per call), NDJSON on request; an import tells the forms apart by the first byte."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from exgrpo_client import AsyncClient, Client, ExportFileError, exports, read_export, rollout
from exgrpo_client import schemas as s
from exgrpo_client._base import ExportWriter, UploadSource
from exgrpo_client.errors import ExgrpoError
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings

K = 4


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[AsyncClient]:
    settings = Settings(
        allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path}/pool.db", log_level="WARNING"
    )
    application = create_app(settings)
    async with (
        LifespanManager(application) as manager,
        AsyncClient("http://pool.test", transport=httpx.ASGITransport(app=manager.app), retries=0) as c,
    ):
        yield c


async def _trained(client: AsyncClient) -> s.PoolPublic:
    await client.create_pool("p1", {"k": K, "batch_size": 8})
    questions = [
        s.QuestionCreate(prompt=[s.ChatMessage(role="user", content=f"{i} + 1 = ?")], ground_truth=str(i + 1))
        for i in range(24)
    ]
    await client.import_questions("p1", questions)
    await client.create_run("p1", "r1")
    for step in range(3):
        plan = await client.plan_batch("p1", "r1")
        groups = []
        for item, replayed in [*((f, False) for f in plan.fresh), *((r, True) for r in plan.replay)]:
            q = item.question_id
            rows = [rollout(1.0, None, None, replayed=True)] if replayed else []
            rows += [
                rollout(float(j <= q % K), [q, j, step, 5], [-0.25, -0.5, -1.0, -2.0])
                for j in range(K - len(rows))
            ]
            groups.append(s.GroupResult(question_id=q, rollouts=rows))
        await client.commit_batch("p1", plan.id, groups)
    pool = await client.get_pool("p1")
    assert pool.num_trajectories > 0
    return pool


async def test_binary_by_default_ndjson_on_request(client: AsyncClient, tmp_path: Path) -> None:
    original = await _trained(client)
    binary = await client.export_pool("p1", tmp_path / "p1.exgrpo")
    data = (tmp_path / "p1.exgrpo").read_bytes()
    assert data.startswith(exports.MAGIC) and binary.num_bytes == len(data)
    assert binary.header.num_trajectories == original.num_trajectories and binary.header.pool.name == "p1"
    text = await client.export_pool("p1", tmp_path / "p1.ndjson", binary=False)
    assert (tmp_path / "p1.ndjson").read_bytes().startswith(b'{"type":"header"')
    assert text.header == binary.header and text.num_bytes > binary.num_bytes
    # the same records in both files
    assert list(read_export(tmp_path / "p1.exgrpo")) == list(read_export(tmp_path / "p1.ndjson"))

    for name, src in (("from-binary", tmp_path / "p1.exgrpo"), ("from-ndjson", tmp_path / "p1.ndjson")):
        imported = await client.import_pool(src, name)
        assert imported.trajectories == original.num_trajectories and imported.duplicates == 0
        copy = await client.get_pool(name)
        assert (copy.num_questions, copy.num_trajectories) == (
            original.num_questions,
            original.num_trajectories,
        )

    # a stream that cannot be rewound: its first bytes are read to tell its form, then sent
    class Pipe(io.BytesIO):
        def seekable(self) -> bool:
            return False

    piped = await client.import_pool(Pipe(data), "from-pipe")
    assert piped.trajectories == original.num_trajectories
    again = io.BytesIO()
    await client.export_pool("from-pipe", again)
    assert again.getvalue().startswith(exports.MAGIC)


def test_the_client_switch_and_the_headers(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []
    header = s.ExportHeader(pool=s.PoolCreate(name="p"), num_questions=0, num_trajectories=0, num_runs=0)
    body = exports.MAGIC + exports.model_record(header) + exports.end_record(1)
    answer = {"pool": "p", "questions": 0, "runs": 0, "states": 0, "trajectories": 0, "duplicates": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        request.read()
        if request.method == "POST":
            return httpx.Response(201, json=answer)
        return httpx.Response(200, content=body, headers={"content-type": exports.MEDIA_TYPE})

    transport = httpx.MockTransport(handler)
    with (
        Client("http://pool.test", transport=transport) as binary,
        Client("http://pool.test", transport=transport, binary=False) as plain,
    ):
        assert binary.export_pool("p", tmp_path / "a").header == header
        plain.export_pool("p", tmp_path / "b")
        plain.export_pool("p", tmp_path / "c", binary=True)
        binary.import_pool(tmp_path / "a")
        (tmp_path / "d.ndjson").write_bytes(s.export_line(header))
        binary.import_pool(tmp_path / "d.ndjson")
    accepts = [r.headers["accept"] for r in seen[:3]]
    assert accepts == [f"{exports.MEDIA_TYPE}, application/x-ndjson", "application/x-ndjson", accepts[0]]
    assert [r.headers["content-type"] for r in seen[3:]] == [exports.MEDIA_TYPE, "application/x-ndjson"]
    assert seen[3].content == body


def test_export_writer_reads_a_binary_header_in_pieces(tmp_path: Path) -> None:
    header = s.ExportHeader(pool=s.PoolCreate(name="p"), num_questions=3, num_trajectories=2, num_runs=1)
    body = exports.MAGIC + exports.model_record(header) + exports.end_record(1)
    writer = ExportWriter(tmp_path / "p.exgrpo")
    for i in range(len(body)):
        writer.feed(body[i : i + 1])
        writer.file.write(body[i : i + 1])
        assert (writer.header is None) == (i < len(body) - len(exports.end_record(1)) - 1)
    assert writer.finish().header == header
    assert (tmp_path / "p.exgrpo").read_bytes() == body

    for broken, message in (
        (b"\x89NOTOURS" + bytes(20), "does not begin with"),
        (exports.MAGIC + exports.end_record(0), "'end' record, not the header"),
        (exports.MAGIC + exports.record({"type": "header"}), "pool"),
    ):
        bad = ExportWriter(tmp_path / "bad.exgrpo")
        with pytest.raises(ExgrpoError, match=message):
            bad.feed(broken)
        bad.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.exgrpo"]


def test_read_export_names_the_broken_record(tmp_path: Path) -> None:
    header = s.ExportHeader(pool=s.PoolCreate(name="p"), num_questions=0, num_trajectories=0, num_runs=0)
    path = tmp_path / "p.exgrpo"
    cases: dict[str, tuple[bytes, str]] = {
        "cut off": (exports.MAGIC + exports.model_record(header), "without the end record"),
        "no header": (exports.MAGIC + exports.end_record(0), "record 1: the first record"),
        "bad record": (
            exports.MAGIC
            + exports.model_record(header)
            + exports.record({"type": "run"})
            + exports.end_record(2),
            "record 2: ",
        ),
        "wrong count": (exports.MAGIC + exports.model_record(header) + exports.end_record(5), "counts 5"),
    }
    for name, (data, message) in cases.items():
        path.write_bytes(data)
        with pytest.raises(ExportFileError, match=message):
            list(read_export(path))
        assert name


def test_an_upload_source_peeks_without_losing_bytes() -> None:
    data = bytes(range(256)) * 5000

    class Pipe(io.BytesIO):
        def seekable(self) -> bool:
            return False

    for file in (io.BytesIO(data), Pipe(data)):
        source = UploadSource(file)
        assert source.peek(8) == data[:8] and source.peek(3) == data[:3]
        out = b""
        while chunk := source.read():
            out += chunk
        assert out == data


def test_every_record_kind_reads_back_as_its_model() -> None:
    records: list[Any] = [
        s.ExportHeader(
            pool=s.PoolCreate(name="p", config=s.PoolConfig(k=4, weighting="uniform"), description="d"),
            num_questions=1,
            num_trajectories=1,
            num_runs=1,
        ),
        s.ExportRun(
            id=3,
            name="r",
            seed=1,
            phase="mixed",
            step=2,
            policy_version=1,
            overrides=s.RunOverrides(experience_ratio=0.25, batch_size=16),
        ),
        s.ExportPolicyVersion(run=3, version=1, uri="file:///c/1", step=2),
        s.ExportQuestion(
            id=7,
            prompt=[s.ChatMessage(role="user", content="1 + 1 = ?")],
            ground_truth="2",
            data_source="math",
            external_id="x-1",
            metadata={"level": 3, "tags": ["a", None, 1.5], "nested": {"ok": True}},
        ),
        s.ExportState(scope=3, question=7, last_k=2, bucket=2, retired=False, last_step=2),
    ]
    for record in records:
        (raw,) = exports.Reader().feed(exports.MAGIC + exports.model_record(record))
        assert exports.parse(raw) == record
