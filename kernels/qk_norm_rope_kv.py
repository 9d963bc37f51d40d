"""The attention prologue as one op: split the fused QKV rows, RoPE, QK RMSNorm, KV-cache write.

    q = qk_norm_rope_kv(qkv, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots, group)

qkv ``[B, S, Hkv * (G + 2) * D]``: the fused projection's output in HunyuanImage-3's row
layout (per KV group: G query heads, then K, then V). cos, sin ``[S, D]`` or ``[B, S, D]``
float32 (rotate-half tables: dim d pairs with d + D/2; 2-D positions are already in them).
q_weight, k_weight ``[D]`` (the per-head RMSNorm weights) or None for a model without QK
norm. k_cache, v_cache ``[B, Hkv, L, D]``; slots ``[S]`` (every batch row writes the same
slots: a prefill) or ``[B, S]`` (each row its own: a batched decode step, S = 1) int64.

In the model's order (`models/hunyuan_image3/transformer.py`), each step rounded to the
input dtype where the model rounds:

    q, k, v = split(qkv)
    q, k = rope(q), rope(k)            float32 math, rounded to qkv's dtype
    q, k = rmsnorm(q), rmsnorm(k)      x * rsqrt(mean(x^2) + eps) in float32, rounded, then * weight
    k_cache[b, :, slots[b, s]] = k;  v_cache[b, :, slots[b, s]] = v      (cast to the cache's dtype)

Returns q ``[B, S, Hkv * G, D]`` (query head h * G + j: the model's order), in the dtype of
``weight * x`` (qkv's dtype for same-dtype weights). What attention needs besides q is in
the cache.

CPU runs the torch reference; CUDA runs one Triton kernel, a program per (block of rows, KV
group): one row a program at decode-sized launches, several consecutive rows at prefill (8
at group 4, head dim 128; `prologue_launch_config` picks the count from the shape). Each row
keeps its own b, s, cos/sin row and slot; only the order of the norm's sum follows the tile
(a last-bit difference between launch shapes).
``impl="triton"`` forces the kernel (on CPU only under TRITON_INTERPRET=1). Slots are a
tensor, so a CUDA graph replays it at moving positions. Registered as
``dtgen::qk_norm_rope_kv`` (mutates the caches): one node under ``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import JITFunction

IMPLS = ("auto", "reference", "triton")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _shape_is(t: torch.Tensor, *dims) -> bool:
    """t's shape equals dims, dim by dim (symbolic sizes under torch.compile compare too;
    tuple equality does not match a symbolic size against a static one)."""
    return t.dim() == len(dims) and all(a == b for a, b in zip(t.shape, dims))


# ------------------------------------------------------------------------------ checks


def check_prologue_inputs(qkv, cos, sin, q_weight, k_weight, k_cache, v_cache, slots, group: int) -> None:
    """Raise ValueError naming the tensor and the shapes when the inputs do not fit."""
    if qkv.dim() != 3:
        raise ValueError(f"qk_norm_rope_kv: qkv must be [B, S, Hkv * (G + 2) * D], got shape {tuple(qkv.shape)}")
    B, S, W = qkv.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B:
        raise ValueError(f"qk_norm_rope_kv: k_cache must be [B={B}, Hkv, L, D], got {tuple(k_cache.shape)}")
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    if group < 1 or W != Hkv * (group + 2) * D:
        raise ValueError(f"qk_norm_rope_kv: qkv's last dim {W} must be Hkv * (G + 2) * D = {Hkv} * ({group} + 2) * {D}"
                         f" for the cache's {Hkv} KV heads of dim {D}")
    if D % 2:
        raise ValueError(f"qk_norm_rope_kv: head dim must be even for rotate-half RoPE, got {D}")
    if not _shape_is(v_cache, *k_cache.shape) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"qk_norm_rope_kv: v_cache must match k_cache {k_cache.dtype} {tuple(k_cache.shape)}, "
                         f"got {v_cache.dtype} {tuple(v_cache.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not (_shape_is(t, S, D) or _shape_is(t, B, S, D)) or t.dtype != torch.float32:
            raise ValueError(f"qk_norm_rope_kv: {name} must be float32 [S, D] = {(S, D)} or [B, S, D], "
                             f"got {t.dtype} {tuple(t.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope_kv: give both q_weight and k_weight, or neither (no QK norm)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and not _shape_is(w, D):
            raise ValueError(f"qk_norm_rope_kv: {name} must be [D={D}], got {tuple(w.shape)}")
    if not (_shape_is(slots, S) or _shape_is(slots, B, S)) or slots.dtype != torch.int64:
        raise ValueError(f"qk_norm_rope_kv: slots must be int64 [S={S}] or [B, S] = {(B, S)}, "
                         f"got {slots.dtype} {tuple(slots.shape)}")
    if qkv.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"qk_norm_rope_kv: qkv dtype must be one of {_FLOAT_DTYPES}, got {qkv.dtype}")
    devices = {t.device for t in (qkv, cos, sin, k_cache, v_cache, slots, q_weight, k_weight) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"qk_norm_rope_kv: every tensor must be on one device, got {sorted(map(str, devices))}")


# ---------------------------------------------------------------------------- reference


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, D], cos/sin [B or 1, S, D]: the model's apply_rope (float32, rounded back)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm: variance in float32, rounded to x's dtype before the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def split_qkv(qkv: torch.Tensor, group: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, S, Hkv * (G + 2) * D] -> q [B, S, Hkv * G, D], k and v [B, S, Hkv, D] (views)."""
    B, S, _ = qkv.shape
    grouped = qkv.view(B, S, -1, group + 2, head_dim)
    return grouped[:, :, :, :group].reshape(B, S, -1, head_dim), grouped[:, :, :, group], grouped[:, :, :, group + 1]


