"""One interface for generation engines (vLLM on GPU, transformers on CPU or GPU).

`generate(prompts, sampling)` takes tokenised prompts and returns, for each prompt in input order,
`sampling.n` completions with their token ids (up to and including the first EOS), the log-prob of
every sampled token under the sampling distribution, the per-token entropy, and why they stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    """Needed for random-init models, whose EOS would otherwise end sequences at once."""
    seed: int | None = None
    """Seeds the generator for this call (engine-wide seed when the engine cannot seed per call)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError("need 1 <= max_new_tokens and min_new_tokens <= max_new_tokens")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float] | None = None
    finish_reason: Literal["stop", "length"] = "stop"
    text: str = ""

    @property
    def mean_entropy(self) -> float | None:
        if not self.entropies:
            return None
        return sum(self.entropies) / len(self.entropies)


@dataclass
class GenerationStats:
    prompts: int = 0
    completions: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class GenerationEngine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """`sampling.n` completions for each prompt, in input order."""

    def load_weights(self, path: str) -> None:
        """Switch to the weights published at `path` (a Hugging Face folder or safetensors file)."""

    @property
    def last_stats(self) -> GenerationStats: ...
