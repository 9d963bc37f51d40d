"""dtgen/step_cache.py on its own: config parsing and the one-line refusals, the schedules,
the caches on synthetic denoisers whose arithmetic has a closed form, the reports, and the
row layouts under sequence parallelism (2 gloo ranks: sums, gathers and the FFT band split
over sharded rows equal the whole-sequence values). Everything runs in float64 where the
values are compared exactly, so a tolerance stands only for the FFT's and float32's rounding.
"""
import math

import pytest
import torch

from dtgen.launch import RankPool
from dtgen.sequence import SequenceLayout
from dtgen.step_cache import (MAX_TAYLOR_ORDER, DenoiserCall, FirstBlockCache, FirstBlockConfig, MagCache,
                              MagCacheConfig, RowLayout, StepCacheError, TaylorCache, TaylorConfig, TaylorSeerConfig,
                              concat_reports, describe, fft_bands, magcache_plan, make_step_cache, merged_report,
                              parse_step_cache, run_step, step_cache_config, taylor_plan, taylorseer_plan)


# ---- configs --------------------------------------------------------------------------------
def test_configs_parse_from_text_and_dicts():
    assert parse_step_cache(None) is None and parse_step_cache("none") is None and parse_step_cache("off") is None
    assert parse_step_cache("first-block") == FirstBlockConfig()
    assert parse_step_cache("first-block:threshold=0.1") == FirstBlockConfig(0.1)
    assert parse_step_cache("taylor: interval=4, order=1, first-enhance=true") == \
        TaylorConfig(interval=4, order=1, first_enhance=True)
    assert parse_step_cache("taylorseer:disable_after=none,factors_dtype=float32") == \
        TaylorSeerConfig(disable_after=None, factors_dtype="float32")
    mag = parse_step_cache("magcache:mag_ratios=1.0/0.99/0.98,threshold=0.1")
    assert mag == MagCacheConfig(threshold=0.1, mag_ratios=(1.0, 0.99, 0.98))
    assert parse_step_cache({"method": "magcache", "mag_ratios": [1.0, 0.5]}) == MagCacheConfig(mag_ratios=(1.0, 0.5))
    assert parse_step_cache(mag) is mag
    assert describe(mag) == {"method": "magcache", "threshold": 0.1, "max_skip_steps": 3, "retention_ratio": 0.2,
                             "mag_ratios": (1.0, 0.99, 0.98), "calibrate": False}
    assert describe(None) is None


