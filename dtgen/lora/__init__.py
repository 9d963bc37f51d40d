"""LoRA adapters at inference: reading their files (`files`) and applying them resident,
unmerged and per batch row, on every plan (`resident`)."""
from .files import LoraError, LoraFile, LoraLayer, read_lora
from .resident import ResidentLoras, RowAdapters, pair_specs

__all__ = ["LoraError", "LoraFile", "LoraLayer", "ResidentLoras", "RowAdapters", "pair_specs", "read_lora"]
