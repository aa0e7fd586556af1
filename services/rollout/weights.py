"""Loading a published policy into a generation engine, by the uri the trainer registered.

`load_policy(engine, uri)` is the one entry point the rollout worker uses:

- ``file:///.../v000010`` or a plain path: a Hugging Face folder on a filesystem shared with the
  trainer; the engine reads it (`engine.load_weights(path)`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

if TYPE_CHECKING:
    from exgrpo_rollout.engines.base import GenerationEngine

__all__ = ["load_policy", "path_from_uri"]


def path_from_uri(uri: str) -> str:
    """Local path of a published policy: a `file://` uri or a plain path."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"policy uri {uri!r} names host {parsed.netloc!r}: only local file:// uris load")
        return url2pathname(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return uri
    raise ValueError(
        f"policy uri {uri!r}: scheme {parsed.scheme!r} is not supported; workers load file:// uris "
        "from a filesystem shared with the trainer"
    )


def load_policy(engine: GenerationEngine, uri: str) -> None:
    """Load the policy published at `uri` into `engine` (raises ValueError for a uri it cannot load)."""
    engine.load_weights(path_from_uri(uri))
