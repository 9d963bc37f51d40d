"""LoRA adapters made and loaded the way diffusers + peft do it, for the parity tests (dtgen/lora).

`save_adapter` adds a peft `LoraConfig` adapter with random non-zero B to a diffusers transformer
and writes it with the pipeline class's `save_lora_weights` (the rank/alpha header included);
`diffusers_with` loads such files into a fresh diffusers transformer through the pipeline's own
`lora_state_dict` + `load_lora_into_transformer` (what `load_lora_weights` runs) and sets their
weights."""
from __future__ import annotations

from pathlib import Path

import torch


def diffusers_transformer(cls, folder: Path):
    """A diffusers transformer over a tiny checkpoint's `transformer/` (from_config + state dict)."""
    from safetensors.torch import load_file
    model = cls.from_config(cls.load_config(folder / "transformer"))
    model.load_state_dict(load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    return model.eval()


def save_adapter(pipeline_cls, transformer, folder: Path, *, r: int, alpha: float, targets: list[str], seed: int,
                 rank_pattern: dict | None = None, alpha_pattern: dict | None = None) -> Path:
    """`transformer` (a diffusers model; the adapter is added to it and removed) -> the adapter
    file diffusers writes, with B random (peft's `init_lora_weights=False`) and scaled up so the
    delta is far above the parity tolerances."""
    from peft import LoraConfig, get_peft_model_state_dict
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, rank_pattern=rank_pattern or {},
                        alpha_pattern=alpha_pattern or {}, init_lora_weights=False)
    torch.manual_seed(seed)
    transformer.add_adapter(config, adapter_name="made")
    state = get_peft_model_state_dict(transformer, adapter_name="made")
    transformer.delete_adapters("made")
    folder.mkdir(parents=True, exist_ok=True)
    pipeline_cls.save_lora_weights(folder, transformer_lora_layers=state,
                                   transformer_lora_adapter_metadata=config.to_dict())
    return folder / "pytorch_lora_weights.safetensors"


def diffusers_with(pipeline_cls, transformer, adapters: list[tuple[Path, float]]):
    """`transformer` with `adapters` (file, weight) loaded as diffusers loads them, all active."""
    names = []
    for i, (path, _) in enumerate(adapters):
        state, metadata = pipeline_cls.lora_state_dict(str(path), return_lora_metadata=True)
        pipeline_cls.load_lora_into_transformer(state, transformer=transformer, adapter_name=f"a{i}", metadata=metadata)
        names.append(f"a{i}")
    transformer.set_adapters(names, [w for _, w in adapters])
    return transformer
