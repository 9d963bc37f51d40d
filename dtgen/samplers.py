"""Flow-matching samplers: multistep UniPC (bh2) and Euler, step-for-step equal to diffusers.

A sampler is a plain object built for one (steps, shift): its tables are computed once, and
`step(model_output, sample)` advances one step, keeping its own multistep history. Use:

    sampler = make_sampler("unipc", steps=50, shift=3.0)
    for t in sampler.timesteps:                     # exactly what diffusers hands the model
        v = cfg(model(latents, t))                  # flow velocity (noise - x0), any dtype
        latents = sampler.step(v, latents)

- `timesteps` [steps]: the model's timestep input. UniPC: int64, trunc(1000 * sigma).
  Euler: float32, 1000 * sigma.
- `sigmas` [steps + 1], float32, from ~1 down to 0 (the last one is 0).
- `reset()` rewinds to step 0 for a new trajectory with the same tables.

The arithmetic reproduces diffusers' dtypes (as WanPipeline runs them on CUDA: float32
latents, bf16 model output), bit for bit on CPU and CUDA:
- UniPC: x0 = sample - sigma * v with sigma float32 and the product rounded to v's dtype;
  everything after that is float32, and samples come back float32 (a non-float32 sample is
  upcast). The scalar coefficients are float32 ops in diffusers' order, on the samples' device.
- Euler: dt = sigma_next - sigma in float32, then rounded to v's dtype, dt * v rounded to
  v's dtype, added to the float32 sample, and the result returned in v's dtype (so with a bf16
  model the latents become bf16 after the first step, as in diffusers).
Pass `model_output.float()` to keep the whole update in float32 instead.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


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


def _shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching time shift, in the dtype of `sigmas`."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _check_step(index: int, steps: int, model_output: torch.Tensor, sample: torch.Tensor) -> None:
    if index >= steps:
        raise RuntimeError(f"all {steps} steps are done; call reset() to start a new trajectory")
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output shape {tuple(model_output.shape)} != sample shape {tuple(sample.shape)}")


class FlowEulerSampler:
    """diffusers' FlowMatchEulerDiscreteScheduler(shift=shift) (static shift, num_train_timesteps 1000).

    Its schedule is not dtgen.schedulers.flow_match_sigmas: diffusers spaces `steps` points
    from 1 down to the training table's smallest sigma, shift(1/1000), and shifts them again
    before appending 0 (the smallest one is shifted twice); flow_match_sigmas shifts
    linspace(1, 0, steps + 1) once. The step is the same x + (sigma_next - sigma) * v, but
    with diffusers' dtypes (see the module docstring) rather than euler_step's all-float32.
    """

    def __init__(self, steps: int, shift: float, num_train_timesteps: int = 1000):
        _check(steps, shift, num_train_timesteps)
        self.steps, self.shift = steps, shift
        n = num_train_timesteps
        # The training table's sigma range, float32 as diffusers builds it in __init__.
        sigma_max = float(_shift(torch.tensor(n, dtype=torch.float32) / n, shift))
        sigma_min = float(_shift(torch.tensor(1, dtype=torch.float32) / n, shift))
        sigmas = _shift(_linspace(sigma_max * n, sigma_min * n, steps) / n, shift).float()
        self.timesteps = sigmas * n
        self.sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
        self.reset()

    def reset(self) -> None:
        self.index = 0

    def step(self, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        i = self.index
        _check_step(i, self.steps, model_output, sample)
        dt = self.sigmas[i + 1] - self.sigmas[i]  # float32, as diffusers
        # diffusers computes `dt * model_output`: torch rounds the float32 0-dim dt to the model
        # output's dtype first (on CPU and CUDA alike), then rounds the product to it.
        dt = float(dt.to(model_output.dtype))
        self.index += 1
        return (sample.float() + model_output * dt).to(model_output.dtype)


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
        sigmas = _shift(_linspace(1.0, 1.0 / n, steps + 1)[:-1], shift)  # float64
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
