"""HunyuanImage-3's diffusion sequence: the text, the image head and the image, as the denoiser reads them.

The pretrain (text-to-image) template and the Instruct one (image editing), with their CFG
rows, RoPE positions, the bucket padding hidden from every query, and an edit's condition
section. Pure: ids, positions and slots, no model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dtgen.buckets import pad_rows
from dtgen.sequence import SlotHole

from .instruct import ANSWER_SUFFIX, ConditionLayout, InstructPrefix, cot_uncond, special_ids
from .rope import image_rope_positions
from .tokenizer import InstructTokens, SpecialTokens


@dataclass(frozen=True)
class DiffusionSequence:
    """The pretrain template: <bos> text <boi><img_size><img_ratio_k><timestep> <img>*h*w <eoi>.

    Bucketed (`build_diffusion_sequence(bucket=...)`), padding rows follow the text, so that
    the image head and the image sit at the same slots for every text length of a bucket;
    `hole` hides them from every query, and the RoPE positions skip them: the model sees the
    official sequence.
    """

    cond_ids: torch.Tensor       # [S], S counting padding rows
    uncond_ids: torch.Tensor     # [S], prompt and CoT ids replaced by <cfg>
    rope_pos: torch.Tensor       # [S, 2] (y, x)
    timestep_slot: int           # <timestep>; a distilled checkpoint's <guidance>, <timestep_r> follow it
    image_start: int
    height: int                  # latent grid
    width: int
    pad: int = 0                 # padding rows after the text (host only: no graph reads it)
    hole: SlotHole | None = None  # where they sit; None when not bucketed
    condition: ConditionLayout | None = None  # a reference image's section (image editing)

    @property
    def length(self) -> int:
        return self.cond_ids.shape[0]

    @property
    def real_length(self) -> int:
        """Rows of the official sequence (padding left out)."""
        return self.length - self.pad

    @property
    def image_slots(self) -> tuple[int, int]:
        return self.image_start, self.image_start + self.height * self.width

    @property
    def step_rows(self) -> int:
        """Rows between <timestep> and the image that carry the step (1, or 3 on a distilled
        checkpoint): with the image, the rows every KV-cached step feeds."""
        return self.image_start - self.timestep_slot

    @property
    def attention_blocks(self) -> tuple[tuple[int, int], ...]:
        """Every bidirectional block, in slot order: the condition's (if any), then the image."""
        return (self.condition.blocks if self.condition else ()) + (self.image_slots,)


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple` (bucket and cache lengths)."""
    return -(-n // multiple) * multiple


def build_diffusion_sequence(text_ids: list[int], special: SpecialTokens, base: int, ratio: int,
                             h: int, w: int, bucket: int = 0) -> DiffusionSequence:
    """The pretrain (T2I) template. `text_ids` = prompt (+ CoT) without <bos>. `bucket` > 0:
    <bos> + text pad to a multiple of that many rows (see `DiffusionSequence`), so that every
    text length of a bucket gives the same shapes and slots, and so the same compiled graphs."""
    return assemble_diffusion_sequence([special.bos] + list(text_ids), [special.bos] + [special.cfg] * len(text_ids),
                                       [special.boi, special.size[base], special.ratio[ratio]] + step_token_ids(special),
                                       [special.eoi], special, h, w, bucket)


def step_token_ids(special: SpecialTokens) -> list[int]:
    """<timestep>, then (Instruct-Distil) <guidance> and <timestep_r>: the rows right before
    the image that carry the step's t, guidance and end time."""
    return [special.timestep] + [i for i in (special.guidance, special.timestep_r) if i is not None]


def assemble_diffusion_sequence(head: list[int], uncond_head: list[int], image_head: list[int], post: list[int],
                                special: SpecialTokens, h: int, w: int, bucket: int = 0,
                                condition: ConditionLayout | None = None) -> DiffusionSequence:
    """head (the text; `uncond_head` its CFG row, same length) [padding] image_head (ends with
    the step tokens: `step_token_ids`) <img> x h*w post. Padding rows go between the head and the image head, so the
    image keeps its slots for every head length of a bucket. `condition` lies inside the head."""
    if len(uncond_head) != len(head):
        raise ValueError(f"the uncond row's text has {len(uncond_head)} ids, the cond row's {len(head)}")
    pad = pad_rows(len(head), bucket) - len(head)
    image_start = len(head) + pad + len(image_head)
    image = [special.img] * (h * w) + list(post)
    ids = head + [special.eos] * pad + image_head + image
    uncond = uncond_head + [special.cfg] * pad + image_head + image
    S = len(ids)
    # Positions of the official sequence: the rows after the padding move back over it
    # (the padding rows keep their slot as position: nothing reads what they compute).
    official = torch.arange(S) - torch.where(torch.arange(S) >= len(head) + pad, pad, 0)
    pos = official.unsqueeze(-1).repeat(1, 2)
    pos[image_start:image_start + h * w] = image_rope_positions(image_start - pad, h, w)
    if condition is not None:
        pos = condition.apply_rope(pos)
    hole = SlotHole(torch.tensor(len(head)), len(head) + pad) if bucket else None
    timestep_slot = len(head) + pad + image_head.index(special.timestep)
    return DiffusionSequence(torch.tensor(ids), torch.tensor(uncond), pos, timestep_slot, image_start, h, w,
                             pad, hole, condition)


def build_instruct_diffusion_sequence(prefix: InstructPrefix, cot_ids: list[int], encode, special: SpecialTokens,
                                      extra: InstructTokens, base: int, ratio: int, h: int, w: int,
                                      bucket: int = 0) -> DiffusionSequence:
    """The diffusion sequence of an edit: `prefix` (through "Assistant: ") + CoT, then
    <answer> and the image, then </answer> "\n\n". Bucket padding goes before <answer>."""
    head = prefix.ids + list(cot_ids)
    uncond = prefix.uncond_ids + cot_uncond(list(cot_ids), special_ids(special, extra), special.cfg)
    image_head = [extra.answer, special.boi, special.size[base], special.ratio[ratio]] + step_token_ids(special)
    post = [special.eoi, extra.end_answer] + encode(ANSWER_SUFFIX)
    return assemble_diffusion_sequence(head, uncond, image_head, post, special, h, w, bucket, prefix.condition)


def diffusion_mask(seq: DiffusionSequence) -> torch.Tensor:
    """Dense [S, S] mask (for inspection and tests; the model builds it from slots)."""
    from dtgen.attention import structured_mask
    slots = torch.arange(seq.length)
    return structured_mask(slots, slots, seq.attention_blocks)

