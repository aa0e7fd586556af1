"""Binary frames on the wire (`exgrpo_client.frames`), negotiated by `Content-Type` and `Accept`.

A commit or an ingest sent as a frame is read here before FastAPI sees it: the frame is decoded
and its payloads checked at once (vectorised over the whole request), and FastAPI validates the
rest of the body exactly as it validates a JSON body (the same model, the same errors). The
route then hands the checked arrays to its rollouts (`Wire.attach`). A plan, a batch or a
selection is answered as a frame when `Accept` names the frame's media type: stored payload bytes
go out as they are, without base64. Everything else stays JSON.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine, Iterator
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from exgrpo_client import frames
from exgrpo_client import schemas as s
from exgrpo_pool.api.deps import json_response
from exgrpo_pool.api.lean import LeanRoute
from exgrpo_pool.errors import BadRequest
from exgrpo_pool.jsonread import UNPARSED, parsed
from exgrpo_pool.service.convert import Answer, predecode, raw_payloads

MEDIA_TYPE = frames.MEDIA_TYPE

_PAYLOADS = "frame_payloads"


def _where(body: dict[str, Any], slot: int) -> str:
    """`groups[i].rollouts[j] (question q)` of a payload slot of a commit or an ingest."""
    seen = 0
    for gi, g in enumerate(body.get("groups") or []):
        rollouts = g.get("rollouts") if isinstance(g, dict) else None
        n = len(rollouts) if isinstance(rollouts, list) else 0
        if slot < seen + n:
            return f"groups[{gi}].rollouts[{slot - seen}] (question {g.get('question_id')})"
        seen += n
    return f"payload slot {slot}"


class FrameRoute(LeanRoute):
    """A route that also takes its body as a frame (`Content-Type: application/x-msgpack`), if it
    declares so (`openapi_extra=frame_body(...)`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        declared = (self.openapi_extra or {}).get("requestBody", {}).get("content", {})
        if MEDIA_TYPE not in declared:  # this route takes JSON only
            return handle

        async def route_handler(request: Request) -> Response:
            content_type = request.headers.get("content-type")
            if frames.wants_frame(content_type):
                request = await _unframed(request)
            elif content_type is None or "json" in content_type:
                await _json_parsed(request)
            return await handle(request)

        if self.direct is not None:  # a lean route: answered so (`DirectRoutes`)
            self.direct = route_handler
        return route_handler


def json_body(raw: bytes) -> Any:
    """A JSON body of megabytes (a commit, an ingest) as `json.loads` (FastAPI's parser) reads it,
    or `UNPARSED` for a body left to FastAPI, so that its answer (and its error) is what it was
    (`jsonread.parsed`)."""
    return parsed(raw)


async def _json_parsed(request: Request) -> None:
    """Parse a JSON body with `json_body` into Starlette's cache of the body's JSON, which FastAPI
    reads. A body that cannot be read (a client gone, a stream over the limit) or that `json_body`
    leaves alone goes to FastAPI as it came, for the answer it gave before."""
    try:
        raw = await request.body()
    except Exception:
        return
    body = json_body(raw)
    if body is not UNPARSED:
        request._json = body


async def _unframed(request: Request) -> Request:
    raw = await request.body()
    try:
        body, payloads = frames.decode(raw)
    except frames.FrameError as e:
        raise HTTPException(400, f"the body is not a readable {MEDIA_TYPE} frame: {e}") from e
    try:
        payloads.check()
    except frames.FrameError as e:
        where = _where(body, e.slot) if e.slot is not None else "payload"
        raise BadRequest(f"{where}: {e}") from e
    given = frames.json_fields_given(body)
    if given:
        fields = ", ".join(given)
        raise BadRequest(f"a frame carries payloads in its buffers: its body has no {fields} fields")
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
    scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
    scope.setdefault("state", {})
    unframed = Request(scope, request.receive)
    # Starlette's caches of the body and of its JSON: FastAPI reads the decoded body as it reads
    # a JSON one, and the idempotency record hashes the bytes that were sent
    unframed._body = raw
    unframed._json = body
    unframed.state.frame_payloads = payloads
    return unframed


class Wire:
    """The encodings of one request: whether its body came as a frame, whether its answer goes
    as one."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.binary_answer = frames.wants_frame(request.headers.get("accept"))

    def prepare(self, model: s.BatchCommit | s.IngestRequest) -> None:
        """Before the request takes a lock: hand the checked payloads of a frame body to the
        rollouts of its validated model, or decode and check those of a JSON body."""
        payloads = getattr(self.request.state, _PAYLOADS, None)
        if payloads is not None:
            # a frame's rollouts carry no payload fields (`_unframed` refuses them): all it has
            # is in its buffers, checked there; views into them (no copy), read while the
            # request lasts (stored, hashed, bound to the statements as they are)
            frames.attach(model, payloads, views=True)
        else:
            predecode(model.groups)

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """While building an answer that goes out as a frame: stored payloads stay bytes."""
        token = raw_payloads.set(self.binary_answer)
        try:
            yield
        finally:
            raw_payloads.reset(token)

    def respond(self, obj: Any, status_code: int = 200, headers: dict[str, str] | None = None) -> Any:
        """A frame of a plan or a selection when the client accepts one; else JSON."""
        if isinstance(obj, Answer):
            if self.binary_answer:
                return Response(obj.frame(), status_code, headers, media_type=MEDIA_TYPE)
            return Response(obj.json(), status_code, headers, media_type="application/json")
        if self.binary_answer and isinstance(obj, s.BatchPlan | s.SelectResult):
            body = frames.encode_model(obj)
            return Response(body, status_code=status_code, media_type=MEDIA_TYPE, headers=headers)
        return json_response(obj, status_code, headers)


async def wire(request: Request) -> Wire:
    return Wire(request)


WireDep = Annotated[Wire, Depends(wire)]


def frame_body(
    model: type[BaseModel] | None, description: str, forms: dict[str, str] | None = None
) -> dict[str, Any]:
    """`openapi_extra` of a route that takes its body as JSON or as a frame: `model` as a frame
    (FastAPI declares its JSON itself). A route that reads its raw body instead gives no model but
    `forms`, each media type it takes and what that body is; `description` is then the body's."""
    if model is None:
        content = _forms(forms or {})
        return {"requestBody": {"required": True, "description": description, "content": content}}
    return {
        "requestBody": {
            "content": _forms(
                {
                    MEDIA_TYPE: f"{description} as a binary frame: {model.__name__} without its "
                    "payload fields, with token ids and log-probs as raw little-endian buffers "
                    "(docs/api.md, 'Binary frames')."
                }
            )
        }
    }


def frame_answer(
    model: type[BaseModel] | None,
    status_code: int = 200,
    *,
    description: str = "",
    forms: dict[str, str] | None = None,
) -> dict[int | str, dict[str, Any]]:
    """`responses` of a route that answers as a frame when asked to: `model` as a frame (FastAPI
    declares its JSON itself). A route that builds its answer itself gives no model but `forms`,
    each media type it answers in and what that answer is, and the answer's `description`."""
    if model is None:
        return {status_code: {"description": description, "content": _forms(forms or {})}}
    return {
        status_code: {
            "content": _forms(
                {
                    MEDIA_TYPE: f"With `Accept: {MEDIA_TYPE}`: {model.__name__} as a binary frame, "
                    "stored payloads as raw little-endian buffers (docs/api.md, 'Binary frames')."
                }
            )
        }
    }


def _forms(forms: dict[str, str]) -> dict[str, Any]:
    """The `content` of a body or an answer: the msgpack form as binary, any other as text."""
    return {
        media: {
            "schema": {"type": "string", "format": "binary"} if media == MEDIA_TYPE else {"type": "string"},
            "description": what,
        }
        for media, what in forms.items()
    }
