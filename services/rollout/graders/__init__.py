"""Answer graders: training reward, evaluation graders, registry and a process pool with timeouts.

``Grader = Callable[[str, str], Grade]`` takes the response text and the ground truth and never
raises for bad model output.
"""

import logging

from exgrpo_rollout.graders.base import Grade, Grader
from exgrpo_rollout.graders.pool import GradingPool, grade_items, grade_one
from exgrpo_rollout.graders.registry import BUILTIN_GRADERS, get_grader

# Time limits are enforced here (process pool, SIGALRM), so Math-Verify's notice that its own are
# off is noise on every call.
logging.getLogger("math_verify").setLevel(logging.ERROR)

__all__ = ["BUILTIN_GRADERS", "Grade", "Grader", "GradingPool", "get_grader", "grade_items", "grade_one"]
