"""The tiny DiT's default checkpoint: seeded weights in one safetensors file, written once."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from dtgen.caches import cache_root, write_folder_once

from .model import TinyDiT


def ensure_tiny_checkpoint(root: Path | None = None) -> Path:
    """The folder (under `root`, default the dtgen cache), written on first use."""
    def write(folder: Path) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            save_file(TinyDiT().state_dict(), str(folder / "tiny_dit.safetensors"))
    return write_folder_once(Path(root or cache_root()) / "tiny-dit-v2", "tiny_dit.safetensors", write)
