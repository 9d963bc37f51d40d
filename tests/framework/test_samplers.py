"""dtgen.layers.flow_match's samplers against diffusers' schedulers driven as WanPipeline and
QwenImagePipeline drive them, bit for bit: sigmas, timesteps and every step's sample.

The references are diffusers' UniPCMultistepScheduler as Wan's checkpoints configure it (and
as diffusers' scripts/convert_wan_to_diffusers.py writes it), FlowMatchEulerDiscreteScheduler(shift),
and FlowMatchEulerDiscreteScheduler with Qwen-Image's scheduler_config.json (dynamic shift, mu
from the image token count, shift_terminal) set as QwenImagePipeline sets it: `retrieve_timesteps`
with sigmas linspace(1, 1/steps) and mu from `calculate_shift`.
Trajectories use a deterministic fake model with classifier-free guidance combined as WanPipeline
does: noise_uncond + guidance_scale * (noise_pred - noise_uncond).
"""
import numpy as np
import pytest
import torch

from dtgen.layers.flow_match import DynamicShiftSampler, FlowEulerSampler, UniPCFlowSampler, make_sampler
from models.qwen_image.tiny import tiny_configs

SHIFTS = (3.0, 5.0)          # Wan: 3.0 for 480p, 5.0 for 720p
TABLE_SHIFTS = (1.0, 2.0, 3.0, 5.0, 8.0, 12.0)
STEPS = (1, 2, 3, 10, 50)
TABLE_STEPS = (1, 2, 3, 4, 10, 20, 25, 30, 40, 50)
GUIDANCE = 5.0
QWEN_SCHEDULER = tiny_configs()["scheduler"]    # Qwen/Qwen-Image's scheduler_config.json
# Image sizes (height, width) in pixels; Qwen-Image has 16 px a token (VAE 8 x patch 2).
QWEN_SIZES = ((64, 48), (512, 512), (1024, 1024), (1328, 1328), (928, 1664), (1664, 928), (2048, 2048))
QWEN_STEPS = (2, 3, 4, 8, 20, 28, 50)


def _unipc_reference(shift, cuda_promotion=False, solver_order=2):
    diffusers = pytest.importorskip("diffusers")

    class CudaPromotion(diffusers.UniPCMultistepScheduler):
        """diffusers computes x0 = sample - sigma_t * model_output with sigma_t a CPU 0-dim
        float32 tensor. On CUDA that is a CPU scalar and stays float32; on CPU, torch rounds the
        first operand to bf16 before multiplying. This keeps the CUDA rounding (what a GPU run
        does) for bf16 outputs on CPU; test_cuda_matches_diffusers checks the real thing."""

        def convert_model_output(self, model_output, *args, sample=None, **kwargs):
            return sample - model_output * self.sigmas[self.step_index]

    cls = CudaPromotion if cuda_promotion else diffusers.UniPCMultistepScheduler
    return cls(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
               flow_shift=shift, solver_order=solver_order)


def _euler_reference(shift):
    diffusers = pytest.importorskip("diffusers")
    return diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)


def _qwen_reference(config, steps, image_seq_len):
    """The scheduler with `config` after QwenImagePipeline's own set-up for `steps` and the token
    count: sigmas linspace(1, 1/steps), mu from calculate_shift, through retrieve_timesteps."""
    diffusers = pytest.importorskip("diffusers")
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
    ref = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    mu = calculate_shift(image_seq_len, ref.config.get("base_image_seq_len", 256),
                         ref.config.get("max_image_seq_len", 4096), ref.config.get("base_shift", 0.5),
                         ref.config.get("max_shift", 1.15))
    retrieve_timesteps(ref, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return ref, mu


def _assert_same_tables(mine, ref):
    """sigmas and timesteps equal bit for bit, dtypes included."""
    assert mine.sigmas.dtype == ref.sigmas.dtype and mine.timesteps.dtype == ref.timesteps.dtype
    assert torch.equal(mine.sigmas, ref.sigmas), (mine.sigmas - ref.sigmas).abs().max()
    assert torch.equal(mine.timesteps, ref.timesteps), (mine.timesteps - ref.timesteps).abs().max()


def _fake_model(x, t):
    """(cond, uncond) flow velocities: fixed functions of the sample and the timestep."""
    s = t.float() / 1000
    cond = 0.9 * x + 0.3 * torch.sin(2 * x + s) * (1 + s)
    uncond = 0.8 * x + 0.2 * torch.cos(3 * x - s)
    return cond, uncond


def _trajectory(step, timesteps, x, model_dtype):
    """Every intermediate sample of a CFG run, the model evaluated in model_dtype."""
    out = []
    for t in timesteps:
        noise_pred, noise_uncond = _fake_model(x.to(model_dtype), t)
        x = step(noise_uncond + GUIDANCE * (noise_pred - noise_uncond), x, t)
        out.append(x)
    return out


def _compare(ref, mine, steps, model_dtype=torch.float32, device="cpu", set_timesteps=True):
    """Drive both from the same noise; every intermediate sample equal (dtype and values): bit
    for bit on CPU; on CUDA to 1e-6 (the bound test_cuda_matches_diffusers has been run with).
    `set_timesteps` False: `ref` is already set up (on `device`)."""
    if set_timesteps:
        ref.set_timesteps(steps, device=device)
    ref.set_begin_index(0)
    assert torch.equal(mine.timesteps, ref.timesteps.cpu())
    x = torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0)).to(device)
    want = _trajectory(lambda v, x, t: ref.step(v, t, x, return_dict=False)[0], ref.timesteps, x, model_dtype)
    got = _trajectory(lambda v, x, t: mine.step(v, x), ref.timesteps, x, model_dtype)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.device == w.device, (i, g.dtype, w.dtype)
        if g.device.type == "cpu":
            assert torch.equal(g, w), f"step {i}: max |diff| {float((g.float() - w.float()).abs().max())}"
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=lambda m: f"step {i}: {m}")
    return got


