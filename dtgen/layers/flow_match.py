"""Flow-matching sampling: schedules, the Euler step, multistep UniPC (bh2), and CFG.

Two ways to drive it, for two references:
- the functions (HunyuanImage-3's official scheduler): `flow_match_sigmas(steps, shift)` then
  `euler_step(x, v, sigma, sigma_next)` per step, all in float32;
- a sampler object (diffusers' schedulers, bit for bit: sigmas, timesteps and every step):
  built for one (steps, shift) (`DynamicShiftSampler`: steps, token count, scheduler config),
  its tables computed once, `step(model_output, sample)` advancing one step and keeping its
  own multistep history. Use:

    sampler = make_sampler("unipc", steps=50, shift=3.0)
    for t in sampler.timesteps:                     # exactly what diffusers hands the model
        v = cfg(model(latents, t))                  # flow velocity (noise - x0), any dtype
        latents = sampler.step(v, latents)

  - `timesteps` [steps]: the model's timestep input. UniPC: int64, trunc(1000 * sigma).
    Euler: float32, 1000 * sigma.
  - `sigmas` [steps + 1], float32, from ~1 down to 0 (the last one is 0).
  - `reset()` rewinds to step 0 for a new trajectory with the same tables.

The samplers reproduce diffusers' dtypes (as WanPipeline runs them on CUDA: float32
latents, bf16 model output), bit for bit on CPU and CUDA:
- UniPC: x0 = sample - sigma * v with sigma float32 and the product rounded to v's dtype;
  everything after that is float32, and samples come back float32 (a non-float32 sample is
  upcast). The scalar coefficients are float32 ops in diffusers' order, on the samples' device.
- Euler: `euler_step(..., rounding="diffusers")`: dt = sigma_next - sigma in float32, then
  rounded to v's dtype, dt * v rounded to v's dtype, added to the float32 sample, and the
  result returned in v's dtype (so with a bf16 model the latents become bf16 after the first
  step, as in diffusers).
Pass `model_output.float()` to keep the whole update in float32 instead.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

EULER_ROUNDINGS = ("float32", "diffusers")


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching time shift s*sigma / (1 + (s - 1)*sigma), in the dtype of `sigmas`."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_match_sigmas(steps: int, shift: float) -> torch.Tensor:
    """HunyuanImage-3's schedule: sigmas [steps + 1] from 1 to 0, linspace(1, 0, steps + 1) shifted
    once, in float32 with the official scheduler's ops (so 1000 * sigma is bit for bit the
    timestep it feeds). Not diffusers' (`FlowEulerSampler`)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32), shift)


def euler_step(x: torch.Tensor, velocity: torch.Tensor, sigma, sigma_next, rounding: str = "float32") -> torch.Tensor:
    """x + (sigma_next - sigma) * velocity; sigma, sigma_next float32 values (Python floats or 0-dim tensors).

    `rounding` "float32" (HunyuanImage-3's official scheduler): everything in float32, returned
    float32 (the difference of the two float32 values rounds to the float32 one the official
    scheduler multiplies by). "diffusers" (FlowMatchEulerDiscreteScheduler): dt in float32, then
    rounded to velocity's dtype, the product rounded to it, added to x in float32, returned in
    velocity's dtype.
    """
    if rounding == "float32":
        return x.float() + velocity.float() * (float(sigma_next) - float(sigma))
    if rounding != "diffusers":
        raise ValueError(f"Euler rounding must be one of {EULER_ROUNDINGS}, got {rounding!r}")
    dt = torch.as_tensor(sigma_next, dtype=torch.float32) - torch.as_tensor(sigma, dtype=torch.float32)
    # diffusers computes `dt * model_output`: torch rounds the float32 0-dim dt to the model
    # output's dtype first (on CPU and CUDA alike), then rounds the product to it.
    return (x.float() + velocity * float(dt.to(velocity.dtype))).to(velocity.dtype)


def classifier_free_guidance(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond)."""
    return v_uncond + scale * (v_cond - v_uncond)


def renormed_guidance(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's true CFG: the guided prediction, rescaled per row to the conditional
    prediction's norm over channels (its last axis)."""
    comb = classifier_free_guidance(v_cond, v_uncond, scale)
    return comb * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


