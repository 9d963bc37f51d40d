"""Spatial parallelism for convolutional decoders: one image split along one axis over a group.

Generic pieces, no model knowledge (``models/hunyuan_image3/parallel_vae.py`` and
``dtgen/layers/wan_vae_parallel.py`` map them onto the HunyuanImage-3 and Wan VAEs):

- ``SpatialSplit``: which group, which tensor dim, and how many rows each member holds at a
  reference resolution (uneven splits allowed, ``torch.tensor_split`` convention: the first
  ``extent % P`` members hold one row more).
- ``halo_pad`` / ``HaloConv``: a stride-1 convolution with symmetric zero padding ``p`` along
  the split dim gets ``p`` rows from each neighbour (zeros at the image's outer edges, exactly
  the unsplit conv's zero padding) and then runs with no padding along that dim. The exchange
  is point-to-point (``batch_isend_irecv``, ``exchange="p2p"``, the default) or a functional
  all-gather of every member's edge rows (``exchange="allgather"``: functional collectives,
  the kind dynamo traces, though the split decode is not tested under torch.compile; it
  moves P times more bytes, which are only 2p rows each).
- ``distributed_group_norm`` / ``DistGroupNorm``: statistics over the whole image. Each member
  computes per-(sample, group) count, mean and M2 (sum of squared deviations from its OWN
  mean) in fp32 with ``torch.var_mean``; one small all-gather of these triples; the members'
  moments are combined in fp64 with Chan et al.'s parallel formula
  (mean = sum n_i m_i / N, M2 = sum M2_i + n_i (m_i - mean)^2). No E[x^2] - E[x]^2
  cancellation anywhere, and one collective per norm. Normalization is one native pass
  (an eval-mode ``F.batch_norm`` fed the whole-image statistics per (sample, channel)), which
  computes like PyTorch's own GroupNorm kernels: scale = rstd * gamma, shift = beta - mean *
  scale, y = x * scale + shift, in fp32, output in x's dtype.
- ``gather_split`` / ``gather_split_to``: the full tensor along the split dim on every member,
  or on one member only (point-to-point), uneven sizes included.
- ``spatial_parallel``: a split-aware twin of a module tree that shares every parameter
  tensor with the original (containers are shallow-cloned, leaves wrapped), so the original
  is never modified and nothing needs restoring.
- ``split_attention``: local queries over keys and values all-gathered along the split dim,
  for attention blocks (the models wrap their own blocks around it).
- ``SplitDecoder``: what a model's split decoder shares (argument checks, the latent split,
  the twin); ``check_output`` / ``route_output``: the "all" / "local" / rank output choice,
  checked before decoding and gathered after.

Inference only: the exchanges are not differentiable.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, ClassVar, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from .collectives import all_gather

_CONV_FNS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def split_sizes(extent: int, parts: int, min_size: int = 1, what: str = "extent") -> list[int]:
    """Rows per member: ``torch.tensor_split`` sizes (first ``extent % parts`` members get one more).

    Raises ValueError naming the extent and the group size when a member would get fewer than
    ``min_size`` rows.
    """
    if parts < 1:
        raise ValueError(f"cannot split over {parts} ranks")
    if extent < parts * min_size:
        raise ValueError(f"{what} {extent} cannot be split over {parts} ranks: every rank needs at least "
                         f"{min_size} row(s), so the {what} must be >= {parts * min_size}")
    base, extra = divmod(extent, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _plain(t: Tensor) -> Tensor:
    """Wait for a functional collective's result and return a plain tensor."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


