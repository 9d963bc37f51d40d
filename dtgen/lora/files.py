"""Reading LoRA adapter files into plain tensors: what the file says, before any model is involved.

Two layouts are read:
- diffusers' `save_lora_weights` file: one safetensors file whose keys are
  `<component>.<module path>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]; rank and alpha
  come from `__metadata__["lora_adapter_metadata"]` (the PEFT config as JSON, every key prefixed
  with the component, e.g. `transformer.lora_alpha`), with its `rank_pattern` / `alpha_pattern`;
  without that header alpha = r, as diffusers loads it;
- a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`, keys
  `base_model.model.<module path>.lora_A.weight`): module paths with no component prefix.

Other layouts (kohya `lora_unet_*`, `.alpha` tensors, `lora_down`/`lora_up`, ComfyUI's
`diffusion_model.` prefix) are refused in one line naming the layout. Every problem is a
`LoraError` of one line naming the file and what is wrong with it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# PEFT options that change what a layer computes beyond B A x: not read, so refused.
_UNSUPPORTED_OPTIONS = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "use_qalora": "QA-LoRA"}


class LoraError(ValueError):
    """An adapter that cannot be used; the message (one line) says which and why."""


@dataclass(frozen=True)
class LoraLayer:
    """One module's low-rank pair as the file holds it: A [r, in], B [out, r], and alpha."""

    A: torch.Tensor
    B: torch.Tensor
    alpha: float
    rslora: bool = False

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r (alpha / sqrt(r) for rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class LoraFile:
    """An adapter file's layers by module path. `prefixed`: the paths start with the component the
    file was saved for (diffusers' files: `transformer.`); a PEFT folder's paths have none."""

    path: str
    layers: dict[str, LoraLayer]
    prefixed: bool


def _pattern_value(patterns: dict, path: str, default):
    """PEFT's `get_pattern_key`: the first pattern `p` with `(.*\\.)?(p)$` matching the module path."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            return value
    return default


def _open_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or ["?"])[0]
        raise LoraError(f"LoRA {path}: not a safetensors file ({first})") from None


def _refuse_other_layouts(path, keys: list[str]) -> None:
    layouts = (("lora_unet_", "kohya (`lora_unet_*` keys)"), ("lora_te", "kohya (`lora_te*` text-encoder keys)"),
               ("diffusion_model.", "ComfyUI/original (`diffusion_model.` prefix)"))
    for start, layout in layouts:
        if any(k.startswith(start) for k in keys):
            raise LoraError(f"LoRA {path}: the {layout} layout is not read; convert it to diffusers' format "
                            f"(`save_lora_weights`) first")
    if any(k.endswith(".alpha") for k in keys):
        raise LoraError(f"LoRA {path}: per-layer `.alpha` tensors (a kohya-style layout) are not read; convert it "
                        f"to diffusers' format (`save_lora_weights`) first")
    if any(".lora_down." in k or ".lora_up." in k for k in keys):
        raise LoraError(f"LoRA {path}: the `lora_down`/`lora_up` layout is not read; convert it to diffusers' "
                        f"format (`save_lora_weights`) first")


def _layers(path, tensors: dict[str, torch.Tensor], config: dict | None, strip: str = "") -> dict[str, LoraLayer]:
    """Pairs from `tensors`; `config`: the PEFT config (keys without prefix), None for alpha = r."""
    keys = list(tensors)
    _refuse_other_layouts(path, keys)
    other = [k for k in keys if not k.endswith(LORA_SUFFIXES)]
    if other:
        raise LoraError(f"LoRA {path}: {len(other)} key(s) are not `<module>.lora_A.weight`/`.lora_B.weight` "
                        f"(e.g. {other[:3]}): not a LoRA layout this reads")
    if config is not None:
        for option, what in _UNSUPPORTED_OPTIONS.items():
            if config.get(option):
                raise LoraError(f"LoRA {path}: {what} (`{option}`) is not supported")
    paths = sorted({k[:-len(LORA_SUFFIXES[0])] for k in keys})
    layers = {}
    for p in paths:
        a, b = tensors.get(p + LORA_SUFFIXES[0]), tensors.get(p + LORA_SUFFIXES[1])
        if a is None or b is None:
            raise LoraError(f"LoRA {path}: module {p} has only lora_{'B' if a is None else 'A'}")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"LoRA {path}: module {p}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
                            f"[r, in] and [out, r] of one rank r")
        for which, t in (("lora_A", a), ("lora_B", b)):
            if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise LoraError(f"LoRA {path}: {p}.{which} holds NaN or inf (or is not floating point)")
        module = p[len(strip):] if strip and p.startswith(strip) else p
        r = a.shape[0]
        if config is None:
            alpha = float(r)   # diffusers, without the metadata header
            rslora = False
        else:
            want = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", r))
            if want != r:
                raise LoraError(f"LoRA {path}: module {p} has rank {r}, but its config says r={want}")
            alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", r)))
            rslora = bool(config.get("use_rslora"))
        if not math.isfinite(alpha):
            raise LoraError(f"LoRA {path}: module {p} has a non-finite alpha {alpha}")
        layers[module if strip else p] = LoraLayer(a, b, alpha, rslora)
    if not layers:
        raise LoraError(f"LoRA {path}: holds no LoRA tensors")
    return layers


def _diffusers_config(path, metadata: dict[str, str]) -> dict[str, dict] | None:
    """The PEFT config per component from diffusers' header (None: no header, alpha = r)."""
    raw = metadata.get("lora_adapter_metadata")
    if raw is None:
        return None
    try:
        flat = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LoraError(f"LoRA {path}: its `lora_adapter_metadata` header is not JSON ({e})") from None
    per: dict[str, dict] = {}
    for key, value in flat.items():
        component, _, option = key.partition(".")
        per.setdefault(component, {})[option] = value
    return per


def read_lora(path: str | Path) -> LoraFile:
    """A diffusers LoRA file or a PEFT adapter folder -> its layers (`LoraError` on anything else)."""
    path = Path(path)
    if path.is_dir():
        config_file, weights = path / PEFT_CONFIG, path / PEFT_WEIGHTS
        if not config_file.is_file() or not weights.is_file():
            raise LoraError(f"LoRA {path}: a folder must be a PEFT adapter ({PEFT_CONFIG} + {PEFT_WEIGHTS})")
        try:
            config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LoraError(f"LoRA {path}: {PEFT_CONFIG} is not JSON ({e})") from None
        if config.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"LoRA {path}: a {config.get('peft_type')} adapter, not LoRA")
        tensors, _ = _open_safetensors(weights)
        tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}
        return LoraFile(str(path), _layers(path, tensors, config), prefixed=False)
    if not path.is_file():
        raise LoraError(f"LoRA {path}: no such file or folder")
    tensors, metadata = _open_safetensors(path)
    per_component = _diffusers_config(path, metadata)
    if per_component is None:
        return LoraFile(str(path), _layers(path, tensors, None), prefixed=True)
    layers = {}
    for component, config in per_component.items():
        mine = {k: v for k, v in tensors.items() if k.startswith(component + ".")}
        if mine:
            layers.update({f"{component}.{p}": layer
                           for p, layer in _layers(path, mine, config, strip=component + ".").items()})
    rest = {k: v for k, v in tensors.items() if k.split(".", 1)[0] not in per_component}
    if rest:
        layers.update(_layers(path, rest, None))
    return LoraFile(str(path), layers, prefixed=True)
