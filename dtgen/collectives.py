"""Collectives used inside forward passes, on functional collectives (compile-friendly).

Each takes its process group as an argument; nothing here reads a global. Results are
waited on before they are returned: in eager mode a functional collective hands back an
AsyncCollectiveTensor, and one that is stored but never read (a recorded logit row, say)
would stay unwaited. On CUDA the wait is a stream dependency, not a host sync; under
torch.compile it is the wait the tracer would insert anyway.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


# torch 2.13 renamed all_gather_tensor to all_gather_single (same signature); 2.11 has only the old name.
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_dist_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every member's `x` along `dim`, in ascending group-rank order.

    Always gathers along dim 0 and moves the axis afterwards: torch 2.11's functional
    all-gather with another gather dim calls a helper that dynamo refuses to trace (measured
    on the H200 image). Moving `dim` to the front is free when the dims before it are 1
    (the usual [1, S, H] rows); the result is a view with the gathered axis back at `dim`.
    """
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()
    return funcol.wait_tensor(_funcol_all_gather(front, 0, group)).movedim(0, dim)


def all_gather_eager(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Blocking all-gather into `out` (control-plane use, outside compiled regions)."""
    assert out.is_contiguous() and x.is_contiguous()  # gloo writes wrong elements into strided views
    _dist_all_gather(out, x, group=group)


def all_gather_ordered(x: torch.Tensor, dim: int, group: dist.ProcessGroup, order: tuple[int, ...]) -> torch.Tensor:
    """All-gather along `dim`, chunks arranged by logical rank: chunk i comes from member order[i]."""
    gathered = all_gather(x, dim, group)
    if order == tuple(range(len(order))):
        return gathered
    chunks = gathered.chunk(len(order), dim=dim)
    return torch.cat([chunks[i] for i in order], dim=dim)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-split all-to-all along dim 0: chunk j goes to member j; result chunk j came from member j."""
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, group))
