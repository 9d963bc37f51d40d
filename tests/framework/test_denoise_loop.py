"""The framework's denoise loop (dtgen/denoise_loop.py), its phases (dtgen/diffusion_run.py)
and the step caches of several requests in one call (dtgen/step_cache.py `run_step_batch`)
on a toy denoiser whose every op is per row: requests batched equal their runs alone to
float32 rounding (measured: bitwise), whatever the cache and the CFG layout, and a request
that leaves at a step boundary leaves the others as they were. One process, CPU."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from dtgen.batching import per_member
from dtgen.buckets import ShapeBuckets
from dtgen.denoise_loop import CallRows, DenoiseMember, Segment, cfg_calls
from dtgen.diffusion_run import DiffusionPipeline
from dtgen.layers.flow_match import classifier_free_guidance, make_sampler
from dtgen.sequence import SequenceLayout
from dtgen.step_cache import DenoiserCall


@dataclass(frozen=True)
class ToyRequest:
    text: float                 # the toy's "prompt": what its conditional rows add
    seed: int = 0
    guidance: float = 3.0
    steps: int = 4
    sampler: str = "unipc"
    step_cache: object = None

    def check(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps}")

    @property
    def guided(self) -> bool:
        return self.guidance > 1


class ToyController:
    """One process: every phase's runtime has no CFG axis and no SP."""

    def __init__(self):
        self.rt = SimpleNamespace(cfg_size=1, cfg_rank=0, gather_cfg=lambda x: x, seq=SequenceLayout())

    @contextmanager
    def phase(self, name):
        yield self.rt


class Toy(DiffusionPipeline):
    """Latents [1, 6, 4]; three 'blocks', each a per-row tanh of an affine map; its calls cut
    where a step cache reuses them, with `row_blocks` for some rows only."""

    buckets = ShapeBuckets(sizes=(), batch=("steps", "sampler", "step_cache", "guided"))
    result_type = staticmethod(lambda pixels, latents, timings, record: SimpleNamespace(
        latents=latents, timings_ms=timings, record=record))

    def __init__(self, together: bool):
        self.cfg_together, self.controller, self.device = together, ToyController(), torch.device("cpu")
        self.is_main, self.vae_group = True, None
        g = torch.Generator().manual_seed(0)
        self.weights = [(1 + 0.3 * torch.randn(4, generator=g), 0.1 * torch.randn(4, generator=g)) for _ in range(3)]

    def check(self, req):
        req.check()

    def encode(self, req):
        return torch.tensor([[req.text], [-0.5 * req.text]])    # [cond, uncond] rows, [2, 1]

    def latent_shape(self, req):
        return (1, 6, 4)

    def sampler(self, req):
        return make_sampler(req.sampler, req.steps, 3.0)

    def decode_latents(self, req, latents):
        return None

    def segments(self, rt, timesteps, req):
        return [Segment("toy", 0, len(timesteps), 2 if req.guided else 1)]

    def denoise_call(self, rt, segment, t, rows: CallRows) -> DenoiserCall:
        x, text = rows.latents, rows.take([m.context for m in rows.members])     # [B, 6, 4], [B, 1]
        scale = 1 + float(t) / 1000

        def embed():
            return x * scale + text[:, :, None]

        def blocks(h, lo, hi, picked=None):
            for w, b in self.weights[lo:hi]:
                h = torch.tanh(h * w + b)
            return h

        def head(h):
            return h * 0.5 - x

        return DenoiserCall(head=head, embed=embed, blocks=blocks, num_blocks=3, row_blocks=blocks)

    def guide(self, member: DenoiseMember, segment, branches):
        if segment.branches == 1:
            return branches
        return classifier_free_guidance(branches[0:1], branches[1:2], member.request.guidance)


REQUESTS = [ToyRequest(1.0, seed=1, guidance=3.0), ToyRequest(-0.7, seed=2, guidance=5.0),
            ToyRequest(0.2, seed=3, guidance=2.0)]
CACHES = [None, "taylor:interval=2", "taylorseer:interval=2,disable_before=1,order=2,factors_dtype=float32",
          "magcache:calibrate=true", "magcache:threshold=0.5,max_skip_steps=1,retention_ratio=0.2,mag_ratios=1/1/1/1",
          "first-block:threshold=0.06"]


def quiet(n):
    return per_member([lambda *a: None] * n)


def full_rows(report):
    return None if report is None else (report["full_steps"], report.get("full_rows"))


@pytest.mark.parametrize("together", [True, False], ids=["cfg-rows-together", "cfg-serial"])
@pytest.mark.parametrize("cache", CACHES, ids=["none", "taylor", "taylorseer", "magcache-calibrate", "magcache",
                                               "first-block"])