BAD = [
    ("nope", "method", "step cache method: unknown method 'nope'; known: taylor, taylorseer, magcache, first-block"),
    ({"threshold": 1}, "method", "step cache method: is required; known: taylor, taylorseer, magcache, first-block"),
    ({"method": 3}, "method", "step cache method: must be a string, got 3"),
    (5, "method", "step cache method: must be a string or an object, got 5"),
    ("off:interval=2", "method", "step cache method: off takes no knobs, got 'interval=2'"),
    ("first-block:thresh=1", "thresh", "step cache thresh: is not a knob of first-block; its knobs: threshold"),
    ({"method": "taylor", "speed": 2}, "speed", "step cache speed: is not a knob of taylor; its knobs: interval, "
     "order, first_enhance, first_enhance_steps, tailing_enhance, tailing_enhance_steps, low_freqs_order, "
     "high_freqs_order"),
    ("taylor:interval", "interval", "step cache interval: needs a value (interval=...)"),
    ("taylor:interval=x", "interval", "step cache interval: must be an integer, got 'x'"),
    ("taylor:interval=0", "interval", "step cache interval: must be >= 1, got 0"),
    ({"method": "taylor", "interval": 2.5}, "interval", "step cache interval: must be an integer, got 2.5"),
    ("taylor:order=5", "order", f"step cache order: must be >= 0 and <= {MAX_TAYLOR_ORDER}, got 5"),
    ("taylor:low_freqs_order=-1", "low_freqs_order", "step cache low_freqs_order: must be >= 0 and <= 4, got -1"),
    ("taylor:first_enhance=maybe", "first_enhance", "step cache first_enhance: must be true or false, got 'maybe'"),
    ({"method": "taylor", "tailing_enhance": 1}, "tailing_enhance",
     "step cache tailing_enhance: must be true or false, got 1"),
    ("taylor:first_enhance_steps=-2", "first_enhance_steps", "step cache first_enhance_steps: must be >= 0, got -2"),
    ("taylorseer:disable_before=0", "disable_before", "step cache disable_before: must be >= 1, got 0"),
    ("taylorseer:disable_after=-1", "disable_after", "step cache disable_after: must be >= 0, got -1"),
    ("taylorseer:order=9", "order", "step cache order: must be >= 0 and <= 4, got 9"),
    ("taylorseer:factors_dtype=int8", "factors_dtype",
     "step cache factors_dtype: must be one of ['bfloat16', 'float16', 'float32'], got 'int8'"),
    ("first-block:threshold=-0.1", "threshold", "step cache threshold: must be >= 0, got -0.1"),
    ("first-block:threshold=abc", "threshold", "step cache threshold: must be a number, got 'abc'"),
    ("first-block:threshold=nan", "threshold", "step cache threshold: must be a number, got nan"),
    ("magcache", "mag_ratios", "step cache mag_ratios: are required (they depend on the model): give the per-step "
     "ratios, or calibrate=true once to measure them"),
    ("magcache:mag_ratios=1/0/1", "mag_ratios", "step cache mag_ratios: must be a non-empty list of positive numbers"),
    ("magcache:mag_ratios=1/x", "mag_ratios", "step cache mag_ratios: must be numbers separated by '/', got '1/x'"),
    ({"method": "magcache", "mag_ratios": 1.0}, "mag_ratios", "step cache mag_ratios: must be a list of numbers, "
     "got 1.0"),
    ("magcache:calibrate=true,max_skip_steps=-1", "max_skip_steps", "step cache max_skip_steps: must be >= 0, got -1"),
    ("magcache:calibrate=true,retention_ratio=1.5", "retention_ratio",
     "step cache retention_ratio: must be >= 0 and <= 1, got 1.5"),
]


