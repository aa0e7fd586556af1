"""Generation with transformers `generate` (CPU or GPU), with per-token log-probs and entropies.

Log-probs and entropies are recorded inside generation by two logits processors, one step at a
time, so memory stays at one [rows, vocab] matrix instead of all steps' logits:
- before temperature/top-p: the entropy of the raw next-token distribution;
- after them: the log-softmax of the sampling distribution, from which the next step reads the
  log-prob of the token that was just sampled (the last one is read after generation).

A caller that recomputes both quantities itself (the trainer's colocated engine, which scores every
row before its update) builds the engine with `record=False`: then neither processor runs, and the
completions carry empty `logprobs` and no `entropies`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from exgrpo_rollout.engines.base import Completion, GenerationStats, SamplingConfig


class _RawEntropy(LogitsProcessor):
    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logp = torch.log_softmax(scores.float(), dim=-1)
        self.steps.append(-(logp.exp() * logp).nan_to_num(0.0).sum(-1))
        return scores


class _SampledLogprob(LogitsProcessor):
    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, last_tokens[:, None]).squeeze(-1))
            self.prev = None


class TransformersEngine:
    name = "transformers"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_rows: int = 256,
        synced_gpus: bool = False,
        decode: bool = True,
        record: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self.synced_gpus = synced_gpus
        self.decode = decode
        self.record = record  # per-token log-probs and entropies (see the module docstring)
        eos = (
            tokenizer.eos_token_id
            if model.generation_config.eos_token_id is None
            else (model.generation_config.eos_token_id)
        )
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self._stats = GenerationStats()

    @property
    def last_stats(self) -> GenerationStats:
        return self._stats

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_weights(self, path: str) -> None:
        """Load a Hugging Face folder (or one safetensors file): its safetensors files are mapped and
        copied into the model (`load_state_dict`); a folder without them goes through
        `from_pretrained`."""
        from exgrpo_rollout.engines.vllm_ext import safetensors_files

        try:
            files = safetensors_files(path)
        except FileNotFoundError:
            if not Path(path).is_dir():
                raise
            from transformers import AutoModelForCausalLM

            fresh = AutoModelForCausalLM.from_pretrained(path, dtype=next(self.model.parameters()).dtype)
            self.model.load_state_dict(fresh.state_dict())
            return
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f), device="cpu"))
        self.load_state_dict(tensors)

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy named tensors (Hugging Face names, any floating dtype) into the model's weights, in
        place. Every weight must be given, except an LM head tied to the input embedding."""
        own = self.model.state_dict()
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [k for k in own if k not in tensors and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in tensors if k not in own]
        wrong = [
            f"{k} {tuple(t.shape)} != {tuple(own[k].shape)}"
            for k, t in tensors.items()
            if k in own and t.shape != own[k].shape
        ]
        if missing or unexpected or wrong:
            raise ValueError(
                f"policy weights do not match the engine's model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, shapes {wrong[:5]}"
            )
        with torch.no_grad():
            for k, t in tensors.items():
                own[k].copy_(t)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        start = time.perf_counter()
        per_call = max(1, self.max_batch_rows // sampling.n)
        out: list[list[Completion]] = []
        generator_state = None
        if sampling.seed is not None:
            generator_state = torch.random.get_rng_state()
            torch.manual_seed(sampling.seed)
        try:
            for i in range(0, len(prompts), per_call):
                out.extend(self._generate_chunk(prompts[i : i + per_call], sampling))
        finally:
            if generator_state is not None:
                torch.random.set_rng_state(generator_state)
        tokens = sum(len(c.token_ids) for cs in out for c in cs)
        self._stats = GenerationStats(
            prompts=len(prompts),
            completions=len(prompts) * sampling.n,
            generated_tokens=tokens,
            seconds=time.perf_counter() - start,
        )
        return out

    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        width = max(len(p) for p in prompts)
        # left padding: generation continues at the right edge
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = (
            torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]
        ).long()
        entropy, sampled = _RawEntropy(), _SampledLogprob()
        processors: list[Any] = [entropy] if self.record else []
        if sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(sampling.top_p))
        if self.record:
            processors.append(sampled)
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_new_tokens,
            num_return_sequences=sampling.n,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids) or None,
        )
        dev = self.device
        # a causal LM is a PreTrainedModel and a GenerationMixin; the annotation names the first only
        generator = cast(GenerationMixin, self.model)
        seqs = generator.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            generation_config=config,
            logits_processor=LogitsProcessorList(processors),
            synced_gpus=self.synced_gpus,
        )
        new = seqs[:, width:].cpu()
        if new.shape[1] == 0:
            raise RuntimeError("generation produced no tokens")
        logps = ents = None
        if self.record:
            sampled.finish(seqs[:, -1])
            logps = torch.stack(sampled.steps, dim=1).cpu()[:, : new.shape[1]]
            ents = torch.stack(entropy.steps, dim=1).cpu()[:, : new.shape[1]]
        kept: list[list[int]] = []
        stopped: list[bool] = []
        for toks in new.tolist():
            end = next((t + 1 for t, tok in enumerate(toks) if tok in self.eos_ids), None)
            kept.append(toks if end is None else toks[:end])
            stopped.append(end is not None)
        texts = self.tokenizer.batch_decode(kept, skip_special_tokens=False) if self.decode else None
        results: list[list[Completion]] = []
        for p in range(len(prompts)):
            group = []
            for j in range(sampling.n):
                row = p * sampling.n + j
                n_tok = len(kept[row])
                group.append(
                    Completion(
                        token_ids=kept[row],
                        logprobs=logps[row, :n_tok].tolist() if logps is not None else [],
                        entropies=ents[row, :n_tok].tolist() if ents is not None else None,
                        finish_reason="stop" if stopped[row] else "length",
                        text=texts[row] if texts is not None else "",
                    )
                )
            results.append(group)
        return results
