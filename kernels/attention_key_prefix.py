"""Attention over a key prefix whose length is data, not shape.

    out = attention_key_prefix(q, k, v, valid)

q ``[B, Hq, Sq, D]``, k and v ``[B, Hkv, Sk, D]`` (GQA: ``Hq`` a multiple of ``Hkv``), ``valid``
an int tensor with ``1 <= valid <= Sk``, one element (the same count for every batch row) or
``[B]`` (one per batch row: batched requests of one bucket, each with its own padding): every
query attends to keys ``[0, valid)``, no causal order. Returns ``out [B, Hq, Sq, D]`` in q's
dtype (softmax scale ``1/sqrt(D)``).

Why: a prompt padded to its bucket leaves padding keys inside the sequence (a `SlotHole`,
dtgen/sequence.py). Rows that see every other key (an image block) can have the hole moved
to the end of their keys (order does not matter to attention without a causal mask), and
then they see a prefix whose length moves with the prompt. As a tensor that length keeps one
compiled graph for every prompt of the bucket; a slice would make it a new shape.

Implementations:
- reference (any device and dtype): SDPA with a key mask ``[1, Sk]``;
- "flash" (CUDA, fp16/bf16): ``aten._flash_attention_forward`` in its variable-length form,
  whose schema is the same in torch 2.11 and 2.13 up to ``seqused_k``: q, k, v flattened to
  ``[B*S, H, D]``, ``cum_seq_q`` / ``cum_seq_k`` at fixed strides (Sq, Sk), and
  ``seqused_k = valid`` per sequence. FlashAttention-2 reads the key count on the device: no
  mask, no host sync, and GQA without copying K/V.

Measured on one H200 (a denoise layer at TP2 x SP2 with a hole,
bench/results/h200x2-2026-11-30-regions/bench_layers_hole_flash.json): the
flash path took the layer from 2.85 ms (no hole) to 7.84 ms, where the masked kernel gives
3.99 ms; so "auto" takes the reference (SDPA's memory-efficient kernel with a broadcast key
mask) until the flash path is understood.

Registered as ``dtgen::attention_key_prefix``: one node under ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLS = ("auto", "reference", "flash")


def check_key_prefix_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
    """Raise ValueError naming the tensor and the shapes when the inputs do not fit."""
    if q.dim() != 4 or k.dim() != 4 or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"attention_key_prefix: q [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D] expected, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"attention_key_prefix: k {tuple(k.shape)} does not fit q {tuple(q.shape)} (batch, "
                         "head_dim, or query heads not a multiple of KV heads)")
    if valid.dtype not in (torch.int32, torch.int64) or not (
            valid.numel() == 1 or (valid.dim() == 1 and valid.shape[0] == q.shape[0])):
        raise ValueError(f"attention_key_prefix: valid must be one int32/int64 element or one per batch row "
                         f"[{q.shape[0]}], got {valid.dtype} {tuple(valid.shape)}")


def attention_key_prefix_reference(q, k, v, valid):
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # [B or 1, 1, 1, Sk]: each batch row's prefix
    mask = (torch.arange(k.shape[2], device=q.device) < valid.reshape(-1, 1, 1, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_key_prefix_flash(q, k, v, valid):
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    dev = q.device
    flat_q = q.transpose(1, 2).reshape(B * Sq, Hq, D)
    flat_k = k.transpose(1, 2).reshape(B * Sk, k.shape[1], D)
    flat_v = v.transpose(1, 2).reshape(B * Sk, v.shape[1], D)
    rows = torch.arange(B + 1, device=dev, dtype=torch.int32)
    used = valid.reshape(-1).to(torch.int32).expand(B).contiguous()
    out = torch.ops.aten._flash_attention_forward(
        flat_q, flat_k, flat_v, rows * Sq, rows * Sk, Sq, Sk, 0.0, False, False, seqused_k=used)[0]
    return out.view(B, Sq, Hq, D).transpose(1, 2)


@torch.library.custom_op("dtgen::attention_key_prefix", mutates_args=())
def _attention_key_prefix_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                             impl: str) -> torch.Tensor:
    if impl == "flash":
        return attention_key_prefix_flash(q, k, v, valid).contiguous()
    return attention_key_prefix_reference(q, k, v, valid).contiguous()


@_attention_key_prefix_op.register_fake
def _(q, k, v, valid, impl):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention_key_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                         impl: str = "auto") -> torch.Tensor:
    """Every query attends to keys [0, valid) (module docstring).

    impl: "auto" (the reference, SDPA with a key mask, on every device: see the module
    docstring for why not flash), "reference", "flash".
    """
    if impl not in IMPLS:
        raise ValueError(f"attention_key_prefix: impl must be one of {IMPLS}, got {impl!r}")
    check_key_prefix_inputs(q, k, v, valid)
    if impl == "flash" and not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        raise RuntimeError(f"attention_key_prefix: impl='flash' needs CUDA fp16/bf16 tensors, got "
                           f"{q.device} {q.dtype}")
    return torch.ops.dtgen.attention_key_prefix(q, k, v, valid, impl)