def test_wan_unipc_configuration():
    """The scheduler settings UniPCFlowSampler implements are diffusers' defaults for Wan."""
    c = _unipc_reference(3.0).config
    assert (c.solver_order, c.solver_type, c.predict_x0, c.lower_order_final) == (2, "bh2", True, True)
    assert (c.final_sigmas_type, c.timestep_spacing, c.num_train_timesteps) == ("zero", "linspace", 1000)
    assert (c.prediction_type, c.use_flow_sigmas, list(c.disable_corrector)) == ("flow_prediction", True, [])
    assert not (c.use_karras_sigmas or c.use_exponential_sigmas or c.use_beta_sigmas or c.thresholding)
    assert not (c.use_dynamic_shifting or c.shift_terminal or c.solver_p)


@pytest.mark.parametrize("shift", TABLE_SHIFTS)
@pytest.mark.parametrize("steps", TABLE_STEPS)
def test_unipc_tables_match_diffusers(shift, steps):
    ref = _unipc_reference(shift)
    ref.set_timesteps(steps)
    mine = make_sampler("unipc", steps, shift)
    assert mine.timesteps.dtype == torch.int64 and mine.sigmas.dtype == torch.float32
    _assert_same_tables(mine, ref)


@pytest.mark.parametrize("shift", TABLE_SHIFTS)
@pytest.mark.parametrize("steps", TABLE_STEPS)
def test_euler_tables_match_diffusers(shift, steps):
    ref = _euler_reference(shift)
    ref.set_timesteps(steps)
    mine = make_sampler("euler", steps, shift)
    assert mine.timesteps.dtype == torch.float32 and mine.sigmas.dtype == torch.float32
    _assert_same_tables(mine, ref)


