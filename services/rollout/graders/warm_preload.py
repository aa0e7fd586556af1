"""Importing this module warms the answer parsers (import side effect, by design).

Preloaded by the grading pool's fork server so that forked workers inherit warm parser caches.
"""

from __future__ import annotations

import logging

from exgrpo_rollout.graders.warmup import warm_up

logging.getLogger("math_verify").setLevel(logging.ERROR)
warm_up()