def qk_norm_rope_kv_reference(qkv, cos, sin, q_weight, k_weight, eps: float, k_cache, v_cache, slots,
                              group: int) -> torch.Tensor:
    """The separate torch ops, in the model's order (writes the caches; returns q)."""
    B, S, _ = qkv.shape
    q, k, v = split_qkv(qkv, group, k_cache.shape[3])
    cos = cos if cos.dim() == 3 else cos.unsqueeze(0)
    sin = sin if sin.dim() == 3 else sin.unsqueeze(0)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if q_weight is not None:
        q, k = _rms_norm(q, q_weight, eps), _rms_norm(k, k_weight, eps)
    rows = torch.arange(B, device=qkv.device)[:, None].expand(B, S)
    cols = slots.expand(B, S)
    # [B, S, Hkv, D] into cache[b, :, slot]: advanced indices (b, slot) around the head slice.
    k_cache[rows, :, cols] = k.to(k_cache.dtype)
    v_cache[rows, :, cols] = v.to(v_cache.dtype)
    return q.contiguous()


# ------------------------------------------------------------------------------ Triton


@triton.jit
def _rope_norm(x1, x2, c1, c2, s1, s2, w1, w2, inv_d, eps, half_ok, HAS_NORM: tl.constexpr):
    """Rotate-half RoPE then RMSNorm over the two halves [..., HALF] of rows; each step rounded
    to the input dtype as the model rounds. Returns the halves in float32 (the weight applied)."""
    dt = x1.dtype
    xf1 = x1.to(tl.float32)
    xf2 = x2.to(tl.float32)
    r1 = (xf1 * c1 - xf2 * s1).to(dt).to(tl.float32)
    r2 = (xf2 * c2 + xf1 * s2).to(dt).to(tl.float32)
    if HAS_NORM:
        sq = tl.where(half_ok, r1 * r1, 0.0) + tl.where(half_ok, r2 * r2, 0.0)
        inv = tl.rsqrt(tl.sum(sq, axis=-1, keep_dims=True) * inv_d + eps)
        r1 = (r1 * inv).to(dt).to(tl.float32) * w1
        r2 = (r2 * inv).to(dt).to(tl.float32) * w2
    return r1, r2