@pytest.mark.parametrize("spec, knob, message", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_every_bad_knob_is_one_line_naming_it(spec, knob, message):
    with pytest.raises(StepCacheError) as e:
        parse_step_cache(spec)
    assert e.value.knob == knob and str(e.value) == message and "\n" not in str(e.value)


def test_a_config_built_by_hand_is_checked_when_used():
    with pytest.raises(StepCacheError, match="step cache interval: must be >= 1, got 0"):
        make_step_cache(TaylorConfig(interval=0), 10)
    with pytest.raises(StepCacheError, match="unknown method"):
        step_cache_config("teacache")
    assert make_step_cache(None, 10) is None
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        make_step_cache(FirstBlockConfig(), 0)


# ---- schedules ------------------------------------------------------------------------------
def test_taylor_plan_follows_the_official_counter():
    # interval 3, first-enhance 2 steps, tailing 1: full at 0, 1 (enhance), 3 (counter), 6, 9 (tail)
    plan = taylor_plan(TaylorConfig(interval=3, first_enhance=True, first_enhance_steps=2, tailing_enhance=True), 10)
    assert [p.full for p in plan] == [True, True, False, False, True, False, False, True, False, True]
    # the first enhance step but the last updates nothing (official: update from step n-1 on)
    assert [p.update for p in plan if p.full] == [False, True, True, True, True]
    assert [p.distance for p in plan] == [0, 0, 1, 2, 0, 1, 2, 0, 1, 0]       # cached: since the last full
    assert [p.spacing for p in plan if p.full] == [0, 1, 3, 3, 2]            # full: since the one before
    # derivatives filled: after step 1 one factor (order 0), after step 4 two, then three (order 2)
    assert [p.order for p in plan if not p.full] == [0, 0, 1, 1, 2]


def test_taylorseer_plan_is_diffusers_hook_schedule():
    """diffusers' TaylorSeerCacheHook._measure_should_compute, driven step by step."""
    from diffusers.hooks.hooks import CacheContext, StateManager
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook, TaylorSeerState
    for interval, before, after, steps in ((5, 3, None, 30), (2, 1, None, 9), (3, 4, 7, 12), (1, 0, None, 4)):
        manager = StateManager(TaylorSeerState, init_kwargs={})
        manager.set_context(CacheContext("cond"))
        hook = TaylorSeerCacheHook(interval, before, torch.float32, manager, after)
        want = [hook._measure_should_compute()[0] for _ in range(steps)]
        config = TaylorSeerConfig(interval=interval, disable_before=before, disable_after=after)
        assert [p.full for p in taylorseer_plan(config, steps)] == want, (interval, before, after)


def test_magcache_plan_and_interpolation_are_diffusers():
    from diffusers.hooks.mag_cache import nearest_interp
    from dtgen.step_cache import _nearest_interp
    ratios = torch.tensor([1.0, 0.99, 0.95, 1.02, 0.9])
    for n in (1, 3, 5, 8, 28):
        assert torch.equal(_nearest_interp(ratios, n), nearest_interp(ratios, n))
    config = MagCacheConfig(threshold=0.05, max_skip_steps=2, retention_ratio=0.2,
                            mag_ratios=(1.0, 0.99, 0.99, 0.98, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0))
    # retained 0-1; then skips while the summed |1 - product| <= 0.05 and at most 2 in a row
    assert [p.full for p in magcache_plan(config, 10)] == [True, True, False, False, True, True, False, False, True,
                                                           False]
    assert all(p.full for p in magcache_plan(MagCacheConfig(calibrate=True), 5))


# ---- synthetic denoisers --------------------------------------------------------------------
def poly(coeffs, k):
    """Rows whose value at step k is sum c_i k^i (float64, [B, S, D])."""
    return sum(c * k ** i for i, c in enumerate(coeffs))


def poly_call(coeffs, k, runs):
    """Full steps return (hidden, 2 * hidden); head doubles: the prediction shows what the cache kept."""
    def full():
        runs.append(k)
        x = poly(coeffs, k)
        return x, 2 * x
    return DenoiserCall(head=lambda h: 2 * h, full=full)


def _coeffs(order, shape=(2, 12, 3), seed=0):
    """Multiples of 1/8: a line's values and differences stay exact in float32 factors."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-16, 17, shape, generator=g).double() / 8 for _ in range(order + 1)]


@pytest.mark.parametrize("config", [TaylorSeerConfig(interval=3, disable_before=2, order=1, factors_dtype="float32"),
                                    TaylorSeerConfig(interval=3, disable_before=2, order=2, factors_dtype="float32"),
                                    TaylorConfig(interval=3, order=2)], ids=["taylorseer-1", "taylorseer-2", "taylor"])
def test_taylor_extrapolation_of_a_line_is_exact(config):
    """Order >= 1 extrapolates a line exactly (the official code's FFT-free path in float32 too)."""
    coeffs = _coeffs(1)
    cache, runs = make_step_cache(config, 12), []
    plan = list(cache.plan)
    for k in range(12):
        out = run_step(cache, k, poly_call(coeffs, k, runs))
        if plan[k].full or plan[k].order >= 1:
            torch.testing.assert_close(out, 2 * poly(coeffs, k), rtol=0, atol=0)
    assert runs == cache.report()["full_steps"] and len(runs) < 12
    assert sum(not p.full and p.order >= 1 for p in plan) >= 3


def test_taylor_extrapolation_of_a_quadratic_has_its_closed_form():
    """x(k) = a + b k + c k^2, full steps at k - s' - s, k - s, k: the backward differences are
    D1 = b + c (2k - s), D2 = c (s + s') / s, so the sum at distance d is
    x(k + d) - c s d + c d^2 (s' - s) / (2 s) (what the official code and diffusers compute);
    to float32 rounding (the factors' dtype), D2 = 5c/3 having no exact binary value."""
    coeffs = _coeffs(2)
    config = TaylorSeerConfig(interval=3, disable_before=1, order=2, factors_dtype="float32")
    cache, runs = make_step_cache(config, 13), []
    plan = taylorseer_plan(config, 13)
    checked = []
    for k in range(13):
        out = run_step(cache, k, poly_call(coeffs, k, runs))
        p = plan[k]
        if p.full or p.order < 2:
            continue
        last = k - p.distance
        s, d = plan[last].spacing, p.distance
        s_prev = plan[last - s].spacing
        c = coeffs[2]
        want = poly(coeffs, k) - c * s * d + c * d * d * (s_prev - s) / (2 * s)
        torch.testing.assert_close(out, 2 * want, rtol=1e-6, atol=1e-6)
        checked.append((s, s_prev))
    assert (3, 2) in checked and (3, 3) in checked   # unequal spacings, then equal ones


def test_taylorseer_factors_in_bfloat16_as_diffusers():
    """Default factors_dtype: the factors stored in bfloat16, the sum in the output's dtype."""
    x0, x1 = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    cache = TaylorCache(TaylorSeerConfig(interval=2, disable_before=2, order=1), 3)
    cache.update(x0, 0)
    cache.update(x1, 1)
    assert [f.dtype for f in cache.factors[0]] == [torch.bfloat16, torch.bfloat16]
    d1 = (x1 - x0.bfloat16().float()) / 1
    want = torch.zeros_like(x1) + x1.bfloat16().float() * 1.0 + d1.bfloat16().float() * 1.0
    assert torch.equal(cache.predict(1), want)


def test_magcache_reuses_the_residual_of_all_blocks():
    steps, runs = 6, []
    config = MagCacheConfig(threshold=1.0, max_skip_steps=1, retention_ratio=0.0, mag_ratios=(1.0,) * 6)
    cache = make_step_cache(config, steps)
    h = [torch.full((1, 3, 2), float(k), dtype=torch.float64) for k in range(steps)]
    r = [torch.full((1, 3, 2), 10.0 * (k + 1), dtype=torch.float64) for k in range(steps)]
    last = None
    for k in range(steps):
        def blocks(x, lo, hi, k=k):
            runs.append((k, lo, hi))
            return x + r[k]
        out = run_step(cache, k, DenoiserCall(head=lambda x: x, embed=lambda k=k: h[k], blocks=blocks, num_blocks=4))
        full = cache.plan[k].full
        last = k if full else last
        torch.testing.assert_close(out, h[k] + r[last], rtol=0, atol=0)
    assert [p.full for p in cache.plan] == [True, False, True, False, True, False]
    assert runs == [(0, 0, 4), (2, 0, 4), (4, 0, 4)]


def test_magcache_calibration_ratios_per_row():
    cache = MagCache(MagCacheConfig(calibrate=True), 3)
    for k in range(3):   # row 0's residual norms grow 2x a step, row 1's 3x
        r = torch.stack([torch.full((4, 5), 2.0 ** k), torch.full((4, 5), 3.0 ** k)])
        run_step(cache, k, DenoiserCall(head=lambda x: x, embed=lambda: torch.zeros(2, 4, 5),
                                        blocks=lambda x, lo, hi, r=r: x + r, num_blocks=2))
    report = cache.report()
    assert report["mag_ratios_rows"] == [[1.0, 1.0], pytest.approx([2.0, 3.0]), pytest.approx([2.0, 3.0])]
    assert report["mag_ratios"] == [row[0] for row in report["mag_ratios_rows"]]


class Blocks:
    """Block 0 adds head[k] (its residual), the others tail[k]; logs what ran. `by_row`: the
    call can run the blocks on some rows only (`row_blocks`)."""

    def __init__(self, head, tail, by_row=False):
        self.head, self.tail, self.log, self.by_row = head, tail, [], by_row

    def call(self, k, h):
        def blocks(x, lo, hi, rows=None):
            self.log.append((k, lo, hi) if rows is None else (k, lo, hi, rows))
            pick = (lambda t: t) if rows is None else (lambda t: t[rows])
            return x + (pick(self.head[k]) if lo == 0 else 0) + (pick(self.tail[k]) if hi > 1 else 0)
        return DenoiserCall(head=lambda x: x, embed=lambda: h, blocks=blocks, num_blocks=3,
                            row_blocks=blocks if self.by_row else None)


@pytest.mark.parametrize("by_row", [False, True], ids=["every-row", "row-blocks"])
def test_first_block_decides_per_row_and_keeps_the_skipping_row(by_row):
    """Row 0's block-0 residual barely moves, row 1's moves a lot at step 1: row 0 reuses the
    other blocks' residual of step 0, row 1 gets its fresh one: the output is per-row exact.
    With `row_blocks` the other blocks run on the row that needs them only."""
    steps, shape = 3, (1, 4, 2)
    h = torch.zeros(2, *shape[1:], dtype=torch.float64)
    base = torch.ones(shape, dtype=torch.float64)
    head = [torch.cat([base, base]), torch.cat([1.01 * base, 2 * base]), torch.cat([1.5 * base, 2.01 * base])]
    tail = [torch.full((2, *shape[1:]), 100.0 * (k + 1), dtype=torch.float64) for k in range(steps)]
    b = Blocks(head, tail, by_row)
    cache = make_step_cache(FirstBlockConfig(threshold=0.1), steps)
    outs = [run_step(cache, k, b.call(k, h)) for k in range(steps)]
    report = cache.report()
    rest = [(1, 1, 3, [1]), (2, 1, 3, [0])] if by_row else [(1, 1, 3), (2, 1, 3)]
    assert b.log == [(0, 0, 1), (0, 1, 3), (1, 0, 1), rest[0], (2, 0, 1), rest[1]]
    # step 1: row 0 moved 1%, row 1 100%; step 2: row 0 50% (vs step 0), row 1 0.5% (vs step 1)
    assert report["full_rows"] == [[True, True], [False, True], [True, False]]
    assert report["full_steps"] == [0, 1, 2] and report["cached_steps"] == []
    assert report["first_block_diff"][0] == [None, None]
    assert report["first_block_diff"][1] == pytest.approx([0.01, 1.0]) and \
        report["first_block_diff"][2] == pytest.approx([0.5, 0.005])
    torch.testing.assert_close(outs[1], torch.stack([head[1][0] + tail[0][0], head[1][1] + tail[1][1]]))
    torch.testing.assert_close(outs[2], torch.stack([head[2][0] + tail[2][0], head[2][1] + tail[1][1]]))
    # all rows skip: the other blocks do not run at all
    b2 = Blocks([head[0], head[0], head[0]], tail)
    cache = make_step_cache(FirstBlockConfig(threshold=0.1), steps)
    outs = [run_step(cache, k, b2.call(k, h)) for k in range(steps)]
    assert b2.log == [(0, 0, 1), (0, 1, 3), (1, 0, 1), (2, 0, 1)]
    assert cache.report()["cached_steps"] == [1, 2]
    torch.testing.assert_close(outs[2], head[0] + tail[0])


def test_first_block_measure_in_the_residual_dtype():
    """diffusers' measure: each mean in the residual's dtype (bfloat16 here), the quotient too."""
    g = torch.Generator().manual_seed(1)
    r0, r1 = torch.randn(1, 64, 32, generator=g).bfloat16(), torch.randn(1, 64, 32, generator=g).bfloat16()
    moved, before = FirstBlockCache._row_means([r1 - r0, r0], None)
    assert moved.dtype == torch.bfloat16
    want = (r1 - r0).abs().mean() / r0.abs().mean()
    assert float(moved[0] / before[0]) == float(want)


def test_steps_come_in_order_and_caches_do_not_outlive_a_request():
    cache, runs = make_step_cache(TaylorSeerConfig(interval=2, disable_before=1), 3), []
    coeffs = _coeffs(1)
    with pytest.raises(RuntimeError, match="step 1 after step -1; steps must come in order"):
        run_step(cache, 1, poly_call(coeffs, 1, runs))
    for k in range(3):
        run_step(cache, k, poly_call(coeffs, k, runs))
    assert cache.factors == [[]]   # dropped after the last step
    with pytest.raises(RuntimeError, match="all 3 steps are done"):
        run_step(cache, 3, poly_call(coeffs, 3, runs))
    assert torch.equal(run_step(None, 0, poly_call(coeffs, 0, runs)), 2 * poly(coeffs, 0))


# ---- reports --------------------------------------------------------------------------------
def test_reports_merge_call_sites_and_concatenate_denoisers():
    plan = TaylorSeerConfig(interval=2, disable_before=1)
    a, b = make_step_cache(plan, 4), make_step_cache(plan, 4)
    coeffs = _coeffs(1)
    for cache in (a, b):
        for k in range(4):
            run_step(cache, k, poly_call(coeffs, k, []))
    merged = merged_report([a, None, b])
    assert merged["full_steps"] == [0, 2] and merged["cached_steps"] == [1, 3] and "call_sites" not in merged
    assert merged["taylor_order"] == [-1, 0, -1, 1] and merged["config"]["method"] == "taylorseer"
    assert merged_report([None]) is None
    # two denoisers in turn (Wan2.2-A14B's experts): steps renumbered, each part kept
    both = concat_reports([(0, merged), (4, merged)], 8)
    assert both["full_steps"] == [0, 2, 4, 6] and both["cached_steps"] == [1, 3, 5, 7]
    assert [s["first_step"] for s in both["segments"]] == [0, 4] and both["steps"] == 8
    assert concat_reports([(0, merged)], 4) is merged and concat_reports([(0, None)], 4) is None
    # first-block call sites that decide differently: each one's report, the union of full steps
    h = torch.zeros(1, 2, 2)
    x, y = Blocks([h + 1] * 3, [h] * 3), Blocks([h + 1, h + 5, h + 5], [h] * 3)
    c1, c2 = make_step_cache(FirstBlockConfig(), 3), make_step_cache(FirstBlockConfig(), 3)
    for k in range(3):
        run_step(c1, k, x.call(k, h))
        run_step(c2, k, y.call(k, h))
    merged = merged_report([c1, c2])
    assert [r["full_steps"] for r in merged["call_sites"]] == [[0], [0, 1]]
    assert merged["full_steps"] == [0, 1] and merged["cached_steps"] == [2]


# ---- rows over sequence-parallel ranks (2 gloo ranks) --------------------------------------
LENGTH = 7   # odd: rank 1 holds 3 real rows and one padding row


def job_rows(ctx):
    import torch.distributed as dist

    from dtgen.collectives import all_gather
    layout = SequenceLayout(dist.group.WORLD, ctx.world_size, ctx.rank)
    rows = RowLayout(layout, 1, LENGTH)
    g = torch.Generator().manual_seed(5)
    whole = torch.randn(2, LENGTH, 6, generator=g)
    prev = torch.randn(2, LENGTH, 6, generator=g)
    local = layout.shard(whole, 1)
    out = {"whole_equal": torch.equal(rows.whole(local), whole),
           "real_rows": rows.real_rows(local).shape[1],
           "sum": rows.sum(rows.real_rows(local).sum((1, 2))),
           "means": [m.tolist() for m in FirstBlockCache._row_means([local, layout.shard(prev, 1)], rows)],
           "ratios": MagCache._ratios(local, layout.shard(prev, 1), rows)}
    # the FFT split over every rank's rows, handed back as this rank's rows
    taylor = TaylorCache(TaylorConfig(low_freqs_order=2, high_freqs_order=1), 5)
    low, high = taylor._bands(local, rows)
    want_low, want_high = fft_bands(whole.float(), 1)
    out["bands"] = [float((low - layout.shard(want_low, 1)).abs().max()),
                    float((high - layout.shard(want_high, 1)).abs().max())]
    # a whole official Taylor run (unequal band orders) on sharded rows: this rank's share of
    # the single-process predictions
    coeffs = _coeffs(2, shape=(2, LENGTH, 3), seed=2)
    config = TaylorConfig(interval=3, order=2, low_freqs_order=2, high_freqs_order=1)
    sharded, single = make_step_cache(config, 8), make_step_cache(config, 8)
    err = 0.0
    for k in range(8):
        x = poly(coeffs, k).float()
        call = DenoiserCall(head=lambda h: h, full=lambda x=x: (layout.shard(x, 1),) * 2, rows=rows)
        mine = run_step(sharded, k, call)
        ref = run_step(single, k, DenoiserCall(head=lambda h: h, full=lambda x=x: (x, x)))
        err = max(err, float((mine - layout.shard(ref, 1)).abs().max()))
    out["taylor_err"] = err
    # first-block decisions of one row per rank, gathered into the whole call's report
    h = torch.zeros(1, 4, 2)
    blocks = Blocks([h + 1, h + 1.01 + ctx.rank, h + 1.02 + ctx.rank], [h] * 3)
    cache = make_step_cache(FirstBlockConfig(threshold=0.1), 3)
    for k in range(3):
        run_step(cache, k, blocks.call(k, h))
    cache.gather_rows(lambda t: all_gather(t, 0, dist.group.WORLD))
    out["fbc"] = cache.report()
    mag = MagCache(MagCacheConfig(calibrate=True), 2)
    for k in range(2):
        r = torch.full((1, 3, 2), (2.0 + ctx.rank) ** k)
        run_step(mag, k, DenoiserCall(head=lambda x: x, embed=lambda: torch.zeros(1, 3, 2),
                                      blocks=lambda x, lo, hi, r=r: x + r, num_blocks=2))
    mag.gather_rows(lambda t: all_gather(t, 0, dist.group.WORLD))
    out["mag"] = mag.report()["mag_ratios_rows"]
    return out


def test_rows_over_two_ranks_equal_the_whole_sequence():
    g = torch.Generator().manual_seed(5)
    whole = torch.randn(2, LENGTH, 6, generator=g)
    prev = torch.randn(2, LENGTH, 6, generator=g)
    want_means = [m.tolist() for m in FirstBlockCache._row_means([whole, prev], None)]
    want_ratios = MagCache._ratios(whole, prev, None)
    with RankPool(2, timeout_s=60) as pool:
        got = pool.run(job_rows)
    for rank, r in enumerate(got):
        assert r["whole_equal"] and r["real_rows"] == (4, 3)[rank]
        torch.testing.assert_close(r["sum"], whole.sum((1, 2)), rtol=1e-6, atol=1e-5)
        for a, b in zip(r["means"], want_means):
            assert a == pytest.approx(b, rel=1e-6)
        assert r["ratios"] == pytest.approx(want_ratios, rel=1e-6)
        assert max(r["bands"]) < 1e-6 and r["taylor_err"] < 1e-5, r
        assert r["fbc"]["full_rows"] == [[True, True], [False, True], [False, False]]
        assert r["fbc"]["full_steps"] == [0, 1] and r["fbc"]["first_block_diff"][0] == [None, None]
        assert r["fbc"]["first_block_diff"][2] == pytest.approx([0.02, 0.01 / 2.01])
        assert r["mag"] == [[1.0, 1.0], pytest.approx([2.0, 3.0])]
