"""Step caches: fewer full denoiser evaluations per image, one mechanism for every model.

A model cuts one denoiser evaluation where a cache may reuse it (`DenoiserCall`):

    embed() -> h          the blocks' input rows (patch tokens, timestep rows, ...)
    blocks(h, lo, hi)     blocks lo..hi-1 on those rows
    head(x) -> prediction the final layer on the blocks' output (always runs, at the current t)

and may give `full()`: the whole evaluation as one (compiled) call returning both the blocks'
output and the prediction. What the model declares as "the blocks' output" is what the caches
keep: for HunyuanImage-3 the decoder stack's output rows that every KV-cached step returns
(`<timestep>`, any other conditioning rows, the image), for Wan the last block's tokens.

The framework owns the rest:
- the schedule: which steps run the blocks ("full") and which reuse them ("cached"). Every
  method but first-block decides it from the step index alone, before the first step
  (`StepCache.plan`), so a cached step waits on nothing: no host sync, no data-dependent branch;
- the state: one `StepCache` per request and call site (a CFG branch run on its own is a call
  site; rows of one call are extrapolated independently). A request builds new ones, so
  nothing survives into the next request (the official implementation keeps its cache on the
  model object). Requests batched as rows of one call keep one each: `run_step_batch` runs
  the call's pieces once for every row and each cache decides and updates for its request's
  rows alone (`StepCache.run_rows`; a cache called on its own is the batch of one);
- the report (`StepCache.report()`): which steps ran in full, which were reused, and how;
  `merged_report` joins a request's call sites, `concat_reports` the denoisers that run one
  after another (Wan2.2-A14B's two experts, each with caches of its own), `gather_rows` the
  rows of one call split over CFG-parallel ranks (first-block decides per row).

| method | a cached step computes | decided | follows |
|---|---|---|---|
| `taylor` | head(Taylor extrapolation of the blocks' output), two FFT bands | ahead | HunyuanImage-3.0's `cache_utils.py` (`--use-taylor-cache`) |
| `taylorseer` | head(Taylor extrapolation), one band | ahead | `diffusers.hooks.taylorseer_cache`, hooks on every block |
| `magcache` | head(embed() + the last full step's residual of all blocks) | ahead, from magnitude ratios | `diffusers.hooks.mag_cache` |
| `first-block` | head(block 0's output + the last full step's residual of the other blocks) | at the step, per row, from block 0's residual | `diffusers.hooks.first_block_cache` |

Configs parse from text (`parse_step_cache("taylor:interval=5,order=2")`, the CLI's and the
server's form) or a dict; a bad knob raises `StepCacheError` naming it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from .collectives import all_reduce_sum
from .sequence import SequenceLayout

# The highest Taylor order accepted: the official code takes any, but the extrapolation's
# d^i / i! terms explode past a few orders (the published setting is 2).
MAX_TAYLOR_ORDER = 4


class StepCacheError(ValueError):
    """A bad step-cache setting; `knob` names it (a CLI flag or request field maps from it)."""

    def __init__(self, knob: str, message: str):
        self.knob, self.message = knob, message
        super().__init__(f"step cache {knob}: {message}")


# ----------------------------------------------------------------------------------------
# Configs (one per method; frozen, so a request can carry one)
# ----------------------------------------------------------------------------------------
def _int(knob: str, value, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StepCacheError(knob, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        raise StepCacheError(knob, f"must be >= {low}" + (f" and <= {high}" if high is not None else "")
                             + f", got {value}")


def _number(knob: str, value, low: float, high: float | None = None, low_ok: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise StepCacheError(knob, f"must be a number, got {value!r}")
    if value < low or (value == low and not low_ok) or (high is not None and value > high):
        raise StepCacheError(knob, f"must be {'>=' if low_ok else '>'} {low:g}"
                             + (f" and <= {high:g}" if high is not None else "") + f", got {value:g}")


def _bool(knob: str, value) -> None:
    if not isinstance(value, bool):
        raise StepCacheError(knob, f"must be true or false, got {value!r}")


@dataclass(frozen=True)
class TaylorConfig:
    """HunyuanImage-3.0's official Taylor cache, with its command line's knobs and defaults
    (`run_image_gen.py --use-taylor-cache --taylor-cache-*`).

    A full step every `interval` steps (counting from the last full one); the first
    `first_enhance_steps` and the last `tailing_enhance_steps` steps always full when enabled.
    Full steps refresh recursive finite differences of the blocks' output over the step index,
    split into a low and a high FFT band along the token axis (orders `low_freqs_order` and
    `high_freqs_order`, both capped by `order`); cached steps sum the Taylor series at their
    distance from the last full step. (With first-enhance off the official code crashes at
    step 1; here the derivatives come from the rows later steps return, the golden's fix P1.)
    """

    method: ClassVar[str] = "taylor"
    interval: int = 5
    order: int = 2
    first_enhance: bool = False
    first_enhance_steps: int = 3
    tailing_enhance: bool = False
    tailing_enhance_steps: int = 1
    low_freqs_order: int = 2
    high_freqs_order: int = 2

    def check(self) -> None:
        _int("interval", self.interval, 1)
        for knob in ("order", "low_freqs_order", "high_freqs_order"):
            _int(knob, getattr(self, knob), 0, MAX_TAYLOR_ORDER)
        _bool("first_enhance", self.first_enhance)
        _bool("tailing_enhance", self.tailing_enhance)
        _int("first_enhance_steps", self.first_enhance_steps, 0)
        _int("tailing_enhance_steps", self.tailing_enhance_steps, 0)

    def band_orders(self) -> tuple[int, int]:
        """(low, high): the official container stores the low band only up to one order past
        the high band's (it stops at the first order the high band lacks)."""
        high = min(self.high_freqs_order, self.order)
        return min(self.low_freqs_order, self.order, high + 1), high


@dataclass(frozen=True)
class TaylorSeerConfig:
    """diffusers' TaylorSeerCacheConfig with its hooks on every transformer block: the blocks'
    output extrapolated over the step index (one band). Knobs keep diffusers' meaning:
    full steps before `disable_before` (`disable_cache_before_step`), then every `interval`-th
    (`(step - disable_before - 1) % interval == 0`), and from `disable_after` on
    (`disable_cache_after_step`); `order` is `max_order`; the factors are stored in
    `factors_dtype` (`taylor_factors_dtype`, bfloat16 there by default)."""

    method: ClassVar[str] = "taylorseer"
    interval: int = 5
    disable_before: int = 3
    disable_after: int | None = None
    order: int = 1
    factors_dtype: str = "bfloat16"

    def check(self) -> None:
        _int("interval", self.interval, 1)
        # Step 0 must run in full: there is nothing to extrapolate from (diffusers raises there).
        _int("disable_before", self.disable_before, 1 if self.interval > 1 else 0)
        if self.disable_after is not None:
            _int("disable_after", self.disable_after, 0)
        _int("order", self.order, 0, MAX_TAYLOR_ORDER)
        if self.factors_dtype not in _DTYPES:
            raise StepCacheError("factors_dtype", f"must be one of {sorted(_DTYPES)}, got {self.factors_dtype!r}")


@dataclass(frozen=True)
class MagCacheConfig:
    """diffusers' MagCacheConfig: skip while the accumulated error of the magnitude ratios stays
    under `threshold` (at most `max_skip_steps` in a row, none in the first `retention_ratio`
    of the steps); a skipped step adds the last full step's residual of all blocks to the
    blocks' input. `mag_ratios` are the model's per-step ratios (interpolated to the step count
    as diffusers does); `calibrate=True` never skips and reports the ratios of this run."""

    method: ClassVar[str] = "magcache"
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: tuple[float, ...] | None = None
    calibrate: bool = False

    def check(self) -> None:
        _number("threshold", self.threshold, 0.0, low_ok=True)
        _int("max_skip_steps", self.max_skip_steps, 0)
        _number("retention_ratio", self.retention_ratio, 0.0, 1.0, low_ok=True)
        _bool("calibrate", self.calibrate)
        if self.mag_ratios is None and not self.calibrate:
            raise StepCacheError("mag_ratios", "are required (they depend on the model): give the per-step ratios, "
                                               "or calibrate=true once to measure them")
        if self.mag_ratios is not None:
            if not self.mag_ratios or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0
                                              for r in self.mag_ratios):
                raise StepCacheError("mag_ratios", "must be a non-empty list of positive numbers")