@triton.jit
def _prologue_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, q_out_ptr,
    n_rows, seq, eps, inv_d,
    s_xb, s_xs, s_cb, s_cs, s_slb, s_sls, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_qb, s_qs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Program (rows r0 .. r0 + BLOCK_S - 1 of the B * S rows, KV group h): for each row its
    G query heads, one K head and one V head. Tiles: q [BLOCK_S, BLOCK_G, BLOCK_HALF] x 2
    halves, k [BLOCK_S, BLOCK_HALF] x 2, v [BLOCK_S, BLOCK_D]; rows past B * S masked. Each
    row has its own b, s, cos/sin row and slot; the RMSNorm sums run over one (row, head)."""
    kv_head = tl.program_id(1)
    row = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)             # [BLOCK_S] int32
    row_ok = row < n_rows
    # Per-row bases in int64 (a cache or a long batch passes 2^31 elements); in-row offsets int32.
    b = (row // seq).to(tl.int64)
    s = (row % seq).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    half_ok = j < HALF
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    # cos/sin [BLOCK_S, HALF] x 2: loaded once per row for every head of the group.
    cs_row = (b * s_cb + s * s_cs)[:, None]
    cs_mask = row_ok[:, None] & half_ok[None, :]
    c1 = tl.load(cos_ptr + cs_row + j[None, :], mask=cs_mask, other=0.0)
    c2 = tl.load(cos_ptr + cs_row + HALF + j[None, :], mask=cs_mask, other=0.0)
    s1 = tl.load(sin_ptr + cs_row + j[None, :], mask=cs_mask, other=0.0)
    s2 = tl.load(sin_ptr + cs_row + HALF + j[None, :], mask=cs_mask, other=0.0)
    if HAS_NORM:
        qw1 = tl.load(qw_ptr + j, mask=half_ok, other=0.0).to(tl.float32)
        qw2 = tl.load(qw_ptr + HALF + j, mask=half_ok, other=0.0).to(tl.float32)
        kw1 = tl.load(kw_ptr + j, mask=half_ok, other=0.0).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + j, mask=half_ok, other=0.0).to(tl.float32)
        qw1 = qw1[None, None, :]
        qw2 = qw2[None, None, :]
        kw1 = kw1[None, :]
        kw2 = kw2[None, :]
    else:
        qw1 = 1.0
        qw2 = 1.0
        kw1 = 1.0
        kw2 = 1.0
    group_ptr = qkv_ptr + (b * s_xb + s * s_xs + kv_head * ((GROUP + 2) * HEAD_DIM))   # [BLOCK_S] pointers
    # Query heads [BLOCK_S, G, HALF] x 2.
    q_off = g[None, :, None] * HEAD_DIM + j[None, None, :]                            # [1, G, HALF]
    q_mask = row_ok[:, None, None] & g_ok[None, :, None] & half_ok[None, None, :]
    q_src = group_ptr[:, None, None] + q_off
    q1 = tl.load(q_src, mask=q_mask, other=0.0)
    q2 = tl.load(q_src + HALF, mask=q_mask, other=0.0)
    q1, q2 = _rope_norm(q1, q2, c1[:, None, :], c2[:, None, :], s1[:, None, :], s2[:, None, :], qw1, qw2,
                        inv_d, eps, half_ok[None, None, :], HAS_NORM)
    q_dst = (q_out_ptr + (b * s_qb + s * s_qs + kv_head * (GROUP * HEAD_DIM)))[:, None, None] + q_off
    q_ty = q_out_ptr.dtype.element_ty
    tl.store(q_dst, q1.to(q_ty), mask=q_mask)
    tl.store(q_dst + HALF, q2.to(q_ty), mask=q_mask)
    # K [BLOCK_S, HALF] x 2, into the cache at each row's slot.
    k_src = (group_ptr + GROUP * HEAD_DIM)[:, None] + j[None, :]
    k1 = tl.load(k_src, mask=cs_mask, other=0.0)
    k2 = tl.load(k_src + HALF, mask=cs_mask, other=0.0)
    k1, k2 = _rope_norm(k1, k2, c1, c2, s1, s2, kw1, kw2, inv_d, eps, half_ok[None, :], HAS_NORM)
    slot = tl.load(slot_ptr + b * s_slb + s * s_sls, mask=row_ok, other=0)             # [BLOCK_S] int64
    kv_h = kv_head.to(tl.int64)
    k_dst = (kc_ptr + (b * s_kb + kv_h * s_kh + slot * s_ks))[:, None] + j[None, :]
    c_ty = kc_ptr.dtype.element_ty
    # Rounded to the returned q's dtype first (the model writes k after its norm), then to the cache's.
    tl.store(k_dst, k1.to(q_ty).to(c_ty), mask=cs_mask)
    tl.store(k_dst + HALF, k2.to(q_ty).to(c_ty), mask=cs_mask)
    # V [BLOCK_S, D]: a copy.
    d = tl.arange(0, BLOCK_D)
    v_mask = row_ok[:, None] & (d < HEAD_DIM)[None, :]
    v = tl.load((group_ptr + (GROUP + 1) * HEAD_DIM)[:, None] + d[None, :], mask=v_mask, other=0.0)
    v_dst = (vc_ptr + (b * s_vb + kv_h * s_vh + slot * s_vs))[:, None] + d[None, :]
    tl.store(v_dst, v.to(vc_ptr.dtype.element_ty), mask=v_mask)


TRITON_INTERPRETED = not isinstance(_prologue_kernel, JITFunction)


def require_triton_device(x: torch.Tensor) -> None:
    if not (x.is_cuda or (x.device.type == "cpu" and TRITON_INTERPRETED)):
        raise RuntimeError(f"qk_norm_rope_kv: the Triton kernel needs CUDA tensors, or CPU tensors with "
                           f"TRITON_INTERPRET=1 set before triton is first imported; got a tensor on {x.device}")


def _out_dtype(qkv: torch.Tensor, q_weight: torch.Tensor | None) -> torch.dtype:
    return qkv.dtype if q_weight is None else torch.promote_types(q_weight.dtype, qkv.dtype)


# Rows per program. One program per (row, KV group) is right at decode, where B * S is a few
# rows and the launch is latency-bound: the most programs, each as short as possible. At
# prefill those programs are tiny (group 4, head dim 128, bf16: 1.5 KB of qkv in, 1.5 KB of
# q/k/v out, 1 KB of cos/sin; 32768 of them at S = 4096) and the kernel ran at a fraction of
# copy bandwidth (49.4 us on an H200 against a 24 us floor). So a program takes BLOCK_S rows:
# the largest power of two that keeps (a) the q tile BLOCK_S * BLOCK_G * BLOCK_D within
# _MAX_TILE elements and (b) at least _MIN_PROGRAMS programs in the grid (1024: about 8 per SM
# on a 132-SM H200, so the last wave's tail stays small; (b) keeps decode at BLOCK_S = 1:
# 8 requests x 8 KV heads is 64 programs). Measured on an H200 at that prefill shape
# (1-32 rows a program at 4, 8 and 16 warps: bench/results/h200-2026-12-02-qwen-peers/bias-in-gemm/prologue.json):
# 8 rows at 4 warps is the fastest, 32.3 us (1 row 49.4, 4 rows 35.0, 16 rows 34.0, 32 rows
# 34.6 at 8 warps), and more warps than 4 only slowed the tiles up to 16 rows; hence a 4096-
# element cap (8 rows at group 4, head dim 128: ~32 KB moved a program) and 4 warps for every
# multi-row tile. BLOCK_S = 1 keeps the one-row warp rule. `rows_per_program=` /
# `num_warps=` override both.
_MAX_TILE = 4096
_MIN_PROGRAMS = 1024


def prologue_launch_config(n_rows: int, kv_heads: int, group: int, head_dim: int,
                           rows_per_program: int | None = None, num_warps: int | None = None) -> tuple[int, int]:
    """(BLOCK_S, num_warps) for B * S = n_rows rows (the comment above says why); shapes only,
    so it is graph-safe. An explicit rows_per_program must be a power of two."""
    tile_row = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim)
    if rows_per_program is None:
        block_s = 1
        while (block_s * 2 * tile_row <= _MAX_TILE
               and triton.cdiv(n_rows, block_s * 2) * kv_heads >= _MIN_PROGRAMS):
            block_s *= 2
    else:
        block_s = int(rows_per_program)
        if block_s < 1 or block_s & (block_s - 1):
            raise ValueError(f"qk_norm_rope_kv: rows_per_program must be a power of two >= 1, got {rows_per_program}")
    if num_warps is None:   # one small row (head dim x group < 512) fits a warp
        num_warps = 1 if block_s == 1 and head_dim * group < 512 else 4
    return block_s, int(num_warps)


def qk_norm_rope_kv_triton(qkv, cos, sin, q_weight, k_weight, eps: float, k_cache, v_cache, slots,
                           group: int, *, rows_per_program: int | None = None,
                           num_warps: int | None = None) -> torch.Tensor:
    """The kernel (inputs assumed checked). Graph-capturable: no host sync.

    rows_per_program, num_warps: None picks them from the shape (`prologue_launch_config`);
    give them to sweep. Each row's math is its own, but the order of the norm's sum follows
    the tile: 16-bit outputs may differ in the last bit between launch shapes (float32 too).
    """
    require_triton_device(qkv)
    B, S, _ = qkv.shape
    Hkv, D = k_cache.shape[1], k_cache.shape[3]
    q = torch.empty((B, S, Hkv * group, D), dtype=_out_dtype(qkv, q_weight), device=qkv.device)
    block_s, warps = prologue_launch_config(B * S, Hkv, group, D, rows_per_program, num_warps)
    if B * S == 0:
        return q
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("qk_norm_rope_kv: the caches' last dim must be contiguous")
    cos, sin = cos.contiguous(), sin.contiguous()
    cos_b = cos.stride(0) if cos.dim() == 3 else 0
    slot_b, slot_s = (slots.stride(0), slots.stride(1)) if slots.dim() == 2 else (0, slots.stride(0))
    has_norm = q_weight is not None
    half = D // 2
    _prologue_kernel[(triton.cdiv(B * S, block_s), Hkv)](
        qkv, cos, sin, q_weight if has_norm else qkv, k_weight if has_norm else qkv, k_cache, v_cache, slots, q,
        B * S, S, eps, 1.0 / D,
        qkv.stride(0), qkv.stride(1), cos_b, cos.stride(-2), slot_b, slot_s,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), q.stride(0), q.stride(1),
        GROUP=group, HEAD_DIM=D, HALF=half, BLOCK_S=block_s, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(D), HAS_NORM=has_norm,
        num_warps=warps)
    return q


# ----------------------------------------------------------------------- op and public API


@torch.library.custom_op("dtgen::qk_norm_rope_kv", mutates_args=("k_cache", "v_cache"))
def _prologue_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, group: int, impl: str) -> torch.Tensor:
    if impl == "reference" or (impl == "auto" and not qkv.is_cuda):
        return qk_norm_rope_kv_reference(qkv, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots, group)
    return qk_norm_rope_kv_triton(qkv, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots, group)


@_prologue_op.register_fake
def _(qkv, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slots, group, impl):
    B, S, _ = qkv.shape
    return qkv.new_empty((B, S, k_cache.shape[1] * group, k_cache.shape[3]), dtype=_out_dtype(qkv, q_weight))


def qk_norm_rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                    k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, group: int, impl: str = "auto") -> torch.Tensor:
    """The fused prologue (module docstring): writes k and v into the caches, returns q.

    impl: "auto" (CPU: reference, CUDA: Triton), "reference", "triton".
    """
    if impl not in IMPLS:
        raise ValueError(f"qk_norm_rope_kv: impl must be one of {IMPLS}, got {impl!r}")
    check_prologue_inputs(qkv, cos, sin, q_weight, k_weight, k_cache, v_cache, slots, group)
    if impl == "triton":
        require_triton_device(qkv)
    return torch.ops.dtgen.qk_norm_rope_kv(qkv, cos, sin, q_weight, k_weight, float(eps), k_cache, v_cache, slots,
                                           group, impl)
