"""Reading official safetensors checkpoints, one slice at a time.

A rank never needs the whole model: it asks for row or column blocks of named tensors and
gets exactly those bytes (`safe_open(...).get_slice`). Every read is counted, so tests can
check that a rank materialized only its own shard. Pickle checkpoints are refused.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# diffusers names its component files this way (transformer/, vae/); text encoders use the above.
DIFFUSERS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_SINGLE_NAME = "diffusion_pytorch_model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message says what and where."""

    one_line = True   # its message is the whole story: spawned ranks' launcher prints it once (dtgen.launch)


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


def _read_header(path: Path) -> dict:
    """Parse a safetensors header and check that the file holds every byte it promises."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated or corrupt safetensors file: header claims {n} bytes, "
                                  f"file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file: tensors need {8 + n + end} bytes, "
                              f"file has {size}")
    return header


def unreadable(folder: str | os.PathLike) -> str | None:
    """The first reason the checkpoint in `folder` cannot be read, as one line naming the file,
    or None; asked before any rank starts or any weight loads. Every JSON file of the folder
    and of its component folders (configs, indexes) must parse, and every folder holding
    safetensors files must read as a checkpoint (headers, sizes, the shards its index lists):
    only headers are read. A folder that does not exist is left to the caller's own check."""
    root = Path(folder)
    if not root.is_dir():
        return None
    for path in [root, *sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))]:
        for config in sorted(path.glob("*.json")):
            try:
                json.loads(config.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return f"{config}: not valid JSON ({e})"
        if any(path.glob("*.safetensors")) or (path / INDEX_NAME).exists() or (path / DIFFUSERS_INDEX_NAME).exists():
            try:
                CheckpointReader(path)
            except CheckpointError as e:
                return str(e)
    return None


class CheckpointReader:
    """Index of a checkpoint folder (sharded with `model.safetensors.index.json`, or one file)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint folder {self.directory} does not exist")
        self.bytes_read = 0
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            for key, meta in _read_header(file).items():
                if meta["dtype"].startswith("F8"):
                    raise CheckpointError(f"{file}: tensor {key} is stored in {meta['dtype']}: FP8 checkpoints are "
                                          f"not loaded as they are; load the bf16 checkpoint with --moe-dtype fp8 "
                                          f"(the experts are quantized at load)")
                if meta["dtype"] not in _SAFETENSORS_DTYPES:
                    raise CheckpointError(f"{file}: tensor {key} has unsupported dtype {meta['dtype']}")
                self.tensors[key] = TensorInfo(file, tuple(meta["shape"]), _SAFETENSORS_DTYPES[meta["dtype"]])
        self._check_index()
        self._handles: dict[Path, object] = {}

    def _files(self) -> list[Path]:
        index = self.directory / INDEX_NAME
        if not index.exists() and (self.directory / DIFFUSERS_INDEX_NAME).exists():
            index = self.directory / DIFFUSERS_INDEX_NAME
        if index.exists():
            try:
                self.index = json.loads(index.read_text())
                weight_map = self.index["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            names = sorted(set(weight_map.values()))
            pickled = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
            if pickled:
                raise CheckpointError(f"{index} points at pickle files {pickled}: pickle checkpoints are refused "
                                      f"(loading them runs arbitrary code); convert them to safetensors")
            missing = [n for n in names if not (self.directory / n).exists()]
            if missing:
                raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
            return [self.directory / n for n in names]
        self.index = None
        for single in (self.directory / SINGLE_NAME, self.directory / DIFFUSERS_SINGLE_NAME):
            if single.exists():
                return [single]
        files = sorted(self.directory.glob("*.safetensors"))
        if len(files) == 1:
            return files
        pickled = sorted(p.name for p in self.directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickled:
            raise CheckpointError(f"{self.directory} holds pickle checkpoint files {pickled}: pickle checkpoints "
                                  f"are refused (loading them runs arbitrary code); convert them to safetensors")
        if not files:
            raise CheckpointError(f"{self.directory} has no {INDEX_NAME} and no .safetensors file")
        raise CheckpointError(f"{self.directory} has {len(files)} .safetensors files but no {INDEX_NAME}")

    def _check_index(self) -> None:
        if self.index is None:
            return
        weight_map = self.index["weight_map"]
        wrong = sorted(k for k, f in weight_map.items()
                       if k not in self.tensors or self.tensors[k].file.name != f)
        if wrong:
            raise CheckpointError(f"{self.directory}: its index maps keys to shards that do not hold them: {wrong[:10]}"
                                  + (f" (+{len(wrong) - 10} more)" if len(wrong) > 10 else ""))

    # ---- reads -----------------------------------------------------------------------
    def keys(self) -> set[str]:
        return set(self.tensors)

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {key!r}") from None

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor `key`, or only [start, stop) along `dim`; reads just those bytes."""
        info = self.info(key)
        piece = self._handle(info.file).get_slice(key)
        if dim is None:
            t = piece[:]
        else:
            dim = dim % len(info.shape)
            index = tuple([slice(None)] * dim + [slice(start, stop)])
            t = piece[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        self._handles.clear()


class ComponentsReader:
    """A diffusers-format checkpoint: one folder per component (`transformer/`, `vae/`,
    `text_encoder/`, ...), read as one checkpoint whose keys carry the component's name as a
    prefix (`transformer.blocks.0.attn1.to_q.weight`). Same interface as `CheckpointReader`."""

    def __init__(self, directory: str | os.PathLike, components: tuple[str, ...]):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint folder {self.directory} does not exist")
        missing = [c for c in components if not (self.directory / c).is_dir()]
        if missing:
            raise CheckpointError(f"{self.directory} is missing the component folder(s) {missing} "
                                  f"(a diffusers-format checkpoint has one folder per component: {list(components)})")
        self.parts = {c: CheckpointReader(self.directory / c) for c in components}

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self.parts.values())

    def _split(self, key: str) -> tuple[CheckpointReader, str]:
        component, _, rest = key.partition(".")
        if component not in self.parts:
            raise CheckpointError(f"checkpoint {self.directory} has no component {component!r} (for {key!r})")
        return self.parts[component], rest

    def keys(self) -> set[str]:
        return {f"{c}.{k}" for c, p in self.parts.items() for k in p.keys()}

    def info(self, key: str) -> TensorInfo:
        part, rest = self._split(key)
        return part.info(rest)

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        part, rest = self._split(key)
        return part.read(rest, dim, start, stop)

    def close(self) -> None:
        for p in self.parts.values():
            p.close()