@dataclass(frozen=True)
class FirstBlockConfig:
    """diffusers' FirstBlockCacheConfig: run block 0; if its residual moved by at most
    `threshold` (mean |r - r_prev| / mean |r_prev|, r_prev that of the last full step) skip the
    other blocks and add their residual from the last full step."""

    method: ClassVar[str] = "first-block"
    threshold: float = 0.05

    def check(self) -> None:
        _number("threshold", self.threshold, 0.0, low_ok=True)


StepCacheConfig = TaylorConfig | TaylorSeerConfig | MagCacheConfig | FirstBlockConfig
CONFIGS: dict[str, type] = {c.method: c for c in (TaylorConfig, TaylorSeerConfig, MagCacheConfig, FirstBlockConfig)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step_cache_config(method: str, **knobs) -> StepCacheConfig:
    """The config of `method` with `knobs` (unknown ones refused by name), checked."""
    if method not in CONFIGS:
        raise StepCacheError("method", f"unknown method {method!r}; known: {', '.join(CONFIGS)}")
    cls = CONFIGS[method]
    names = [f.name for f in dataclasses.fields(cls)]
    for knob in knobs:
        if knob not in names:
            raise StepCacheError(knob, f"is not a knob of {method}; its knobs: {', '.join(names)}")
    if "mag_ratios" in knobs and knobs["mag_ratios"] is not None:
        if not isinstance(knobs["mag_ratios"], (list, tuple)):
            raise StepCacheError("mag_ratios", f"must be a list of numbers, got {knobs['mag_ratios']!r}")
        knobs["mag_ratios"] = tuple(knobs["mag_ratios"])
    config = cls(**knobs)
    config.check()
    return config


def _parse_value(knob: str, text: str, kind):
    text = text.strip()
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise StepCacheError(knob, f"must be true or false, got {text!r}")
    if text.lower() == "none":
        return None
    try:
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise StepCacheError(knob, f"must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if kind == "ratios":
        try:
            return tuple(float(v) for v in text.split("/") if v)
        except ValueError:
            raise StepCacheError(knob, f"must be numbers separated by '/', got {text!r}") from None
    return text


def parse_step_cache(spec) -> StepCacheConfig | None:
    """A config from "METHOD[:knob=value,...]" (mag_ratios as values separated by '/'), from a
    dict {"method": ..., knobs...}, or None / "none" / "off" (no cache)."""
    if spec is None or isinstance(spec, (TaylorConfig, TaylorSeerConfig, MagCacheConfig, FirstBlockConfig)):
        return spec
    if isinstance(spec, dict):
        knobs = dict(spec)
        method = knobs.pop("method", None)
        if method is None:
            raise StepCacheError("method", f"is required; known: {', '.join(CONFIGS)}")
        if not isinstance(method, str):
            raise StepCacheError("method", f"must be a string, got {method!r}")
        return step_cache_config(method, **knobs)
    if not isinstance(spec, str):
        raise StepCacheError("method", f"must be a string or an object, got {spec!r}")
    method, _, rest = spec.strip().partition(":")
    if method in ("none", "off", ""):
        if rest:
            raise StepCacheError("method", f"{method or 'an empty method'} takes no knobs, got {rest!r}")
        return None
    if method not in CONFIGS:
        raise StepCacheError("method", f"unknown method {method!r}; known: {', '.join(CONFIGS)}")
    kinds = {f.name: f.type for f in dataclasses.fields(CONFIGS[method])}
    knobs = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        knob, eq, value = item.partition("=")
        knob = knob.strip().replace("-", "_")
        if not eq:
            raise StepCacheError(knob, f"needs a value ({knob}=...)")
        if knob not in kinds:
            raise StepCacheError(knob, f"is not a knob of {method}; its knobs: {', '.join(kinds)}")
        kind = kinds[knob]
        kind = ("ratios" if "tuple" in kind else bool if kind == "bool" else int if kind.startswith("int")
                else float if kind == "float" else str)
        knobs[knob] = _parse_value(knob, value, kind)
    return step_cache_config(method, **knobs)


def describe(config: StepCacheConfig | None) -> dict | None:
    """The config as a JSON-able dict ({"method": ..., knobs...}), for reports."""
    if config is None:
        return None
    return {"method": config.method, **dataclasses.asdict(config)}


# ----------------------------------------------------------------------------------------
# What a model supplies
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowLayout:
    """Where the rows of the blocks' output live: dim `dim` of every tensor holds this rank's
    chunk of `length` real rows laid out by `layout` (a phase's `SequenceLayout`; padding rows
    past `length`). Methods that need whole rows (the FFT band split) or means over them
    (first-block, magcache calibration) gather or reduce through it."""

    layout: SequenceLayout
    dim: int
    length: int

    def real_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's real rows of `x` (its padding rows dropped)."""
        per_rank = self.layout.padded_length(self.length) // self.layout.size
        start = self.layout.rank * per_rank
        keep = max(0, min(self.length - start, per_rank))
        return x.narrow(self.dim, 0, keep)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        return self.layout.gather(x, self.dim, self.length)

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        return self.layout.shard(whole, self.dim)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over every rank's share (each rank passes its partial sums)."""
        if self.layout.size == 1:
            return x
        return all_reduce_sum(x, self.layout.group)


@dataclass
class DenoiserCall:
    """One denoiser evaluation, cut where a step cache may reuse it (see the module docstring).

    `full` (optional): the whole evaluation as one call returning (blocks' output, prediction),
    e.g. one compiled graph; without it the cache composes embed, blocks and head.
    `rows`: where the blocks' output rows live under sequence parallelism (None: all here).
    `row_blocks` (optional): `blocks` for some batch rows only, `row_blocks(h, lo, hi, rows)`
    with h holding just the rows `rows` (indices into the call's batch), so that a first-block
    step where only some rows (CFG branches) run in full computes only those, as separate
    calls per branch would; without it such a step runs the blocks on every row.
    `predict` (optional): the prediction alone as one call (one compiled graph), what a step
    without a cache runs; without it, the full evaluation's prediction.
    """

    head: Callable[[torch.Tensor], torch.Tensor]
    full: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    embed: Callable[[], torch.Tensor] | None = None
    blocks: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    num_blocks: int = 0
    rows: RowLayout | None = None
    row_blocks: Callable[[torch.Tensor, int, int, list[int]], torch.Tensor] | None = None
    predict: Callable[[], torch.Tensor] | None = None

    def run_full(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.full is not None:
            return self.full()
        h = self.blocks(self.embed(), 0, self.num_blocks)
        return h, self.head(h)

    def prediction(self) -> torch.Tensor:
        """The whole evaluation's prediction, where no cache needs the blocks' output."""
        return self.predict() if self.predict is not None else self.run_full()[1]


def _split(x: torch.Tensor, rows: list[int] | None) -> list[torch.Tensor]:
    """Each request's rows of a shared call's tensor (dim 0); `rows` None: one request owns all."""
    return [x] if rows is None else list(x.split(rows))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The requests' rows as one call's tensor (the one request's own tensor when alone)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# ----------------------------------------------------------------------------------------
# The caches
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepPlan:
    """What a cache does at one step (decided ahead; first-block decides `full` at the step)."""

    full: bool | None
    update: bool = False   # taylor: this full step refreshes the derivatives
    spacing: int = 0       # taylor: steps since the last full step (the finite differences' step)
    distance: int = 0      # taylor: steps since the last full step, at a cached step
    order: int = -1        # taylor: the highest order a cached step sums


class StepCache:
    """One request's cache at one call site. `__call__(step, call)` returns the prediction of
    step `step` (steps come in order, 0 first); `report()` says what each step did.

    A call may hold the rows of several requests (a batch of requests of one config), each
    with its own cache: `run_rows(caches, step, call, rows)` runs the call's pieces once for
    every row and each cache decides and keeps state for its request's rows alone, as if it
    ran alone. A cache called on its own is the batch of one: there is one implementation."""

    method: str = ""

    def __init__(self, config: StepCacheConfig, steps: int):
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        self.config, self.steps = config, steps
        self.plan: list[StepPlan] = []
        self.full_steps: list[bool] = []      # what each step did, as it runs
        self._next = 0

    def _advance(self, step: int) -> None:
        if step != self._next:
            raise RuntimeError(f"step cache: step {step} after step {self._next - 1}; steps must come in order")
        if step >= self.steps:
            raise RuntimeError(f"step cache: all {self.steps} steps are done")
        self._next += 1

    def __call__(self, step: int, call: DenoiserCall) -> torch.Tensor:
        return type(self).run_rows([self], step, call, None)

    @classmethod
    def run_rows(cls, caches: list["StepCache"], step: int, call: DenoiserCall,
                 rows: list[int] | None) -> torch.Tensor:
        """Step `step` of a call whose consecutive batch rows `rows[k]` are request k's, each
        request with its cache `caches[k]` (all of this class and one config); `rows` None:
        one cache owning every row. Returns the prediction of every row."""
        raise NotImplementedError

    def gather_rows(self, gather: Callable[[torch.Tensor], torch.Tensor], device=None) -> None:
        """For a call whose rows are split over ranks, each rank with its own cache (a CFG-
        parallel plan: one branch per rank): make this report the whole call's. `gather`
        concatenates every rank's [rows, ...] tensor along dim 0 in row order (a collective:
        every rank calls it, after the last step). Nothing to do where the schedule is decided
        ahead: it is the same on every rank."""

    def report(self) -> dict:
        full = [i for i, f in enumerate(self.full_steps) if f]
        return {"method": self.method, "steps": self.steps, "full_steps": full,
                "cached_steps": [i for i, f in enumerate(self.full_steps) if not f]}


# ---- Taylor (official and diffusers' TaylorSeer) -------------------------------------------
def taylor_plan(config: TaylorConfig, steps: int) -> list[StepPlan]:
    """The official schedule (cache_utils.py): counter c, last full step l, filled orders."""
    low, high = config.band_orders()
    orders = (high,) if low == high else (low, high)
    plan, c, last, filled = [], 0, 0, [0] * len(orders)
    for k in range(steps):
        full = (k == 0 or c == config.interval - 1
                or (config.first_enhance and k < config.first_enhance_steps)
                or (config.tailing_enhance and k >= steps - config.tailing_enhance_steps))
        if full:
            c = 0
            update = not (config.first_enhance and k < config.first_enhance_steps - 1)
            if update:
                filled = [min(n + 1, o + 1) for n, o in zip(filled, orders)]
            plan.append(StepPlan(True, update, k - last))
            last = k
        else:
            c += 1
            plan.append(StepPlan(False, distance=c, order=max(filled) - 1))
    return plan


def taylorseer_plan(config: TaylorSeerConfig, steps: int) -> list[StepPlan]:
    """diffusers' TaylorSeerCacheHook._measure_should_compute, every full step an update."""
    plan, last, filled = [], None, 0
    for k in range(steps):
        full = (k < config.disable_before or (k - config.disable_before - 1) % config.interval == 0
                or (config.disable_after is not None and k >= config.disable_after))
        if full:
            filled = min(filled + 1, config.order + 1)
            plan.append(StepPlan(True, True, 0 if last is None else k - last))
            last = k
        else:
            plan.append(StepPlan(False, distance=k - last, order=filled - 1))
    return plan


def fft_bands(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The official split along `dim`: |f| <= 0.1 max|f| (fftfreq) is the low band."""
    n = x.shape[dim]
    f = torch.fft.fftfreq(n, device=x.device).abs()
    low = (f <= 0.1 * f.max()).to(torch.complex64 if x.dtype != torch.float64 else torch.complex128)
    shape = [1] * x.dim()
    shape[dim] = n
    low = low.view(shape)
    spectrum = torch.fft.fft(x, dim=dim)
    return torch.fft.ifft(spectrum * low, dim=dim).real, torch.fft.ifft(spectrum * (1 - low), dim=dim).real


class TaylorCache(StepCache):
    """Recursive finite differences of the blocks' output, per band; a cached step sums
    D_i * d^i / i! at distance d and runs the head on it.

    Official arithmetic (`taylor`): factors in float32 whatever the model's dtype (the FFT
    needs it; bf16 differences would lose the small terms), per band `out += (1/i!) * D_i * d^i`,
    then low + high; with equal band orders the split is a no-op and is skipped. diffusers'
    (`taylorseer`): factors stored in `factors_dtype`, differences taken in the output's
    dtype, `out = out + D_i * (d^i / i!)` from zeros in the output's dtype.
    """

    def __init__(self, config: TaylorConfig | TaylorSeerConfig, steps: int):
        super().__init__(config, steps)
        self.method = config.method
        if isinstance(config, TaylorConfig):
            low, high = config.band_orders()
            self.orders = (high,) if low == high else (low, high)
            self.plan = taylor_plan(config, steps)
            self.factors_dtype = torch.float32
        else:
            self.orders = (config.order,)
            self.plan = taylorseer_plan(config, steps)
            self.factors_dtype = _DTYPES[config.factors_dtype]
        self.factors: list[list[torch.Tensor]] = [[] for _ in self.orders]
        self.out_dtype: torch.dtype | None = None

    def _bands(self, x: torch.Tensor, rows: RowLayout | None) -> list[torch.Tensor]:
        if len(self.orders) == 1:
            return [x]
        x = x.float()
        if rows is None:
            return list(fft_bands(x, 1))
        low, high = fft_bands(rows.whole(x), rows.dim)   # the FFT spans every rank's rows
        return [rows.local(low), rows.local(high)]

    def update(self, x: torch.Tensor, spacing: int, rows: RowLayout | None = None) -> None:
        self.out_dtype = x.dtype
        official = self.method == "taylor"
        for b, xb in enumerate(self._bands(x, rows)):
            old = self.factors[b]
            new = [xb.float() if official else xb]
            for i in range(self.orders[b]):
                if i >= len(old) or old[i].shape != new[i].shape:
                    break
                new.append((new[i] - old[i].to(new[i].dtype)) / spacing)
            self.factors[b] = [d.to(self.factors_dtype) for d in new]

    def predict(self, distance: int) -> torch.Tensor:
        if self.method == "taylor":
            out = None
            for band in self.factors:
                acc = 0
                for i, d in enumerate(band):
                    acc = acc + (1 / math.factorial(i)) * d * distance ** i
                out = acc if out is None else out + acc
            return out.to(self.out_dtype)
        factors = self.factors[0]
        out = torch.zeros_like(factors[0], dtype=self.out_dtype)
        for i, d in enumerate(factors):
            out = out + d.to(self.out_dtype) * (distance ** i / math.factorial(i))
        return out

    @classmethod
    def run_rows(cls, caches: list["TaylorCache"], step: int, call: DenoiserCall,
                 rows: list[int] | None) -> torch.Tensor:
        for cache in caches:
            cache._advance(step)
        p = caches[0].plan[step]   # one config, one plan: every request does the same at this step
        for cache in caches:
            cache.full_steps.append(p.full)
        if p.full:
            hidden, out = call.run_full()
            if p.update:
                for cache, h in zip(caches, _split(hidden, rows)):
                    cache.update(h, p.spacing, call.rows)
        else:
            out = call.head(_joined([cache.predict(p.distance) for cache in caches]))
        if step == caches[0].steps - 1:
            for cache in caches:   # as the official code: dropped after the last step
                cache.factors = [[] for _ in cache.orders]
        return out

    def report(self) -> dict:
        r = super().report()
        r["taylor_order"] = [p.order for p in self.plan]
        r["taylor_distance"] = [p.distance for p in self.plan]
        r["derivative_update"] = [bool(p.full and p.update) for p in self.plan]
        r["band_orders"] = list(self.orders)
        return r


# ---- MagCache ----------------------------------------------------------------------------
def _nearest_interp(ratios: torch.Tensor, length: int) -> torch.Tensor:
    """diffusers' mag_cache.nearest_interp."""
    if length == 1:
        return ratios[-1:]
    scale = (len(ratios) - 1) / (length - 1)
    return ratios[torch.round(torch.arange(length, dtype=torch.float32) * scale).long()]


def magcache_plan(config: MagCacheConfig, steps: int) -> list[StepPlan]:
    """diffusers' MagCacheHeadHook decisions, in its float32 0-d tensor arithmetic (its ratios are
    a float32 tensor, so the accumulators become float32 tensors once multiplied)."""
    if config.calibrate:
        return [StepPlan(True) for _ in range(steps)]
    ratios = torch.tensor(config.mag_ratios, dtype=torch.float32)
    if len(ratios) != steps:
        ratios = _nearest_interp(ratios, steps)
    retention = int(config.retention_ratio * steps + 0.5)
    acc_ratio, acc_err, acc_steps, have_residual = 1.0, 0.0, 0, False
    plan = []
    for k in range(steps):
        full = True
        if k >= retention:
            scale = ratios[k] if k < len(ratios) else 1.0
            acc_ratio = acc_ratio * scale
            acc_steps += 1
            acc_err = acc_err + abs(1.0 - acc_ratio)
            if have_residual and acc_err <= config.threshold and acc_steps <= config.max_skip_steps:
                full = False
            else:
                acc_ratio, acc_steps, acc_err = 1.0, 0, 0.0
        have_residual = have_residual or full
        plan.append(StepPlan(full))
    return plan


class MagCache(StepCache):
    """diffusers' MagCache: a skipped step runs the head on embed() plus the residual of all the
    blocks at the last full step (`magcache_plan` decides which, ahead). With `calibrate`, every
    step runs in full and records each row's magnitude ratio (diffusers' per-branch
    calibration: a CFG row here is a `cache_context` there)."""

    method = "magcache"

    def __init__(self, config: MagCacheConfig, steps: int):
        super().__init__(config, steps)
        self.plan = magcache_plan(config, steps)
        self.residual: torch.Tensor | None = None
        self.ratios: list[list[float]] = []   # calibration, per step, per row: ||r_k|| / ||r_{k-1}||

    @classmethod
    def run_rows(cls, caches: list["MagCache"], step: int, call: DenoiserCall,
                 rows: list[int] | None) -> torch.Tensor:
        for cache in caches:
            cache._advance(step)
        full = caches[0].plan[step].full   # one config, one plan
        for cache in caches:
            cache.full_steps.append(full)
        h = call.embed()
        if not full:
            return call.head(h + _joined([cache.residual for cache in caches]))
        x = call.blocks(h, 0, call.num_blocks)
        last = step == caches[0].steps - 1
        for cache, residual in zip(caches, _split(x - h, rows)):
            if cache.config.calibrate:
                cache.ratios.append([1.0] * residual.shape[0] if cache.residual is None
                                    else cache._ratios(residual, cache.residual, call.rows))
            cache.residual = None if last else residual
        return call.head(x)

    @staticmethod
    def _ratios(current: torch.Tensor, previous: torch.Tensor, rows: RowLayout | None) -> list[float]:
        """Per batch row: the mean over its tokens of ||r_k|| / (||r_{k-1}|| + 1e-8), norms over
        the last dim, float32 (diffusers' `_perform_calibration_step` on each branch's call)."""
        ratio = torch.linalg.norm(current.float(), dim=-1) / (torch.linalg.norm(previous.float(), dim=-1) + 1e-8)
        if rows is None or rows.layout.size == 1:
            return [float(ratio[b].mean()) for b in range(ratio.shape[0])]
        local = rows.real_rows(ratio)
        count = torch.full((ratio.shape[0],), float(local.shape[1]), device=local.device)
        total = rows.sum(torch.stack([local.sum(1), count]))
        return (total[0] / total[1]).tolist()

    def gather_rows(self, gather: Callable[[torch.Tensor], torch.Tensor], device=None) -> None:
        if not self.config.calibrate or not self.ratios:
            return
        local = torch.tensor(self.ratios, dtype=torch.float64, device=device).T.contiguous()   # [B, steps]
        self.ratios = gather(local).T.tolist()

    def report(self) -> dict:
        r = super().report()
        if self.config.calibrate:
            # The conditional row's ratios (row 0), the list to give back as mag_ratios; every row's too.
            r["mag_ratios"] = [row[0] for row in self.ratios]
            r["mag_ratios_rows"] = self.ratios
        return r


# ---- First-block cache -------------------------------------------------------------------
class FirstBlockCache(StepCache):
    """Per row of the call: block 0 always runs; the other blocks run when block 0's residual
    moved by more than the threshold since the row's last full step. Where the rows disagree,
    the other blocks run on the rows that need them (`DenoiserCall.row_blocks`; without it on
    every row, the skipping rows keeping their cached result): what separate calls per row
    would compute. The decision costs one host sync per step (diffusers' too).

    The measure is diffusers' (`FBCHeadBlockHook._should_compute_remaining_blocks`, one CFG
    branch per call there, one row here): mean |r - r_prev| / mean |r_prev|, each mean in the
    residual's dtype (float32 accumulation rounded to it, as torch's `.mean()`), the quotient
    in that dtype too; under sequence parallelism the sums span every rank's real rows."""

    method = "first-block"

    def __init__(self, config: FirstBlockConfig, steps: int):
        super().__init__(config, steps)
        self.plan = [StepPlan(None) for _ in range(steps)]
        self.head_residual: torch.Tensor | None = None   # block 0's residual at each row's last full step
        self.tail_residual: torch.Tensor | None = None   # the other blocks' residual then
        self.row_full: list[list[bool]] = []             # per step, per row
        self.row_diff: list[list[float | None]] = []     # per step, per row: the measure (None: no previous)

    @staticmethod
    def _row_means(xs: list[torch.Tensor], rows: RowLayout | None) -> list[torch.Tensor]:
        """For each x [B, ...]: [B] in x's dtype, mean |x| of each batch row over its real
        elements (every rank's; one all-reduce for all of them)."""
        if rows is None or rows.layout.size == 1:
            # Exactly the reduction diffusers runs on one branch's tensor.
            return [torch.stack([x[b].abs().mean() for b in range(x.shape[0])]) for x in xs]
        parts = []
        for x in xs:
            local = rows.real_rows(x)
            parts += [local.float().abs().flatten(1).sum(1),
                      torch.full((x.shape[0],), float(local[0].numel()), device=x.device)]
        total = rows.sum(torch.stack(parts))
        return [(total[2 * i] / total[2 * i + 1]).to(x.dtype) for i, x in enumerate(xs)]

    @classmethod
    def run_rows(cls, caches: list["FirstBlockCache"], step: int, call: DenoiserCall,
                 rows: list[int] | None) -> torch.Tensor:
        """Each row decides alone (its measure, its residuals), so the requests' rows decide
        as one call's rows would: the other blocks run once, on every row that needs them."""
        for cache in caches:
            cache._advance(step)
        h = call.embed()
        h1 = call.blocks(h, 0, 1)
        r = h1 - h
        B = r.shape[0]
        counts = [B] if rows is None else rows
        # Every request of a call starts at step 0 together: all have residuals, or none.
        first = caches[0].head_residual is None
        if any((cache.head_residual is None) != first for cache in caches):
            raise RuntimeError("first-block cache: the requests of one call are at different steps")
        head = None if first else _joined([cache.head_residual for cache in caches])
        tail = None if first else _joined([cache.tail_residual for cache in caches])
        if first:
            rows_full, diffs = [True] * B, [None] * B
        else:
            moved, before = cls._row_means([r - head, head], call.rows)
            diffs = (moved / before).tolist()
            rows_full = [d > caches[0].config.threshold for d in diffs]
        lo = 0
        for cache, n in zip(caches, counts):
            cache.row_full.append(rows_full[lo:lo + n])
            cache.row_diff.append(diffs[lo:lo + n])
            cache.full_steps.append(any(rows_full[lo:lo + n]))
            lo += n
        if not any(rows_full):
            out = call.head(h1 + tail)
        elif not all(rows_full) and call.row_blocks is not None:
            picked = [b for b, f in enumerate(rows_full) if f]
            index = torch.tensor(picked, device=h1.device)
            h1_picked = h1.index_select(0, index)
            x_picked = call.row_blocks(h1_picked, 1, call.num_blocks, picked)
            x = (h1 + tail).index_copy(0, index, x_picked)
            head = head.index_copy(0, index, r.index_select(0, index))
            tail = tail.index_copy(0, index, x_picked - h1_picked)
            out = call.head(x)
        else:
            x = call.blocks(h1, 1, call.num_blocks)
            fresh = x - h1
            if all(rows_full):
                head, tail = r, fresh
            else:
                keep = torch.tensor(rows_full, device=x.device).view(B, *[1] * (x.dim() - 1))
                x = torch.where(keep, x, h1 + tail)
                head = torch.where(keep, r, head)
                tail = torch.where(keep, fresh, tail)
            out = call.head(x)
        last = step == caches[0].steps - 1   # nothing outlives the request
        for cache, h_res, t_res in zip(caches, _split(head, rows), _split(tail, rows)):
            cache.head_residual, cache.tail_residual = (None, None) if last else (h_res, t_res)
        return out

    def gather_rows(self, gather: Callable[[torch.Tensor], torch.Tensor], device=None) -> None:
        nan = float("nan")
        local = torch.tensor([[[float(f) for f in full], [nan if d is None else d for d in diff]]
                              for full, diff in zip(self.row_full, self.row_diff)], dtype=torch.float64,
                             device=device)                              # [steps, 2, B]
        every = gather(local.permute(2, 1, 0).contiguous()).permute(2, 1, 0).tolist()   # [steps, 2, B_all]
        self.row_full = [[bool(f) for f in full] for full, _ in every]
        self.row_diff = [[None if d != d else d for d in diff] for _, diff in every]
        self.full_steps = [any(full) for full in self.row_full]

    def report(self) -> dict:
        r = super().report()
        r["full_rows"] = self.row_full
        r["first_block_diff"] = self.row_diff
        return r


def make_step_cache(config: StepCacheConfig | None, steps: int) -> StepCache | None:
    """A fresh cache for one request's call site (None: no cache)."""
    if config is None:
        return None
    config.check()
    if isinstance(config, (TaylorConfig, TaylorSeerConfig)):
        return TaylorCache(config, steps)
    if isinstance(config, MagCacheConfig):
        return MagCache(config, steps)
    if isinstance(config, FirstBlockConfig):
        return FirstBlockCache(config, steps)
    raise TypeError(f"not a step cache config: {config!r}")


def run_step(cache: StepCache | None, step: int, call: DenoiserCall) -> torch.Tensor:
    """The prediction of one step: through the cache, or in full without one."""
    if cache is None:
        return call.prediction()
    return cache(step, call)


def run_step_batch(caches: list[StepCache | None], step: int, call: DenoiserCall, rows: list[int]) -> torch.Tensor:
    """The prediction of one step of a call shared by several requests (rows of one batch):
    request k owns `rows[k]` consecutive batch rows (in order) and its own cache `caches[k]`
    (one per request and call site, as ever; all None, or all of one config: what a batch
    of requests must share). The call's pieces run once for every row (embed, the blocks,
    the head, a first-block step's row subset), and each cache decides and keeps state for
    its request's rows as if it ran alone (`StepCache.run_rows`). Returns every row's
    prediction, in batch order. The batch of one is `run_step` on the call itself."""
    if len(caches) != len(rows):
        raise ValueError(f"{len(caches)} caches and {len(rows)} row counts: one each per request")
    if len(caches) == 1:
        return run_step(caches[0], step, call)
    first = caches[0]
    if first is None:
        if any(c is not None for c in caches):
            raise ValueError("the requests of one call must all have a step cache or none")
        return call.prediction()
    if any(c is None or c.config != first.config or c.steps != first.steps for c in caches):
        raise ValueError("the requests of one call must share one step-cache config and step count")
    return type(first).run_rows(caches, step, call, rows)


def run_step_shared(caches: list[StepCache | None], step: int, call: DenoiserCall, rows: list[int],
                    heads: list[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """The prediction of one step of a call shared by several requests (rows of one batch):
    request k owns `rows[k]` consecutive batch rows (in order), its own cache `caches[k]` (one
    per request and call site, as ever) and its own head `heads[k]` (the head on its rows).

    Each cache decides for its request as if it ran alone: it sees a view of the call whose
    `full()` is the shared evaluation's rows of that request, computed at most once per step
    (the first cache that asks runs it for every row), and whose head runs on its rows only.
    Caches decided ahead with one config (every request of a batch has the same) agree on
    every step, so a cached step runs no shared evaluation at all. Returns the predictions of
    every row, in batch order. The batch of one is `run_step` on the call itself."""
    if len(caches) != len(rows) or len(heads) != len(rows):
        raise ValueError(f"{len(caches)} caches, {len(heads)} heads and {len(rows)} row counts: one each per request")
    shared: list[tuple[torch.Tensor, torch.Tensor]] = []

    def full_rows(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not shared:
            shared.append(call.run_full())
        hidden, out = shared[0]
        return hidden[lo:hi], out[lo:hi]

    outs, lo = [], 0
    for cache, n, head in zip(caches, rows, heads):
        view = DenoiserCall(head=head, full=lambda lo=lo, hi=lo + n: full_rows(lo, hi), rows=call.rows)
        outs.append(run_step(cache, step, view))
        lo += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def concat_reports(parts: list[tuple[int, dict | None]], steps: int) -> dict | None:
    """One report for a request whose `steps` run on several denoisers in turn, each with its
    own caches (Wan2.2-A14B's two experts): `parts` are (the denoiser's first step, its
    `merged_report`). The step lists are renumbered to the request's; `segments` keeps each
    part's own report (its step numbers count from its first step)."""
    parts = [(first, r) for first, r in parts if r is not None]
    if not parts:
        return None
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][1]["steps"] == steps:
        return parts[0][1]
    full = sorted(first + s for first, r in parts for s in r["full_steps"])
    return {"method": parts[0][1]["method"], "steps": steps, "full_steps": full,
            "cached_steps": [s for s in range(steps) if s not in full], "config": parts[0][1]["config"],
            "segments": [{"first_step": first, **r} for first, r in parts]}


def merged_report(caches: list[StepCache | None]) -> dict | None:
    """One report for a request's call sites (e.g. serial CFG branches): their shared schedule,
    and each site's own where they differ (first-block)."""
    caches = [c for c in caches if c is not None]
    if not caches:
        return None
    reports = [c.report() for c in caches]
    merged = dict(reports[0])
    if any(r != reports[0] for r in reports[1:]):
        merged["call_sites"] = reports
        merged["full_steps"] = sorted(set().union(*(r["full_steps"] for r in reports)))
        merged["cached_steps"] = [s for s in range(caches[0].steps) if s not in merged["full_steps"]]
    merged["config"] = describe(caches[0].config)
    return merged
