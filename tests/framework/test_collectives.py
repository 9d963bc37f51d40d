"""Collectives inside compiled regions: every all-gather goes through dim 0.

torch 2.11 (the GPU image) cannot trace a functional all-gather along another dim
(`_maybe_view_chunk_cat` is marked skipped); 2.13, which CI runs, can. So this checks the
structure that makes both trace, on 2 gloo ranks: the gather dim handed to the functional
collective is always 0, and the result still equals concatenation along the asked dim,
eager and compiled (fullgraph).
"""
import torch
import torch.distributed as dist

from dtgen import collectives
from dtgen.launch import RankPool


def job_gather_dims(ctx):
    seen = []
    real = collectives._funcol_all_gather

    def recording(x, gather_dim, group):
        seen.append(gather_dim)
        return real(x, gather_dim, group)

    collectives._funcol_all_gather = recording
    group = dist.group.WORLD
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4) + 100 * ctx.rank
    expected = {d: torch.cat([torch.arange(24, dtype=torch.float32).view(2, 3, 4) + 100 * r for r in range(2)], d)
                for d in (0, 1, 2, -1)}
    ok = {}
    compiled = torch.compile(lambda t, d: collectives.all_gather(t, d, group), fullgraph=True, backend="aot_eager")
    for d in (0, 1, 2, -1):
        ok[d] = (torch.equal(collectives.all_gather(x, d, group), expected[d])
                 and torch.equal(compiled(x, d), expected[d]))
    base = x - 100 * ctx.rank   # rank 0's tensor
    ok["ordered"] = torch.equal(collectives.all_gather_ordered(x, 1, group, (1, 0)),
                                torch.cat([base + 100, base], 1))    # chunk i comes from member order[i]
    return ok, sorted(set(seen))


def test_all_gather_goes_through_dim_zero_and_matches_concatenation():
    with RankPool(2, timeout_s=120) as pool:
        for ok, dims in pool.run(job_gather_dims):
            assert all(ok.values()), ok
            assert dims == [0]
