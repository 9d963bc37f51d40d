"""The LoRA flags of a diffusion model's command: `--lora FILE[:WEIGHT]` (repeatable) and
`--lora-merge`; their checks before any rank starts, and the adapters they make resident."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from ..checkpoint import ComponentsReader
from .files import LoraError, read_lora
from .resident import ResidentLoras, match_keys


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=None, metavar="FILE[:WEIGHT]",
                   help="a LoRA adapter applied unmerged to the denoiser (diffusers' save_lora_weights file or a "
                        "PEFT adapter folder), at WEIGHT (default 1); repeat for several (their deltas add)")
    p.add_argument("--lora-merge", action="store_true",
                   help="fold the one --lora adapter into the weights at load (float32/bf16 weights only; "
                        "no per-step cost, one adapter for every request)")


def parse_lora_flag(text: str) -> tuple[str, float]:
    """"FILE[:WEIGHT]" -> (FILE, WEIGHT); a FILE whose last ':' is not followed by a number keeps it."""
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            weight = float(tail)
        except ValueError:
            return text, 1.0
        if not math.isfinite(weight):
            raise LoraError(f"--lora {text}: the weight {tail} is not a finite number")
        return path, weight
    return text, 1.0


def lora_problem(args: argparse.Namespace, checkpoint: Path | None = None,
                 prefixes: dict[str, str] | None = None) -> str | None:
    """The first problem of the LoRA flags as one line, or None: each file read and checked,
    and, given the `checkpoint` folder and the model's name map `prefixes`, matched against
    the checkpoint's weights (names and shapes, from the safetensors headers alone) before any
    rank loads."""
    given = args.lora or []
    if args.lora_merge and len(given) != 1:
        return f"--lora-merge folds exactly one --lora adapter into the weights; {len(given)} given"
    if args.lora_merge and getattr(args, "dense_dtype", "model") == "fp8":
        return ("--lora-merge folds the adapter into float32/bf16 weights; --dense-dtype fp8 stores them in FP8 "
                "(apply it unmerged: drop --lora-merge)")
    try:
        adapters = [parse_lora_flag(text) for text in given]
        files = [path for path, _ in adapters]
        twice = sorted({f for f in files if files.count(f) > 1})
        if twice:
            return f"--lora {twice[0]}: given twice (give one --lora FILE:WEIGHT with the summed weight)"
        shapes = _checkpoint_shapes(checkpoint, prefixes) if checkpoint is not None and adapters else None
        for path, _ in adapters:
            lora = read_lora(path)
            if shapes is not None:
                match_keys(lora, prefixes, shapes)
    except LoraError as e:
        text = str(e)
        return text if text.startswith("--lora") else f"--lora: {text}"
    return None


def _checkpoint_shapes(checkpoint: Path, prefixes: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the checkpoint's components that the name map targets (headers only)."""
    components = tuple(sorted({target.split(".", 1)[0] for target in prefixes.values()}))
    reader = ComponentsReader(checkpoint, components)
    try:
        return {key: tuple(reader.info(key).shape) for key in reader.keys()}
    finally:
        reader.close()


def request_loras(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """The request's `loras` the flags say: each file by its name, at its weight (none when merged)."""
    if args.lora_merge or not args.lora:
        return ()
    return tuple(parse_lora_flag(text) for text in args.lora)


def resident_loras(loaded, args: argparse.Namespace, dtype: torch.dtype) -> ResidentLoras | None:
    """The flags' adapters on this rank of `loaded` (`dtgen.build.Built`): loaded unmerged (named
    by their file), or the one folded in with --lora-merge; None without --lora."""
    if not args.lora:
        return None
    loras = ResidentLoras(loaded, dtype)
    try:
        if args.lora_merge:
            path, weight = parse_lora_flag(args.lora[0])
            loras.merge(path, weight)
            return None
        for text in args.lora:
            path, _ = parse_lora_flag(text)
            loras.load(path, Path(path))
    except LoraError as e:
        text = str(e)
        raise LoraError(text if text.startswith("--lora") else f"--lora: {text}") from None
    return loras
