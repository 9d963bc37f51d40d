"""Masked attention that also returns the log-sum-exp of each query row.

    out, lse = attention_lse(q, k, v, mask)

q ``[B, Hq, Sq, D]``, k and v ``[B, Hkv, Sk, D]`` (GQA: ``Hq`` a multiple of ``Hkv``; query
head ``h`` uses KV head ``h // (Hq / Hkv)``), mask ``[Sq, Sk]`` bool, True = may attend (the
sequence-parallel cores build it from slots), or ``[B, Sq, Sk]``: one per batch row (batched
requests of one bucket, each with its own padding keys). Returns ``out [B, Hq, Sq, D]`` in q's dtype, stored
``[B, Sq, Hq, D]`` (``out.transpose(1, 2)`` is contiguous: the efficient kernel's own layout,
and the one callers want back; every impl and the fake agree on it), and
``lse [B, Hq, Sq]`` float32 with ``lse = log sum_k exp(scale * q.k)`` over the allowed keys
(natural log; ``scale`` defaults to ``1/sqrt(D)``). A row with no allowed key returns
``out = 0`` and ``lse = -inf``, so `kernels.lse_merge` gives it weight 0.

Implementations:
- reference (CPU, and any device): float32 scores and softmax in torch, GQA by grouping the
  query heads (no K/V copies);
- "efficient" (CUDA): ``aten._scaled_dot_product_efficient_attention(q, k, v, bias,
  compute_log_sumexp=True, ...)`` with an additive bias (0 / -inf) built from the mask. The
  schema, identical in torch 2.11 and 2.13, is
  ``(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool compute_log_sumexp,
  float dropout_p=0., bool is_causal=False, *, float? scale=None) -> (output, log_sumexp,
  philox_seed, philox_offset)``. The kernel takes no GQA, so K/V heads are repeated first
  (as the model's own masked path does). Its bias must have its row stride aligned (torch's
  SDPA pads the last dim to a multiple of 8 and expands to [B, H, Sq, Sk]; this does the
  same with 16). Its LSE comes back padded to a multiple of 32 rows and is sliced.

Registered as ``dtgen::attention_lse``: one node under ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import math

import torch

IMPLS = ("auto", "reference", "efficient")
_BIAS_ALIGN = 16  # elements; the efficient kernel needs aligned bias rows (torch itself uses 8)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise ValueError naming the tensor and the shapes when the inputs do not fit."""
    if q.dim() != 4:
        raise ValueError(f"attention_lse: q must be [B, Hq, Sq, D], got shape {tuple(q.shape)}")
    B, Hq, Sq, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"attention_lse: k must be [B={B}, Hkv, Sk, D={D}] to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"attention_lse: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"attention_lse: query heads ({Hq}) must be a multiple of KV heads ({k.shape[1]})")
    if tuple(mask.shape) not in ((Sq, k.shape[2]), (B, Sq, k.shape[2])) or mask.dtype != torch.bool:
        raise ValueError(f"attention_lse: mask must be bool [Sq, Sk] = {(Sq, k.shape[2])} or [B, Sq, Sk] = "
                         f"{(B, Sq, k.shape[2])}, got {mask.dtype} {tuple(mask.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention_lse: dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if len({t.device for t in (q, k, v, mask)}) != 1:
        raise ValueError("attention_lse: q, k, v and mask must be on one device")


# --------------------------------------------------------------------------- references


def attention_lse_naive(q, k, v, mask, scale: float | None = None):
    """Ground truth for tests: float64, one query head at a time, K/V head h // group."""
    B, Hq, Sq, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Hq, Sq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        row_mask = mask[b] if mask.dim() == 3 else mask
        for h in range(Hq):
            s = scale * q[b, h].double() @ k[b, h // group].double().T
            for i in range(Sq):
                keys = row_mask[i].nonzero().flatten()
                if keys.numel() == 0:
                    continue
                lse[b, h, i] = torch.logsumexp(s[i, keys], 0)
                out[b, h, i] = torch.softmax(s[i, keys], 0) @ v[b, h // group, keys].double()
    return out, lse


def attention_lse_reference(q, k, v, mask, scale: float | None = None):
    """float32 scores and softmax; GQA by viewing query heads as [Hkv, group]."""
    check_attention_inputs(q, k, v, mask)
    B, Hq, Sq, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.float().reshape(B, Hkv, Hq // Hkv, Sq, D)
    scores = scale * (qg @ k.float().unsqueeze(2).transpose(-1, -2))      # [B, Hkv, g, Sq, Sk]
    scores = scores.masked_fill(~(mask[:, None, None] if mask.dim() == 3 else mask), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                 # -inf on empty rows
    live = lse != float("-inf")
    probs = torch.exp(scores - torch.where(live, lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = probs @ v.float().unsqueeze(2)                                  # empty rows: exp(-inf) = 0
    return _sequence_major(B, Hq, Sq, D, q).copy_(out.reshape(B, Hq, Sq, D)), lse.reshape(B, Hq, Sq)


def _sequence_major(B: int, H: int, S: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """An empty [B, H, S, D] tensor stored [B, S, H, D]: the op's output layout."""
    return like.new_empty(B, S, H, D).transpose(1, 2)


# --------------------------------------------------------------------------------- CUDA


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias [Sq, Sk] (or [B, Sq, Sk]; 0 allowed, -inf masked) in row-aligned storage
    (a sliced view)."""
    Sk = mask.shape[-1]
    padded = -(-Sk // _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.full((*mask.shape[:-1], padded), float("-inf"), dtype=dtype, device=mask.device)
    bias[..., :Sk].masked_fill_(mask, 0.0)
    return bias[..., :Sk]


def attention_lse_efficient(q, k, v, mask, scale: float | None = None):
    """The CUDA path (module docstring)."""
    check_attention_inputs(q, k, v, mask)
    B, Hq, Sq, D = q.shape
    if k.shape[2] == 0 or Sq == 0:
        return (_sequence_major(B, Hq, Sq, D, q).zero_(),
                torch.full((B, Hq, Sq), float("-inf"), dtype=torch.float32, device=q.device))
    group = Hq // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    bias = mask_to_bias(mask, q.dtype)
    bias = (bias.unsqueeze(1) if bias.dim() == 3 else bias).expand(B, Hq, Sq, k.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, False, scale=scale)[:2]
    if not out.transpose(1, 2).is_contiguous():   # the kernel writes [B, Sq, H, D]; keep the contract if not
        out = _sequence_major(B, Hq, Sq, D, q).copy_(out)
    # Rows with no allowed key: the kernel's convention (0 since torch #131863) made explicit,
    # in place on the kernel's fresh output. The LSE comes padded to 32 rows: where() copies
    # the slice into a new contiguous [B, Hq, Sq].
    dead = ~mask.any(dim=-1)                                  # [Sq], or [B, Sq]
    if dead.dim() == 2:
        dead = dead[:, None]                                  # [B, 1, Sq]: every head
    out.masked_fill_(dead[..., None], 0.0)
    lse = torch.where(dead, torch.full((), float("-inf"), device=lse.device), lse[:, :, :Sq].float())
    return out, lse


# ----------------------------------------------------------------------- op and public API


@torch.library.custom_op("dtgen::attention_lse", mutates_args=())
def _attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float | None, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "reference" or (impl == "auto" and not q.is_cuda):
        return attention_lse_reference(q, k, v, mask, scale)
    return attention_lse_efficient(q, k, v, mask, scale)


@_attention_lse_op.register_fake
def _(q, k, v, mask, scale, impl):
    B, Hq, Sq, D = q.shape
    return _sequence_major(B, Hq, Sq, D, q), q.new_empty((B, Hq, Sq), dtype=torch.float32)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float | None = None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GQA attention returning (out, lse) (module docstring).

    impl: "auto" (CPU: reference, CUDA: efficient), "reference", "efficient" (CUDA only).
    """
    if impl not in IMPLS:
        raise ValueError(f"attention_lse: impl must be one of {IMPLS}, got {impl!r}")
    check_attention_inputs(q, k, v, mask)
    if impl == "efficient" and not q.is_cuda:
        raise RuntimeError(f"attention_lse: impl='efficient' needs CUDA tensors, got {q.device}")
    return torch.ops.dtgen.attention_lse(q, k, v, mask, scale, impl)