@dataclass(frozen=True)
class SpatialSplit:
    """One tensor dim split over ``group``; ``sizes`` are the rows per group rank at the
    resolution the split was built for (other resolutions scale them, see ``sizes_at``).

    ``dim`` is negative (counted from the last dim), so the same split describes a latent
    [B, C, h, w] and a video activation [B, C, T, H, W].
    """

    group: dist.ProcessGroup  # build() maps None to the default group
    dim: int
    sizes: tuple[int, ...]
    rank: int

    @classmethod
    def build(cls, group: Optional[dist.ProcessGroup], dim: int, extent: int, min_size: int = 1,
              what: str = "extent") -> "SpatialSplit":
        if dim >= 0:
            raise ValueError(f"SpatialSplit dim must be negative (from the end), got {dim}")
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the split's group")
        size = dist.get_world_size(group)
        return cls(group, dim, tuple(split_sizes(extent, size, min_size, what)), rank)

    @property
    def size(self) -> int:
        return len(self.sizes)

    @property
    def even(self) -> bool:
        return len(set(self.sizes)) == 1

    def offset(self, rank: Optional[int] = None) -> int:
        r = self.rank if rank is None else rank
        return sum(self.sizes[:r])

    def local(self, x: Tensor) -> Tensor:
        """This member's rows of a full tensor (a view)."""
        if x.shape[self.dim] != sum(self.sizes):
            raise ValueError(f"tensor extent {x.shape[self.dim]} along dim {self.dim} does not match the "
                             f"split's {sum(self.sizes)}")
        return x.narrow(self.dim, self.offset(), self.sizes[self.rank])

    def sizes_at(self, local_extent: int) -> list[int]:
        """Every member's rows once the resolution has changed by the same factor everywhere
        (e.g. after a x2 upsampler), inferred from this member's current ``local_extent``."""
        scale = Fraction(local_extent, self.sizes[self.rank])
        out = [s * scale for s in self.sizes]
        if any(v.denominator != 1 for v in out):
            raise ValueError(f"local extent {local_extent} on rank {self.rank} is not a consistent rescale of "
                             f"the split sizes {self.sizes}")
        return [int(v) for v in out]

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)


# ---------------------------------------------------------------------------------------------
# Halo exchange and convolution