def test_a_batch_equals_its_requests_alone(together, cache):
    toy = Toy(together)
    reqs = [replace(r, step_cache=cache) for r in REQUESTS]
    alone = [toy.generate(r, record=True) for r in reqs]
    batched = toy.generate_batch(reqs, quiet(3), record=True)
    for a, b in zip(alone, batched):
        torch.testing.assert_close(b.latents, a.latents, rtol=1e-6, atol=1e-7)
        for x, y in zip(b.record["noise"], a.record["noise"], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        assert full_rows(b.record.get("step_cache")) == full_rows(a.record.get("step_cache"))
        assert len(b.timings_ms["denoise_step"]) == 4 and {"encode", "denoise", "decode"} <= set(b.timings_ms)
    assert float((batched[0].latents - batched[1].latents).abs().max()) > 0.1   # each its own
    if cache and cache.startswith("first-block"):   # at some step the requests of one call decide apart
        rows = [a.record["step_cache"]["full_rows"] for a in alone]
        assert any(len({tuple(r[i]) for r in rows}) > 1 for i in range(4)), rows
        sites = [s for a in alone for s in a.record["step_cache"].get("call_sites", [a.record["step_cache"]])]
        measures = [d for s in sites for step in s["first_block_diff"] for d in step if d is not None]
        assert min(abs(d - 0.06) / 0.06 for d in measures) > 1e-3, measures   # decisions clear of the threshold
    if cache and cache.startswith("magcache:threshold"):
        assert alone[0].record["step_cache"]["cached_steps"]


def test_a_request_that_leaves_drops_its_rows_and_the_others_go_on():
    toy = Toy(True)
    reqs = [replace(r, step_cache="first-block:threshold=0.06") for r in REQUESTS]
    alone = [toy.generate(r) for r in reqs]
    seen = []

    def hook(phase, done, total, members):
        seen.append((done, tuple(members)))
        return {0: RuntimeError("request 0 fails after step 2")} if done == 2 else {}

    out = toy.generate_batch(reqs, hook)
    assert isinstance(out[0], RuntimeError) and seen == [(1, (0, 1, 2)), (2, (0, 1, 2)), (3, (1, 2)), (4, (1, 2))]
    for k in (1, 2):
        torch.testing.assert_close(out[k].latents, alone[k].latents, rtol=1e-6, atol=1e-7)
        assert full_rows(out[k].record["step_cache"]) == full_rows(alone[k].record["step_cache"])


def test_the_cfg_calls_are_data():
    rt = SimpleNamespace(cfg_size=1, cfg_rank=0)
    assert cfg_calls(rt, 2, True).calls == ((0, 1),) and cfg_calls(rt, 2, False).calls == ((0,), (1,))
    assert cfg_calls(rt, 1, True).calls == ((0,),)
    split = cfg_calls(SimpleNamespace(cfg_size=2, cfg_rank=1), 2, True)
    assert split.calls == ((1,),) and split.gathered == ((0,), (1,)) and split.split
    assert cfg_calls(SimpleNamespace(cfg_size=2, cfg_rank=1), 1, True).calls == ((0,),)   # no CFG: branch 0 on each
    with pytest.raises(ValueError, match="a CFG axis of 4 ranks: CFG has 2 branches"):
        cfg_calls(SimpleNamespace(cfg_size=4, cfg_rank=0), 2, True)


def test_what_a_batch_cannot_share_is_refused_in_one_line():
    toy = Toy(True)
    with pytest.raises(ValueError, match=r"^steps: the requests of one batch must share it"):
        toy.generate_batch([REQUESTS[0], replace(REQUESTS[1], steps=3)], quiet(2))
    with pytest.raises(ValueError, match=r"^guided: the requests of one batch must share it"):
        toy.generate_batch([REQUESTS[0], replace(REQUESTS[1], guidance=1.0)], quiet(2))
    # a step cache compares as its config, however it is written
    same = [replace(REQUESTS[0], step_cache="taylor:interval=2"),
            replace(REQUESTS[1], step_cache={"method": "taylor", "interval": 2})]
    assert toy.batch_key(same[0]) == toy.batch_key(same[1]) and all(
        not isinstance(r, BaseException) for r in toy.generate_batch(same, quiet(2)))
    # a bad request fails alone, before any work; the others run
    out = toy.generate_batch([REQUESTS[0], replace(REQUESTS[1], steps=0)], quiet(2))
    assert str(out[1]) == "steps: must be >= 1, got 0" and out[0].latents.shape == (1, 6, 4)


def test_steps_ahead_reports_a_boundary_after_the_next_launch_and_tells_the_model_who_stayed(monkeypatch):
    """The look-ahead clock (`StepsAhead`, HunyuanImage-3's): step i is launched before step
    i-1's boundary is reported (the first step's boundary comes before step 1); a member that
    leaves there was in step i's rows, the model hears which positions stayed
    (`members_left`), and the others equal their runs alone."""
    import dtgen.diffusion_run as diffusion_run
    from dtgen.denoise_loop import StepsAhead, denoise
    from dtgen.profiling import NullProfiler
    from dtgen.timing import Timer

    events = []

    class Told(Toy):
        def denoise_call(self, rt, segment, t, rows):
            events.append(("call", rows.step, tuple(m.index for m in rows.members)))
            return super().denoise_call(rt, segment, t, rows)

        def members_left(self, kept):
            events.append(("left", tuple(kept)))

    toy = Told(True)
    alone = [toy.generate(r) for r in REQUESTS]

    def hook(phase, done, total, members):
        events.append(("boundary", done))
        return {1: RuntimeError("request 1 leaves after step 2")} if done == 2 else {}

    clock = StepsAhead(Timer(torch.device("cpu")), NullProfiler(), show=False)
    monkeypatch.setattr(diffusion_run, "denoise", lambda *a: denoise(*a, clock=clock))
    events.clear()
    out = toy.generate_batch(REQUESTS, hook)
    assert events == [("call", 0, (0, 1, 2)), ("boundary", 1), ("call", 1, (0, 1, 2)), ("call", 2, (0, 1, 2)),
                      ("boundary", 2), ("left", (0, 2)), ("call", 3, (0, 2)), ("boundary", 3),
                      ("boundary", 4)], events
    assert isinstance(out[1], RuntimeError)
    for k in (0, 2):
        torch.testing.assert_close(out[k].latents, alone[k].latents, rtol=1e-6, atol=1e-7)
        assert len(out[k].timings_ms["denoise_step"]) == 4
