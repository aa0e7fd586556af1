"""Python SDK of the ExGRPO experience pool service.

    from exgrpo_client import Client, rollout

    with Client() as pool:                       # $EXGRPO_URL, $EXGRPO_TOKEN
        plan = pool.plan_batch("math", "run-1")
        ...
        pool.commit_batch("math", plan.id, groups)

`Client` blocks, `AsyncClient` awaits; both return the models of `exgrpo_client.schemas`, the
wire contract shared with the service, and raise the errors of `exgrpo_client.errors`.
`exgrpo_client.io` reads question files (parquet, JSON Lines) and pool exports.
"""

from exgrpo_client._base import __version__ as __version__
from exgrpo_client._client import AsyncClient, Client
from exgrpo_client._helpers import decode_trajectory, rollout
from exgrpo_client._models import Health, PoolExported, PoolImported, Readiness
from exgrpo_client.errors import (
    APIError,
    BadRequest,
    Conflict,
    ExgrpoError,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServerError,
    TransportError,
    Unauthorized,
)
from exgrpo_client.io import ExportFileError, QuestionFileError, read_export, read_questions
from exgrpo_client.schemas import (
    BatchPlan,
    ChatMessage,
    CommitResult,
    GroupResult,
    PoolConfig,
    QuestionCreate,
    RolloutResult,
    RunLease,
    RunOverrides,
)

__all__ = [
    "APIError",
    "AsyncClient",
    "BadRequest",
    "BatchPlan",
    "ChatMessage",
    "Client",
    "CommitResult",
    "Conflict",
    "ExgrpoError",
    "ExportFileError",
    "Forbidden",
    "GroupResult",
    "Health",
    "NotFound",
    "PayloadTooLarge",
    "PoolConfig",
    "PoolExported",
    "PoolImported",
    "QuestionCreate",
    "QuestionFileError",
    "RateLimited",
    "Readiness",
    "RolloutResult",
    "RunLease",
    "RunOverrides",
    "ServerError",
    "TransportError",
    "Unauthorized",
    "decode_trajectory",
    "read_export",
    "read_questions",
    "rollout",
]