def _halos_p2p(x: Tensor, split: SpatialSplit, before: int, after: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    dim, r, n = split.dim, split.rank, x.shape[split.dim]
    ops, prev, nxt = [], None, None

    def rows(k: int) -> list[int]:
        s = list(x.shape)
        s[dim] = k
        return s

    if r > 0:
        peer = split.global_rank(r - 1)
        if before:
            prev = x.new_empty(rows(before))
            ops.append(dist.P2POp(dist.irecv, prev, peer, split.group))
        if after:  # my first rows are the previous member's bottom halo
            ops.append(dist.P2POp(dist.isend, x.narrow(dim, 0, after).contiguous(), peer, split.group))
    if r < split.size - 1:
        peer = split.global_rank(r + 1)
        if before:  # my last rows are the next member's top halo
            ops.append(dist.P2POp(dist.isend, x.narrow(dim, n - before, before).contiguous(), peer, split.group))
        if after:
            nxt = x.new_empty(rows(after))
            ops.append(dist.P2POp(dist.irecv, nxt, peer, split.group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return prev, nxt


def _halos_allgather(x: Tensor, split: SpatialSplit, before: int, after: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    dim, r, n = split.dim, split.rank, x.shape[split.dim]
    edges = torch.cat([x.narrow(dim, 0, after), x.narrow(dim, n - before, before)], dim)
    chunks = _plain(all_gather(edges, dim, split.group)).split(after + before, dim)
    prev = chunks[r - 1].narrow(dim, after, before) if r > 0 else None
    nxt = chunks[r + 1].narrow(dim, 0, after) if r < split.size - 1 else None
    return prev, nxt


def halo_pad(x: Tensor, split: SpatialSplit, before: int, after: Optional[int] = None,
             exchange: str = "p2p") -> Tensor:
    """``x`` with ``before`` rows of the previous member prepended and ``after`` rows of the
    next member appended along ``split.dim``; zeros where there is no neighbour (the image's
    outer edges), which is exactly what zero padding does in the unsplit op.

    Every member must hold at least max(before, after) rows (halos come from direct
    neighbours only).
    """
    after = before if after is None else after
    if before == 0 and after == 0:
        return x
    n = x.shape[split.dim]
    if n < max(before, after):
        raise ValueError(f"rank {split.rank} holds {n} row(s) along dim {split.dim}, fewer than the halo "
                         f"{max(before, after)}: use fewer ranks or a larger image")
    if split.size == 1:
        prev = nxt = None
    elif exchange == "p2p":
        prev, nxt = _halos_p2p(x, split, before, after)
    elif exchange == "allgather":
        prev, nxt = _halos_allgather(x, split, before, after)
    else:
        raise ValueError(f"unknown halo exchange {exchange!r}; use 'p2p' or 'allgather'")

    def zeros(k: int) -> Tensor:
        s = list(x.shape)
        s[split.dim] = k
        return x.new_zeros(s)

    parts = [prev if prev is not None else zeros(before), x, nxt if nxt is not None else zeros(after)]
    return torch.cat([p for p in parts if p.shape[split.dim]], split.dim)


def check_halo_conv(conv: nn.Module, dim: int) -> int:
    """The halo a conv needs along ``dim`` (its padding there); raises ValueError for a conv
    that is not 'same'-shaped along ``dim`` (stride 1, zero padding, 2p == dilation*(k-1))."""
    if isinstance(conv, nn.modules.conv._ConvTransposeNd) or not isinstance(conv, nn.modules.conv._ConvNd):
        raise ValueError(f"{type(conv).__name__}: only nn.Conv1d/2d/3d (and subclasses) can be halo-split")
    nd = len(conv.kernel_size)
    if not -nd <= dim < 0:
        raise ValueError(f"split dim {dim} is not one of the conv's {nd} spatial dims")
    if isinstance(conv.padding, str):
        raise ValueError(f"{type(conv).__name__}: padding={conv.padding!r}; give explicit integer padding")
    if conv.padding_mode != "zeros":
        raise ValueError(f"{type(conv).__name__}: padding_mode={conv.padding_mode!r}; only zero padding splits")
    k, p, s, d = conv.kernel_size[dim], conv.padding[dim], conv.stride[dim], conv.dilation[dim]
    if s != 1 or 2 * p != d * (k - 1):
        raise ValueError(f"{type(conv).__name__}: kernel {k}, padding {p}, stride {s}, dilation {d} along dim "
                         f"{dim}; a halo split needs stride 1 and symmetric 'same' padding (2p == dilation*(k-1))")
    return p


def halo_conv(conv: nn.Module, x: Tensor, split: SpatialSplit, exchange: str = "p2p") -> Tensor:
    """``conv(x_full)`` restricted to this member's rows, from this member's rows ``x``."""
    p = check_halo_conv(conv, split.dim)
    if p == 0 or split.size == 1:  # nothing to exchange: the conv's own zero padding is the edge
        return conv(x)
    padding = list(conv.padding)
    padding[split.dim] = 0
    fn = _CONV_FNS[len(conv.kernel_size)]
    return fn(halo_pad(x, split, p, p, exchange), conv.weight, conv.bias, conv.stride, tuple(padding),
              conv.dilation, conv.groups)


class HaloConv(nn.Module):
    """Wraps a conv (shares its parameters) to run on a split input with a halo exchange."""

    def __init__(self, conv: nn.Module, split: SpatialSplit, exchange: str = "p2p"):
        super().__init__()
        check_halo_conv(conv, split.dim)
        self.conv = conv
        self.split = split
        self.exchange = exchange

    # The wrapped conv's parameters, for code that reads e.g. ``conv_in.weight.dtype``.
    @property
    def weight(self) -> Tensor:
        return self.conv.weight

    @property
    def bias(self) -> Optional[Tensor]:
        return self.conv.bias

    def forward(self, x: Tensor) -> Tensor:
        return halo_conv(self.conv, x, self.split, self.exchange)


# ---------------------------------------------------------------------------------------------
# GroupNorm over the whole image


def group_moments(x: Tensor, num_groups: int) -> Tensor:
    """Per (sample, group): [count, mean, M2] of this member's part, shape [B, G, 3], fp64
    (mean and M2 computed in fp32 from the local values)."""
    b, c = x.shape[:2]
    if c % num_groups:
        raise ValueError(f"{c} channels are not divisible into {num_groups} groups")
    xg = x.reshape(b, num_groups, -1).float()
    var, mean = torch.var_mean(xg, dim=-1, correction=0)
    count = xg.shape[-1]  # may exceed 2**24 on big images: the triple is built in fp64
    mean, var = mean.double(), var.double()
    return torch.stack([torch.full_like(mean, count), mean, var * count], dim=-1)


def combine_moments(moments: Tensor) -> tuple[Tensor, Tensor]:
    """[P, ..., 3] per-member (count, mean, M2) -> (mean, biased variance) of the union (Chan et al.)."""
    n, m, m2 = moments.unbind(-1)
    total = n.sum(0)
    mean = (n * m).sum(0) / total
    var = (m2 + n * (m - mean) ** 2).sum(0) / total
    return mean, var


def distributed_group_norm(x: Tensor, split: SpatialSplit, num_groups: int, weight: Optional[Tensor],
                           bias: Optional[Tensor], eps: float) -> Tensor:
    """``F.group_norm`` of the full (split) tensor, restricted to this member's rows."""
    b, c = x.shape[:2]
    moments = group_moments(x, num_groups)
    if split.size > 1:
        moments = _plain(all_gather(moments.unsqueeze(0), 0, split.group))
    else:
        moments = moments.unsqueeze(0)
    mean, var = combine_moments(moments)
    # Normalize with the whole-image statistics in ONE native pass in x's dtype: an eval-mode
    # batch norm over [1, B*C, positions] with per-(sample, channel) "running" statistics is
    # exactly (x - mean) * rsqrt(var + eps) * gamma + beta (fp32 inside, as PyTorch's own
    # GroupNorm kernels: scale = rstd * gamma, shift = beta - mean * scale).
    rep = c // num_groups
    mean_c = mean.float().repeat_interleave(rep, dim=1).reshape(-1)
    var_c = var.float().repeat_interleave(rep, dim=1).reshape(-1)
    w = weight.float().repeat(b) if weight is not None else None
    bb = bias.float().repeat(b) if bias is not None else None
    y = F.batch_norm(x.reshape(1, b * c, -1), mean_c, var_c, w, bb, training=False, momentum=0.0, eps=eps)
    return y.view(x.shape)


class DistGroupNorm(nn.Module):
    """Wraps an ``nn.GroupNorm`` (shares its parameters) to normalize a split tensor with
    whole-image statistics."""

    def __init__(self, norm: nn.GroupNorm, split: SpatialSplit):
        super().__init__()
        self.norm = norm
        self.split = split

    @property
    def weight(self) -> Optional[Tensor]:
        return self.norm.weight

    @property
    def bias(self) -> Optional[Tensor]:
        return self.norm.bias

    def forward(self, x: Tensor) -> Tensor:
        n = self.norm
        return distributed_group_norm(x, self.split, n.num_groups, n.weight, n.bias, n.eps)


# ---------------------------------------------------------------------------------------------
# Gathers


def gather_split(x: Tensor, split: SpatialSplit) -> Tensor:
    """The full tensor along ``split.dim`` on every member (uneven sizes: padded all-gather)."""
    if split.size == 1:
        return x
    dim = split.dim
    sizes = split.sizes_at(x.shape[dim])
    if len(set(sizes)) == 1:
        return _plain(all_gather(x, dim, split.group))
    big = max(sizes)
    if x.shape[dim] < big:
        pad = list(x.shape)
        pad[dim] = big - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim)
    chunks = _plain(all_gather(x, dim, split.group)).split(big, dim)
    return torch.cat([c.narrow(dim, 0, s) for c, s in zip(chunks, sizes)], dim)


def gather_split_to(x: Tensor, split: SpatialSplit, dst: int) -> Optional[Tensor]:
    """The full tensor along ``split.dim`` on group rank ``dst`` only (point-to-point); None
    on the other members."""
    if not 0 <= dst < split.size:
        raise ValueError(f"gather destination {dst} is not a rank of a group of {split.size}")
    if split.size == 1:
        return x
    dim = split.dim
    sizes = split.sizes_at(x.shape[dim])
    if split.rank != dst:
        work = dist.isend(x.contiguous(), split.global_rank(dst), split.group)
        work.wait()
        return None
    parts, ops = [], []
    for r, s in enumerate(sizes):
        if r == dst:
            parts.append(x)
            continue
        shape = list(x.shape)
        shape[dim] = s
        buf = x.new_empty(shape)
        parts.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, split.global_rank(r), split.group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return torch.cat(parts, dim)


# ---------------------------------------------------------------------------------------------
# Split-aware twin of a module tree

# Leaf modules that act on each position independently and so run unchanged on a split tensor.
POINTWISE_LEAVES: tuple[type, ...] = (
    nn.Identity, nn.Dropout, nn.Linear, nn.SiLU, nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU,
    nn.Mish, nn.Hardswish, nn.ELU,
)


def _shallow_clone(m: nn.Module) -> nn.Module:
    """A new module object of the same class with the same attributes, parameters (the same
    Parameter objects) and buffers, but its own child table, so children can be replaced
    without touching ``m``."""
    new = m.__class__.__new__(m.__class__)
    new.__dict__ = m.__dict__.copy()
    new._modules = type(m._modules)(m._modules)
    new._parameters = type(m._parameters)(m._parameters)
    new._buffers = type(m._buffers)(m._buffers)
    return new


def spatial_parallel(module: nn.Module, split: SpatialSplit,
                     overrides: Optional[dict[type, Callable[[nn.Module, SpatialSplit], nn.Module]]] = None,
                     exchange: str = "p2p", pointwise: tuple[type, ...] = POINTWISE_LEAVES) -> nn.Module:
    """A twin of ``module`` that runs on this member's rows of a tensor split by ``split``.

    Containers are shallow clones (same parameter tensors, their own child tables); convs
    become ``HaloConv``, GroupNorms ``DistGroupNorm``; a module whose type is in ``overrides``
    is replaced by ``overrides[type](module, split)`` and not descended into. The original
    tree is never modified. Leaves of any other type raise ValueError unless listed in
    ``pointwise``. Containers' own forward code is trusted to be per-position (reshapes,
    additions, depth-to-space); anything in a forward that mixes positions along the split
    dim needs an override.
    """
    overrides = overrides or {}

    def convert(m: nn.Module, name: str) -> nn.Module:
        for typ, factory in overrides.items():
            if isinstance(m, typ):
                return factory(m, split)
        if isinstance(m, nn.GroupNorm):
            return DistGroupNorm(m, split)
        if isinstance(m, nn.modules.conv._ConvNd):
            return HaloConv(m, split, exchange)
        if not m._modules:
            if isinstance(m, pointwise):
                return m
            raise ValueError(f"{name or 'module'} ({type(m).__name__}): no spatial-parallel version known; "
                             f"pass an override or list it as pointwise")
        new = _shallow_clone(m)
        for child_name, child in m._modules.items():
            if child is not None:
                new._modules[child_name] = convert(child, f"{name}.{child_name}" if name else child_name)
        return new

    return convert(module, "")


# ---------------------------------------------------------------------------------------------
# Attention over a split map


def _map_tokens(y: Tensor) -> Tensor:
    """[N, C, *spatial] -> [N, 1, positions, C]: one head, every position a token."""
    return y.flatten(2).transpose(1, 2).unsqueeze(1)


def check_pointwise_convs(module: nn.Module, names: tuple[str, ...], dim: int) -> None:
    """Raise ValueError unless each ``module.<name>`` is a conv of kernel 1 along ``dim``: an
    attention block's projections must run on a member's own rows with no halo."""
    for name in names:
        if check_halo_conv(getattr(module, name), dim):
            raise ValueError(f"{type(module).__name__}.{name} is not a 1x1 convolution")


def split_attention(q: Tensor, k: Tensor, v: Tensor, split: SpatialSplit) -> Tensor:
    """Single-head attention (scale 1/sqrt(C)) of this member's queries over every position of
    the whole map.

    ``q``, ``k``, ``v``: this member's rows of channel-first maps [N, C, *spatial] split along
    ``split.dim`` (a video [B, C, T, H, W], or frames [B*T, C, H, W] for per-frame attention);
    each position is one token of C channels. Queries stay local; K and V are concatenated and
    all-gathered once along the split dim (uneven splits: padded gather), so the result, shaped
    like ``q``, is this member's rows of the unsplit attention.
    """
    kv = gather_split(torch.cat([k, v], dim=1), split)  # one gather for K and V
    k, v = kv.chunk(2, dim=1)
    o = F.scaled_dot_product_attention(_map_tokens(q), _map_tokens(k), _map_tokens(v))
    return o.squeeze(1).transpose(1, 2).reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# What a model's split decoder shares

SPLIT_DIMS = {"height": -2, "width": -1}
SplitOutput = Union[str, int]  # "all", "local" or a group rank


def check_output(output: SplitOutput, split: SpatialSplit) -> None:
    """Raise ValueError unless ``output`` is "all", "local" or a rank of ``split``'s group.

    Call it before decoding: every member then fails alike, instead of some decoding and
    waiting in the final gather for members that gave up.
    """
    if output in ("all", "local"):
        return
    if isinstance(output, int) and not isinstance(output, bool) and 0 <= output < split.size:
        return
    raise ValueError(f"output must be 'all', 'local' or a rank of the group of {split.size}, got {output!r}")


def route_output(local: Tensor, split: SpatialSplit, output: SplitOutput) -> Optional[Tensor]:
    """This member's decoded rows as ``output`` asks: "all", the full tensor on every member;
    "local", the rows themselves; a group rank, the full tensor there and None elsewhere."""
    if output == "all":
        return gather_split(local, split)
    if output == "local":
        return local
    return gather_split_to(local, split, output)


class SplitDecoder:
    """A model's VAE decode split along the height or width of its latents over a process group.

    ``group``: any process group (None: the default group). ``dim``: "height" or "width".
    ``exchange``: halo exchange, "p2p" (batch_isend_irecv) or "allgather" (functional
    collective).

    A model subclasses it, sets the class attributes below and writes its own decode methods,
    each: ``split_for`` -> ``check_output`` -> ``twin(split)`` on ``split.local(latents)`` ->
    ``route_output``.
    """

    # Names of the latent dims (only their number is checked), e.g. ("B", "C", "h", "w").
    latent_layout: ClassVar[tuple[str, ...]] = ()
    # {module type: factory(module, split)} for the modules besides convs and GroupNorms that
    # mix positions along the split dim (attention), see ``spatial_parallel``.
    overrides: ClassVar[dict[type, Callable[[nn.Module, SpatialSplit], nn.Module]]] = {}
    # Leaf types that run unchanged on a split tensor.
    pointwise: ClassVar[tuple[type, ...]] = POINTWISE_LEAVES
    # Latent rows every member must hold: one covers a 3x3 conv_in (a row from each
    # neighbour); later layers only see more rows (x2 per upsampler).
    min_latent_rows: ClassVar[int] = 1

    def __init__(self, vae: nn.Module, group: Optional[dist.ProcessGroup] = None, dim: str = "height",
                 exchange: str = "p2p"):
        if dim not in SPLIT_DIMS:
            raise ValueError(f"dim must be one of {sorted(SPLIT_DIMS)}, got {dim!r}")
        if exchange not in ("p2p", "allgather"):
            raise ValueError(f"exchange must be 'p2p' or 'allgather', got {exchange!r}")
        self.vae = vae
        self.group = group
        self.dim = dim
        self.exchange = exchange

    def split_for(self, latents: Tensor) -> SpatialSplit:
        """The latent split for these latents; ValueError naming the extent and the group size
        when some member would get too few rows."""
        if latents.dim() != len(self.latent_layout):
            raise ValueError(f"expected latents [{', '.join(self.latent_layout)}], got shape {tuple(latents.shape)}")
        d = SPLIT_DIMS[self.dim]
        return SpatialSplit.build(self.group, d, latents.shape[d], min_size=self.min_latent_rows,
                                  what=f"latent {self.dim}")

    def twin(self, split: SpatialSplit) -> nn.Module:
        """The split-aware twin of the VAE (same parameter tensors)."""
        return spatial_parallel(self.vae, split, self.overrides, exchange=self.exchange, pointwise=self.pointwise)

    def local_rows(self, latents: Tensor, factor: int) -> tuple[int, int]:
        """(offset, size) of this member's rows (or columns) of the decoded output, ``factor``
        output rows per latent row: what ``output="local"`` returns."""
        split = self.split_for(latents)
        return split.offset() * factor, split.sizes[split.rank] * factor