# A pipeline's guidance kind (`DiffusionPipeline.guidance_kind`) -> how it combines a step's
# conditional and unconditional predictions with the request's scale.
GUIDANCE = {"cfg": classifier_free_guidance, "renormed-cfg": renormed_guidance}


def _check(steps, shift: float, num_train_timesteps: int) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    if not isinstance(num_train_timesteps, int) or num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be an integer >= 1, got {num_train_timesteps!r}")


def _linspace(start: float, stop: float, num: int) -> torch.Tensor:
    """float64 linspace computed like numpy's (start + i * step, last point = stop exactly);
    torch.linspace rounds differently, which can move a truncated timestep by one."""
    if num == 1:
        return torch.tensor([start], dtype=torch.float64)
    y = torch.arange(num, dtype=torch.float64) * ((stop - start) / (num - 1)) + start
    y[-1] = stop
    return y


def _check_step(index: int, steps: int, model_output: torch.Tensor, sample: torch.Tensor) -> None:
    if index >= steps:
        raise RuntimeError(f"all {steps} steps are done; call reset() to start a new trajectory")
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output shape {tuple(model_output.shape)} != sample shape {tuple(sample.shape)}")


class FlowEulerSampler:
    """diffusers' FlowMatchEulerDiscreteScheduler(shift=shift) (static shift, num_train_timesteps 1000).

    Its schedule is not `flow_match_sigmas`: diffusers spaces `steps` points from 1 down to the
    training table's smallest sigma, shift(1/1000), and shifts them again before appending 0
    (the smallest one is shifted twice); flow_match_sigmas shifts linspace(1, 0, steps + 1)
    once. The step is `euler_step` with diffusers' rounding.
    """

    def __init__(self, steps: int, shift: float, num_train_timesteps: int = 1000):
        _check(steps, shift, num_train_timesteps)
        self.steps, self.shift = steps, shift
        n = num_train_timesteps
        # The training table's sigma range, float32 as diffusers builds it in __init__.
        sigma_max = float(shift_sigmas(torch.tensor(n, dtype=torch.float32) / n, shift))
        sigma_min = float(shift_sigmas(torch.tensor(1, dtype=torch.float32) / n, shift))
        self._set_sigmas(shift_sigmas(_linspace(sigma_max * n, sigma_min * n, steps) / n, shift).float(), n)

    def _set_sigmas(self, sigmas: torch.Tensor, num_train_timesteps: int) -> None:
        """The `steps` float32 sigmas before the final 0; rewinds to step 0."""
        self.timesteps = sigmas * num_train_timesteps
        self.sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
        self.reset()

    def reset(self) -> None:
        self.index = 0

    def step(self, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        i = self.index
        _check_step(i, self.steps, model_output, sample)
        self.index += 1
        return euler_step(sample, model_output, self.sigmas[i], self.sigmas[i + 1], rounding="diffusers")


class DynamicShiftSampler(FlowEulerSampler):
    """FlowMatchEulerDiscreteScheduler as a diffusers `scheduler_config.json` sets it up and
    QwenImagePipeline calls it: sigmas linspace(1, 1/steps), shifted by mu (which grows linearly
    with the image's token count: `use_dynamic_shifting`) or by the static `shift`, stretched to
    end at `shift_terminal`. Its `step` is Euler's.

    Bit for bit diffusers' tables: mu in `calculate_shift`'s order of float64 ops, then every
    op in float32 as numpy does it there (a Python number rounded to float32 first, then a
    true float32 division; torch's `number / tensor` would multiply by a rounded reciprocal
    instead and move the first sigma off 1.0 by an ulp). One step with `shift_terminal` is
    refused: the stretch divides 0 by 0 there (diffusers' schedule is NaN)."""

    def __init__(self, steps: int, image_seq_len: int, config: dict):
        _check(steps, config.get("shift", 1.0), config.get("num_train_timesteps", 1000))
        for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                    "stochastic_sampling"):
            if config.get(key):
                raise ValueError(f"scheduler config: '{key}'=true is not supported")
        if steps == 1 and config.get("shift_terminal"):
            raise ValueError("steps must be >= 2 with the scheduler's shift_terminal "
                             "(one step stretches 0 / 0: diffusers' schedule is NaN)")
        base, top = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
        lo, hi = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
        slope = (hi - lo) / (top - base)                      # calculate_shift, its order of ops
        mu = image_seq_len * slope + (lo - slope * base)
        sigmas = _linspace(1.0, 1 / steps, steps).float()
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)   # noqa: E731  a Python number as numpy rounds it
        if config.get("use_dynamic_shifting", False):
            kind = config.get("time_shift_type", "exponential")
            if kind not in ("exponential", "linear"):
                raise ValueError(f"scheduler config: time_shift_type={kind!r} is not supported")
            m = f32(math.exp(mu) if kind == "exponential" else mu)
            sigmas = m / (m + (f32(1) / sigmas - 1))           # m / (m + (1/t - 1) ** 1.0)
        else:
            sigmas = shift_sigmas(sigmas, config.get("shift", 1.0))
        if config.get("shift_terminal"):
            one_minus = 1 - sigmas
            sigmas = 1 - one_minus / (one_minus[-1] / f32(1 - config["shift_terminal"]))
        self.steps, self.shift, self.mu = steps, config.get("shift", 1.0), mu
        self._set_sigmas(sigmas, config.get("num_train_timesteps", 1000))


