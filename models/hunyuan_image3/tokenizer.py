"""Tokenizers and the special-token ids the text-to-image and Instruct (image editing) templates need.

A real checkpoint ships `tokenizer.json` (read through the `tokenizers` package, a dependency).
The embedded tiny default has none: it uses a byte-level tokenizer whose text ids are
byte + 1, with the special ids listed in its config.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import HunyuanImage3Config

NUM_RATIO_TOKENS = 37  # 33 ratios on the base grid + 4 extra resolutions (see pipeline.resolution_table)


@dataclass(frozen=True)
class SpecialTokens:
    bos: int
    eos: int
    boi: int
    eoi: int
    img: int
    cfg: int
    timestep: int
    size: dict[int, int]        # image base size -> `<img_size_N>` id
    ratio: tuple[int, ...]      # `<img_ratio_k>` ids, k = 0..36
    guidance: int | None = None     # `<guidance>` (Instruct-Distil's embedded guidance), if the vocabulary has it
    timestep_r: int | None = None   # `<timestep_r>` (its meanflow end time)

    @classmethod
    def from_lookup(cls, lookup, cfg: HunyuanImage3Config) -> "SpecialTokens":
        def need(name: str) -> int:
            i = lookup(name)
            if i is None:
                raise ValueError(f"the tokenizer has no special token {name!r}")
            return int(i)

        for flag, name in (("cfg_distilled", "<guidance>"), ("use_meanflow", "<timestep_r>")):
            if getattr(cfg, flag) and lookup(name) is None:
                raise ValueError(f"config.json says {flag}: true, but the tokenizer has no {name} token")
        sizes = {}
        for base in (256, 512, 768, 1024, 1280, 1536, 2048, 3072, 4096):
            i = lookup(f"<img_size_{base}>")
            if i is not None:
                sizes[base] = int(i)
        if cfg.image_base_size not in sizes:
            raise ValueError(f"the tokenizer has no <img_size_{cfg.image_base_size}> token for image_base_size "
                             f"{cfg.image_base_size}")
        return cls(bos=cfg.bos_token_id, eos=cfg.eos_token_id, boi=need("<boi>"), eoi=need("<eoi>"),
                   img=cfg.image_token_id, cfg=need("<cfg>"), timestep=need("<timestep>"), size=sizes,
                   ratio=tuple(need(f"<img_ratio_{k}>") for k in range(NUM_RATIO_TOKENS)),
                   guidance=_maybe(lookup("<guidance>")) if cfg.cfg_distilled else None,
                   timestep_r=_maybe(lookup("<timestep_r>")) if cfg.use_meanflow else None)


def _maybe(i) -> int | None:
    return None if i is None else int(i)


INSTRUCT_TOKENS = ("<joint_img_sep>", "<think>", "</think>", "<recaption>", "</recaption>", "<answer>", "</answer>")


@dataclass(frozen=True)
class InstructTokens:
    """The special ids the Instruct template adds to the T2I ones."""

    joint_img_sep: int
    think: int
    end_think: int
    recaption: int
    end_recaption: int
    answer: int
    end_answer: int

    @classmethod
    def find(cls, lookup) -> "InstructTokens | None":
        """The ids, or None when the tokenizer lacks any (a T2I-only checkpoint)."""
        ids = [lookup(name) for name in INSTRUCT_TOKENS]
        return None if any(i is None for i in ids) else cls(*(int(i) for i in ids))



class ByteTokenizer:
    """UTF-8 bytes as ids 1..256 (the embedded tiny default's text vocabulary)."""

    def __init__(self, cfg: HunyuanImage3Config):
        if not cfg.special_token_ids:
            raise ValueError("the byte tokenizer needs the config's special_token_ids")
        if min(cfg.special_token_ids.values()) <= 256:
            raise ValueError("special token ids overlap the byte range 1..256")
        self.special = SpecialTokens.from_lookup(cfg.special_token_ids.get, cfg)
        self.instruct = InstructTokens.find(cfg.special_token_ids.get)

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 1 for i in ids if 1 <= i <= 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """`tokenizer.json` of a released checkpoint, through the `tokenizers` package."""

    def __init__(self, path: Path, cfg: HunyuanImage3Config):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("reading tokenizer.json needs the 'tokenizers' package: "
                              "pip install tokenizers") from None
        self.tok = Tokenizer.from_file(str(path))
        self.special = SpecialTokens.from_lookup(self.tok.token_to_id, cfg)
        self.instruct = InstructTokens.find(self.tok.token_to_id)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def load_tokenizer(checkpoint: str | Path, cfg: HunyuanImage3Config):
    path = Path(checkpoint) / "tokenizer.json"
    if path.exists():
        return HFTokenizer(path, cfg)
    if cfg.special_token_ids:
        return ByteTokenizer(cfg)
    raise FileNotFoundError(f"{checkpoint} has no tokenizer.json and its config lists no special token ids")