@pytest.mark.parametrize("size", QWEN_SIZES, ids=lambda hw: "x".join(map(str, hw)))
@pytest.mark.parametrize("steps", QWEN_STEPS)
def test_qwen_image_tables_match_diffusers(steps, size):
    """Qwen-Image's dynamic shift: mu from the token count, shift_terminal 0.02. The first sigma is
    exactly 1.0 (1000 * sigma is the timestep, which the model's embedding scales by 1000 again)."""
    tokens = (size[0] // 16) * (size[1] // 16)
    ref, mu = _qwen_reference(QWEN_SCHEDULER, steps, tokens)
    mine = DynamicShiftSampler(steps, tokens, dict(QWEN_SCHEDULER))
    assert mine.mu == mu
    _assert_same_tables(mine, ref)
    assert float(mine.sigmas[0]) == 1.0 and float(mine.timesteps[0]) == 1000.0


@pytest.mark.parametrize("overrides", [
    {"time_shift_type": "linear"},
    {"shift_terminal": None},
    {"use_dynamic_shifting": False, "shift": 3.0},
    {"use_dynamic_shifting": False, "shift": 3.0, "shift_terminal": None},
    {"base_shift": 0.3, "max_shift": 1.6, "base_image_seq_len": 64, "max_image_seq_len": 4096, "shift_terminal": 0.1},
], ids=["linear", "no-terminal", "static", "static-no-terminal", "other-range"])
@pytest.mark.parametrize("steps, tokens", [(2, 12), (4, 1024), (20, 6032), (50, 4096), (30, 16384)])
def test_dynamic_shift_variants_match_diffusers(overrides, steps, tokens):
    config = {**QWEN_SCHEDULER, **overrides}
    ref, mu = _qwen_reference(config, steps, tokens)
    mine = DynamicShiftSampler(steps, tokens, config)
    assert mine.mu == mu
    _assert_same_tables(mine, ref)


def test_dynamic_shift_one_step_without_terminal_matches_diffusers():
    """One step is fine without shift_terminal (with it, diffusers' stretch is 0 / 0: refused below)."""
    config = {**QWEN_SCHEDULER, "shift_terminal": None}
    ref, _ = _qwen_reference(config, 1, 4096)
    _assert_same_tables(DynamicShiftSampler(1, 4096, config), ref)


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", (2, 10))
def test_unipc_cfg_trajectory_matches_diffusers(shift, steps):
    """steps=2: warm-up, first-order corrector, final step; 10: the second-order updates."""
    _compare(_unipc_reference(shift), UniPCFlowSampler(steps, shift), steps)


def test_unipc_first_order_matches_diffusers():
    _compare(_unipc_reference(3.0, solver_order=1), UniPCFlowSampler(10, 3.0, order=1), 10)


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("steps", (2, 10))
def test_euler_cfg_trajectory_matches_diffusers(shift, steps):
    _compare(_euler_reference(shift), FlowEulerSampler(steps, shift), steps)


@pytest.mark.parametrize("model_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("steps, tokens", [(3, 12), (10, 4096)])
def test_qwen_image_cfg_trajectory_matches_diffusers(steps, tokens, model_dtype):
    """DynamicShiftSampler.step is diffusers' Euler step on Qwen-Image's schedule."""
    ref, _ = _qwen_reference(QWEN_SCHEDULER, steps, tokens)
    got = _compare(ref, DynamicShiftSampler(steps, tokens, dict(QWEN_SCHEDULER)), steps, model_dtype,
                   set_timesteps=False)
    assert got[-1].dtype == model_dtype


def test_unipc_bf16_model_outputs_match_diffusers():
    """bf16 model output, float32 latents: sigma * v rounds to bf16, the rest is float32,
    and the samples stay float32."""
    got = _compare(_unipc_reference(5.0, cuda_promotion=True), UniPCFlowSampler(10, 5.0), 10, torch.bfloat16)
    assert got[-1].dtype == torch.float32


def test_euler_bf16_model_outputs_match_diffusers():
    """bf16 model output: dt and dt * v round to bf16, and so does the returned sample."""
    got = _compare(_euler_reference(3.0), FlowEulerSampler(10, 3.0), 10, torch.bfloat16)
    assert got[-1].dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("model_dtype", (torch.float32, torch.bfloat16))
def test_cuda_matches_diffusers(model_dtype):
    """On CUDA, against diffusers unmodified, as WanPipeline runs it (samples on the GPU)."""
    _compare(_unipc_reference(3.0), UniPCFlowSampler(10, 3.0), 10, model_dtype, "cuda")
    _compare(_euler_reference(5.0), FlowEulerSampler(10, 5.0), 10, model_dtype, "cuda")


@pytest.mark.parametrize("name", ("unipc", "euler"))
def test_reset_replays_the_same_trajectory(name):
    sampler = make_sampler(name, 3, 3.0)
    x = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    run = lambda: _trajectory(lambda v, x, t: sampler.step(v, x), sampler.timesteps, x, torch.float32)  # noqa: E731
    first = run()
    with pytest.raises(RuntimeError, match="all 3 steps are done"):
        sampler.step(x, x)
    sampler.reset()
    assert all(torch.equal(a, b) for a, b in zip(first, run()))


@pytest.mark.parametrize("call, match", [
    (lambda: make_sampler("dpm++", 10, 3.0), "unknown sampler 'dpm\\+\\+'"),
    (lambda: make_sampler("unipc", 0, 3.0), "steps must be an integer >= 1, got 0"),
    (lambda: make_sampler("euler", -2, 3.0), "steps must be an integer >= 1"),
    (lambda: make_sampler("unipc", 2.5, 3.0), "steps must be an integer >= 1"),
    (lambda: make_sampler("euler", True, 3.0), "steps must be an integer >= 1"),
    (lambda: make_sampler("unipc", 10, 0.0), "shift must be > 0"),
    (lambda: make_sampler("euler", 10, float("nan")), "shift must be > 0"),
    (lambda: UniPCFlowSampler(10, 3.0, order=3), "order must be 1 or 2"),
    (lambda: make_sampler("unipc", 10, 3.0, num_train_timesteps=0), "num_train_timesteps"),
    (lambda: make_sampler("euler", 2, 3.0).step(torch.zeros(2, 3), torch.zeros(2, 4)), "shape"),
    (lambda: DynamicShiftSampler(1, 4096, dict(QWEN_SCHEDULER)), "steps must be >= 2 with the scheduler's shift_t"),
    (lambda: DynamicShiftSampler(0, 4096, dict(QWEN_SCHEDULER)), "steps must be an integer >= 1, got 0"),
    (lambda: DynamicShiftSampler(4, 4096, {**QWEN_SCHEDULER, "use_karras_sigmas": True}), "use_karras_sigmas"),
])
def test_bad_input_is_refused_in_one_line(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
