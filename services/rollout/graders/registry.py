"""Grader lookup by name.

Built-in names: ``math_think`` (training reward, spec section 7), ``math_think_strip_eos`` (same,
trailing EOS string removed first), ``boxed`` (evaluation grader, spec section 9.1), ``choice``
(boxed letter answers), ``choice_letter`` (the final option letter, boxed or not) and ``arithmetic``
(synthetic integer tasks).

Any other name is read as a dotted path to a user function with the grader signature
``(response: str, ground_truth: str) -> Grade``: ``"package.module:function"`` or
``"package.module.function"`` (an attribute path after the colon may contain dots, e.g.
``"pkg.mod:Holder.method"``). User graders are not wrapped: use them through ``grade_one`` or
:class:`~exgrpo_rollout.graders.pool.GradingPool`, which turn exceptions and bad return values into
zero-reward grades.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import cast

from exgrpo_rollout.graders.base import Grader

__all__ = ["BUILTIN_GRADERS", "get_grader"]

BUILTIN_GRADERS: dict[str, str] = {
    "math_think": "exgrpo_rollout.graders.math_think:math_think",
    "math_think_strip_eos": "exgrpo_rollout.graders.math_think:math_think_strip_eos",
    "boxed": "exgrpo_rollout.graders.boxed:boxed",
    "choice": "exgrpo_rollout.graders.boxed:choice",
    "choice_letter": "exgrpo_rollout.graders.choice_letter:choice_letter",
    "arithmetic": "exgrpo_rollout.graders.arithmetic:arithmetic",
}


def _import_target(module_name: str, attr_path: str, spec: str) -> object:
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"grader {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    for part in attr_path.split("."):
        if not part.isidentifier():
            raise ValueError(f"grader {spec!r}: {attr_path!r} is not a valid attribute path")
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(f"grader {spec!r}: {module_name!r} has no attribute {attr_path!r}") from exc
    return obj


def _resolve(spec: str) -> object:
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
        if not module_name or not attr_path or ":" in attr_path:
            raise ValueError(f"grader {spec!r}: expected 'package.module:function'")
        return _import_target(module_name, attr_path, spec)
    module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"grader {spec!r}: expected 'package.module.function'")
    return _import_target(module_name, attr, spec)


@lru_cache(maxsize=128)
def _get_grader_cached(name: str) -> Grader:
    target = BUILTIN_GRADERS.get(name, name)
    if target == name and "." not in name and ":" not in name:
        known = ", ".join(sorted(BUILTIN_GRADERS))
        raise ValueError(
            f"unknown grader {name!r}: use one of {known} or a dotted path 'package.module:function'"
        )
    obj = _resolve(target)
    if not callable(obj):
        raise ValueError(f"grader {name!r} resolves to a non-callable {type(obj).__name__} object")
    return cast(Grader, obj)


def get_grader(name: str) -> Grader:
    """Grader for a built-in name or a dotted path; ``ValueError`` for unknown names or non-callables."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"grader name must be a non-empty string, got {name!r}")
    return _get_grader_cached(name.strip())