class _Update(NamedTuple):
    """The float32 0-dim coefficients of one UniPC update from sigma s to the next sigma t:
    x_t = ratio * x - a_phi * m0 - a_b * (sum of rho * D), D the divided differences of x0."""
    order: int
    ratio: torch.Tensor   # sigma_t / sigma_s
    a_phi: torch.Tensor   # alpha_t * (e^-h - 1)
    a_b: torch.Tensor     # alpha_t * B(h), B(h) = e^-h - 1 for bh2
    rk: torch.Tensor      # (lambda_prev - lambda_s) / h, the previous point's offset (order 2)
    rhos: tuple


def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma (flow sigmas); inf at sigma = 0."""
    return torch.log(1 - sigma) - torch.log(sigma)


def _unipc_update(sigmas: torch.Tensor, s: int, order: int, corrector: bool) -> _Update:
    """The predictor (from sigmas[s] to sigmas[s + 1]) or the corrector (re-doing that same
    step once the model output at s + 1 is known). float32 0-dim ops in diffusers' order, on
    the samples' device as diffusers does them, so the coefficients are bit-identical."""
    sigma_s, sigma_t = sigmas[s], sigmas[s + 1]
    one = sigma_s.new_ones(())
    lam_s = _log_snr(sigma_s)
    h = _log_snr(sigma_t) - lam_s
    hh = -h                         # predict_x0: the exponential integrator runs in -h
    h_phi_1 = torch.expm1(hh)       # e^-h - 1
    b_h = h_phi_1                   # B(h) of UniPC-bh2 is the same e^-h - 1
    alpha_t = 1 - sigma_t
    rk = ((_log_snr(sigmas[s - 1]) - lam_s) / h) if order == 2 else one
    if not corrector:
        rhos = (0.5,) if order == 2 else ()           # UniP-2 uses rho = 1/2
    elif order == 1:
        rhos = (0.5,)                                  # UniC-1 uses rho = 1/2
    else:                                              # UniC-2: solve R rho = b
        b1 = (h_phi_1 / hh - 1) / b_h
        b2 = ((h_phi_1 / hh - 1) / hh - 0.5) * 2 / b_h
        r = torch.stack([torch.stack([one, one]), torch.stack([rk, one])])
        rhos = tuple(torch.linalg.solve(r, torch.stack([b1, b2])))
    return _Update(order, sigma_t / sigma_s, alpha_t * h_phi_1, alpha_t * b_h, rk, rhos)


