"""The Instruct sequence template of HunyuanImage-3.0: edit a reference image from a prompt (TI2I).

One reference image becomes one condition section, placed in the user turn before the prompt:

    <boi> <img_size_B> <img_ratio_k> <timestep> <img> x h*w (VAE) <joint_img_sep> <img> x L (ViT) <eoi>

The AR prompt ("think" stage):

    <bos> [system "\\n\\n"] "User: " <condition> prompt "\\n\\nAssistant: " <think>

The diffusion sequence:

    <bos> [system "\\n\\n"] "User: " <condition> prompt "\\n\\nAssistant: " CoT
    <answer> <boi> <img_size_B> <img_ratio_k> <timestep> <img> x h*w <eoi> </answer> "\\n\\n"

Its unconditional CFG row keeps the condition image, the system prompt, the role text and
every special token; only the prompt's ids and the CoT's non-special ids become <cfg>, one
for one (so an editing model's guidance pushes along the text alone).

The VAE half is one bidirectional block, the ViT half (all L rows, padding rows included)
another; each gets the 2-D RoPE of an image block, the ViT block over its patch grid only
(its padding rows continue as text). The layout rules are `../shared/golden-ti2i`'s README.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .rope import image_rope_positions
from .tokenizer import INSTRUCT_TOKENS, InstructTokens, SpecialTokens

SYSTEM_SEPARATOR = "\n\n"
USER_PREFIX = "User: "
ASSISTANT_PREFIX = "\n\nAssistant: "
ANSWER_SUFFIX = "\n\n"
@dataclass(frozen=True)
class ConditionShape:
    """The sizes of one reference image's condition: the VAE latent grid and its bucket, the
    ViT patch grid and its padded row count."""

    ratio: int          # the VAE bucket's index in the resolution table (its <img_ratio_k>)
    vae_h: int          # latent grid
    vae_w: int
    vit_rows: int       # patch grid (spatial_shapes)
    vit_cols: int
    vit_length: int     # rows in the sequence: the grid padded to max_num_patches

    def __post_init__(self):
        if self.vit_rows * self.vit_cols > self.vit_length:
            raise ValueError(f"ViT grid {self.vit_rows}x{self.vit_cols} does not fit in {self.vit_length} rows")


@dataclass(frozen=True)
class ConditionLayout:
    """Where a condition section sits in one sequence (slot indices)."""

    shape: ConditionShape
    timestep_slot: int
    vae_start: int
    vit_start: int

    @property
    def vae_slots(self) -> tuple[int, int]:
        return self.vae_start, self.vae_start + self.shape.vae_h * self.shape.vae_w

    @property
    def vit_slots(self) -> tuple[int, int]:
        return self.vit_start, self.vit_start + self.shape.vit_length

    @property
    def blocks(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two bidirectional blocks ("full" condition attention: VAE and ViT apart)."""
        return self.vae_slots, self.vit_slots

    def apply_rope(self, pos: torch.Tensor) -> torch.Tensor:
        """pos [S, 2] (text positions (p, p)) with the two image blocks' 2-D positions written in."""
        s = self.shape
        pos = pos.clone()
        v0, v1 = self.vae_slots
        pos[v0:v1] = image_rope_positions(v0, s.vae_h, s.vae_w)
        grid = s.vit_rows * s.vit_cols
        pos[self.vit_start:self.vit_start + grid] = image_rope_positions(self.vit_start, s.vit_rows, s.vit_cols)
        return pos


@dataclass(frozen=True)
class ConditionTokens:
    """A condition as the decoder reads it: the embeddings of its rows, computed once per
    request and kept across the AR -> denoise switch (replicated on every rank, [1, n, H])."""

    layout_shape: ConditionShape
    timestep: torch.Tensor   # [1, 1, H]: timestep_emb(0), the condition is clean
    vae: torch.Tensor        # [1, h*w, H]: patch_embed(latent, time_embed(0))
    vit: torch.Tensor        # [1, L, H]: the aligned ViT rows, padding rows included
    latent: torch.Tensor | None = None  # [1, C, h, w]: the VAE sample the `vae` rows embed (for checks)

    def splices(self, layout: ConditionLayout) -> list[tuple[int, torch.Tensor]]:
        """(first slot, rows) pieces that overwrite the token embeddings, in slot order."""
        return [(layout.timestep_slot, self.timestep), (layout.vae_start, self.vae), (layout.vit_start, self.vit)]


