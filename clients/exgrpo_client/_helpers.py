"""Building rollouts and reading stored trajectories: the packed-array side of the wire contract."""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from exgrpo_client.schemas import (
    ID_DTYPE,
    LOGPROB_DTYPE,
    IdsLike,
    LogprobsLike,
    RolloutResult,
    TrajectoryPublic,
    decode_ids,
    decode_logprobs,
    encode_b64,
    ids_bytes,
    logprobs_bytes,
)

_INT32_MAX = 2**31 - 1


def rollout(
    reward: float,
    token_ids: IdsLike | None,
    logprobs: LogprobsLike | None,
    *,
    entropy: float | None = None,
    replayed: bool = False,
    finish_reason: Literal["stop", "length", "abort"] | None = None,
    text: str | None = None,
) -> RolloutResult:
    """One graded rollout, its token ids and log-probs packed as base64 arrays.

    `token_ids` and `logprobs` are lists or numpy arrays of the same length (the response tokens
    only, prompt excluded). Pass both as None for a rollout without payload (an incorrect one,
    or the replayed row whose trajectory the service already stores). `text`, the response
    decoded, is stored with a collected trajectory for people to read."""
    if (token_ids is None) != (logprobs is None):
        raise ValueError("give token_ids and logprobs together, or neither")
    fields: dict[str, object] = {"reward": float(reward), "replayed": replayed}
    if entropy is not None:
        fields["entropy"] = float(entropy)
    if finish_reason is not None:
        fields["finish_reason"] = finish_reason
    if text is not None:
        fields["text"] = text
    if token_ids is not None and logprobs is not None:
        ids = np.asarray(token_ids)
        lps = np.asarray(logprobs, dtype=np.float64)
        if ids.ndim != 1 or lps.ndim != 1:
            raise ValueError(f"token_ids and logprobs must be 1-D, got shapes {ids.shape} and {lps.shape}")
        if ids.shape != lps.shape:
            raise ValueError(f"token_ids ({ids.size}) and logprobs ({lps.size}) differ in length")
        if ids.size and (ids.min() < 0 or ids.max() > _INT32_MAX):
            raise ValueError("token ids must be in [0, 2^31)")
        raw_ids, raw_lps = ids_bytes(ids), logprobs_bytes(lps)
        fields["token_ids_b64"] = encode_b64(raw_ids)
        fields["logprobs_b64"] = encode_b64(raw_lps)
        out = RolloutResult.model_validate(fields)
        # a binary frame sends these buffers as they are (no base64 on either side)
        out._packed = (raw_ids, raw_lps)
        return out
    return RolloutResult.model_validate(fields)


def decode_trajectory(trajectory: TrajectoryPublic) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
    """Token ids (int32) and log-probs (float32) of a stored trajectory.

    The trajectory must carry its payload: ask for it with `payload=True` (question detail) or
    `candidates=...` (replay plans)."""
    if trajectory._packed is not None:  # it came in a binary frame
        ids = np.frombuffer(trajectory._packed[0], dtype=ID_DTYPE)
        lps = np.frombuffer(trajectory._packed[1], dtype=LOGPROB_DTYPE)
        return ids.astype(np.int32), lps.astype(np.float32)
    if trajectory.token_ids_b64 is None or trajectory.logprobs_b64 is None:
        raise ValueError(
            f"trajectory {trajectory.id} has no payload: fetch it with payload=True "
            "to get token ids and log-probs"
        )
    ids = decode_ids(trajectory.token_ids_b64)
    lps = decode_logprobs(trajectory.logprobs_b64)
    if ids.shape != lps.shape:
        raise ValueError(f"trajectory {trajectory.id}: {ids.size} token ids but {lps.size} log-probs")
    # astype copies: the decoded arrays are read-only views of the decoded bytes
    return ids.astype(np.int32), lps.astype(np.float32)