class UniPCFlowSampler:
    """diffusers' UniPCMultistepScheduler as WanPipeline configures it: prediction_type
    "flow_prediction", use_flow_sigmas=True, flow_shift=shift, solver_order=2, solver_type
    "bh2", predict_x0=True, lower_order_final=True, final_sigmas_type "zero",
    timestep_spacing "linspace", num_train_timesteps 1000, corrector on every step.

    Each step: x0 = sample - sigma * v; unless it is the first step, the corrector UniC
    re-does the previous step with this x0 (the model saw the uncorrected sample); then the
    predictor UniP steps the corrected sample to the next sigma. Order is 1 on the first step
    (warm-up) and on the last (lower_order_final: the last step lands on sigma 0, where
    lambda is infinite and a second-order term would be NaN), else `order`.
    """

    def __init__(self, steps: int, shift: float, num_train_timesteps: int = 1000, order: int = 2):
        _check(steps, shift, num_train_timesteps)
        if order not in (1, 2):
            raise ValueError(f"order must be 1 or 2, got {order!r}")
        self.steps, self.shift = steps, shift
        n = num_train_timesteps
        sigmas = shift_sigmas(_linspace(1.0, 1.0 / n, steps + 1)[:-1], shift)  # float64
        if abs(float(sigmas[0]) - 1) < 1e-6:
            sigmas[0] -= 1e-6                   # keeps log(1 - sigma) finite
        self.timesteps = (sigmas * n).to(torch.int64)  # truncated, from the float64 sigmas
        self.sigmas = torch.cat([sigmas, sigmas.new_zeros(1)]).float()
        self.orders = [min(order, i + 1, steps - i) for i in range(steps)]  # warm-up, lower_order_final
        self._updates = {}     # device -> (predictors, correctors), built at the first step there
        self.reset()

    def reset(self) -> None:
        self.index = 0
        self._x0 = []          # x0 predictions, newest last (at most 2 kept)
        self._last = None      # the sample the last predictor started from

    def _updates_on(self, device: torch.device):
        """Each step's coefficients, computed once per device: diffusers computes them where
        the samples are (CPU and CUDA can round log/expm1 differently in the last bit), and
        divides by them as device tensors (by a Python float, CUDA multiplies by a reciprocal)."""
        if device not in self._updates:
            sigmas, o = self.sigmas.to(device), self.orders
            self._updates[device] = ([_unipc_update(sigmas, i, o[i], False) for i in range(self.steps)],
                                     [None] + [_unipc_update(sigmas, i - 1, o[i - 1], True)
                                               for i in range(1, self.steps)])
        return self._updates[device]

    @staticmethod
    def _apply(u: _Update, x: torch.Tensor, m0: torch.Tensor, m1, x0_t=None) -> torch.Tensor:
        """One UniP (x0_t None) or UniC update of x; m0 / m1 the newest / previous x0."""
        out = u.ratio * x - u.a_phi * m0
        corr = None
        if u.order == 2:
            corr = u.rhos[0] * ((m1 - m0) / u.rk)
        if x0_t is not None:
            d_t = u.rhos[-1] * (x0_t - m0)
            corr = d_t if corr is None else corr + d_t
        return out if corr is None else out - u.a_b * corr

    def step(self, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        i = self.index
        _check_step(i, self.steps, model_output, sample)
        predictors, correctors = self._updates_on(sample.device)
        sample = sample.float()
        # The product is rounded to model_output's dtype with sigma kept float32, as in
        # diffusers on CUDA, where its sigma is a CPU scalar (a Python float here). (diffusers
        # on CPU rounds sigma to bf16 first: torch casts a 0-dim first operand there.)
        x0 = sample - model_output * float(self.sigmas[i])
        if i > 0:
            m1 = self._x0[-2] if len(self._x0) > 1 else None
            sample = self._apply(correctors[i], self._last, self._x0[-1], m1, x0)
        self._x0 = (self._x0 + [x0])[-2:]
        self._last = sample
        m1 = self._x0[-2] if len(self._x0) > 1 else None
        self.index += 1
        return self._apply(predictors[i], sample, x0, m1)


SAMPLERS = {"unipc": UniPCFlowSampler, "euler": FlowEulerSampler}


def make_sampler(name: str, steps: int, shift: float, num_train_timesteps: int = 1000):
    """A fresh sampler by name: "unipc" (Wan's default) or "euler"."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; expected one of {sorted(SAMPLERS)}")
    return SAMPLERS[name](steps, shift, num_train_timesteps)