def splice_rows(embeds: torch.Tensor, pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """embeds [B, S, H] with rows [start, start + n) replaced by each piece [1 or B, n, H]
    (pieces in slot order, not overlapping). Static slices and one cat: no in-place write
    into a tensor a compiled graph also reads."""
    parts, at = [], 0
    for start, rows in pieces:
        parts += [embeds[:, at:start], rows.to(embeds.dtype).expand(embeds.shape[0], -1, -1)]
        at = start + rows.shape[1]
    parts.append(embeds[:, at:])
    return torch.cat(parts, dim=1)


def _condition_ids(special: SpecialTokens, extra: InstructTokens, base: int, shape: ConditionShape) -> list[int]:
    return ([special.boi, special.size[base], special.ratio[shape.ratio], special.timestep]
            + [special.img] * (shape.vae_h * shape.vae_w) + [extra.joint_img_sep]
            + [special.img] * shape.vit_length + [special.eoi])


@dataclass(frozen=True)
class InstructPrefix:
    """<bos> ... "Assistant: ": the part the AR prompt and the diffusion sequence share."""

    ids: list[int]
    uncond_ids: list[int]
    condition: ConditionLayout


def instruct_prefix(encode, special: SpecialTokens, extra: InstructTokens, base: int, shape: ConditionShape,
                    prompt_ids: list[int], system_prompt: str = "") -> InstructPrefix:
    """`encode`: the tokenizer's text -> ids. The prompt's ids become <cfg> in the uncond row."""
    head = [special.bos] + encode((system_prompt + SYSTEM_SEPARATOR if system_prompt else "") + USER_PREFIX)
    cond_at = len(head)
    section = _condition_ids(special, extra, base, shape)
    assistant = encode(ASSISTANT_PREFIX)
    ids = head + section + list(prompt_ids) + assistant
    uncond = head + section + [special.cfg] * len(prompt_ids) + assistant
    layout = ConditionLayout(shape, timestep_slot=cond_at + 3, vae_start=cond_at + 4,
                             vit_start=cond_at + 4 + shape.vae_h * shape.vae_w + 1)
    return InstructPrefix(ids, uncond, layout)


def cot_uncond(cot_ids: list[int], special_ids: set[int], cfg_id: int) -> list[int]:
    """The CoT in the uncond row: its text ids become <cfg>, its special tokens stay."""
    return [i if i in special_ids else cfg_id for i in cot_ids]


class PromptCondition(NamedTuple):
    """What an AR prefill with a reference image adds to a plain one: the condition rows to
    splice in, the RoPE positions of the prefill rows, and the bidirectional blocks."""

    pieces: list[tuple[int, torch.Tensor]]
    rope_pos: torch.Tensor                  # [rows, 2], on the device
    blocks: tuple[tuple[int, int], ...]


def prompt_condition(layout: ConditionLayout, tokens: ConditionTokens, rows: int,
                     device: torch.device) -> PromptCondition:
    """For a prefill of `rows` rows at slots 0..rows-1 (built on the host, once per request)."""
    rope = layout.apply_rope(torch.arange(rows).unsqueeze(-1).repeat(1, 2))
    return PromptCondition(tokens.splices(layout), rope.to(device), layout.blocks)


def special_ids(special: SpecialTokens, extra: InstructTokens) -> set[int]:
    """Every special id the two templates write (kept in the uncond row)."""
    ids = {special.bos, special.eos, special.boi, special.eoi, special.img, special.cfg, special.timestep,
           *special.size.values(), *special.ratio}
    return ids | set(vars(extra).values())


def encode_with_specials(encode, text: str, extra: InstructTokens) -> list[int]:
    """Text that may hold the Instruct template's tags (`<recaption>`, `</think>`, ...): the tags
    become their special ids (matched first, as the official tokenizer does), the rest is text."""
    tags = dict(zip(INSTRUCT_TOKENS, vars(extra).values()))
    ids = []
    for piece in re.split("(" + "|".join(re.escape(t) for t in tags) + ")", text):
        if piece in tags:
            ids.append(tags[piece])
        elif piece:
            ids += encode(piece)
    return ids
