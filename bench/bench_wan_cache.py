"""Wan's FirstBlockCache: dtgen against diffusers' hook, in one process on one GPU.

Both pipelines load the same diffusers-format folder, start from the same noise and prompt embeddings
(dtgen's UMT5 encodes them; diffusers is handed them) and run the same request: Wan2.1 1.3B's DiT shapes
(random weights drawn once into $DTGEN_CACHE), 480x832, 81 frames, CFG 5.0, UniPC at shift 3.0, bf16.
dtgen: `step_cache="first-block:threshold=T"` (both CFG rows one batch, per-row decisions); diffusers:
`apply_first_block_cache` on WanPipeline's transformer (cond and uncond two calls). The random time
projection is scaled by 0.01: at full scale block 0's residual moves 70-100% a step and no step would be
reused; scaled, about half are at the default threshold, as with trained weights. `--compile`: each block
compiled once in both. Per pipeline: the time per video and per full and reused step, which steps ran in
full per CFG branch, whether the decisions are equal (exit status 1 where they part: the report names the
first step, both measures and the threshold), the ratio dtgen / diffusers and the final latents' distance.
`--tiny`: CPU, float32, the tiny default. Needs diffusers 0.42.1.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.harness import Bench, need_cuda, rel_err, sync

MODULE = "bench.bench_wan_cache"
# Wan2.1-T2V-1.3B-Diffusers transformer/config.json; the text encoder is the tiny one widened
# to the DiT's text_dim (the DiT reads 4096-wide embeddings).
DIT_1_3B = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, text_dim=4096,
                freq_dim=256, in_channels=16, out_channels=16, patch_size=[1, 2, 2], cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
FOLDER_VERSION = 1
TIME_SCALE = {"transformer.condition_embedder.time_proj.": 0.01}   # see the module's docstring
PROMPT = "A red fox runs through fresh snow at golden hour, cinematic"
NEGATIVE = "blurry, low quality"


def bench_folder(device: str, layers: int) -> Path:
    """The 1.3B-shaped folder, written once (bf16 weights drawn on `device`)."""
    from dtgen.caches import cache_root, write_folder_once
    from models.wan.tiny import write_random_checkpoint
    overrides = {"transformer": {**DIT_1_3B, "num_layers": layers}, "text_encoder": {"d_model": 4096}}
    name = f"bench-wan-1.3B{'' if layers == 30 else f'-{layers}L'}-v{FOLDER_VERSION}"
    return write_folder_once(cache_root() / name, "model_index.json",
                             lambda folder: write_random_checkpoint(folder, seed=0, overrides=overrides,
                                                                    dtype=torch.bfloat16, device=device,
                                                                    scales=TIME_SCALE))


def diffusers_pipeline(folder: Path, dtype: torch.dtype, device: str):
    """diffusers' WanPipeline with the folder's DiT and scheduler (prompt embeddings are handed
    in, the latents come out: no text encoder, no VAE), the DiT in `dtype` but for the modules
    diffusers keeps in float32 (what from_pretrained(torch_dtype=...) does; this way needs no
    accelerate)."""
    import diffusers
    from safetensors.torch import load_file

    cls = diffusers.WanTransformer3DModel
    with torch.device(device):
        dit = cls.from_config(cls.load_config(folder / "transformer"))
    keys = dit.load_state_dict(load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors",
                                         device=device))
    assert not keys.missing_keys and not keys.unexpected_keys, keys
    keep = tuple(getattr(dit, "_keep_in_fp32_modules", None) or ())
    for name, param in dit.named_parameters():
        param.data = param.data.to(torch.float32 if any(m in name.split(".") for m in keep) else dtype)
    return diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=dit.eval(),
                                 scheduler=diffusers.UniPCMultistepScheduler.from_pretrained(folder / "scheduler"))


def run_diffusers(pipe, req, noise, threshold: float | None, device, text: torch.Tensor) -> dict:
    """One WanPipeline call with (threshold) or without the first-block hook, on the prompt
    embeddings `text` [2, L, D] (cond, uncond): per-step wall times, per branch whether the
    step ran the blocks after the first and the hook's measure, the latents."""
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook
    dit = pipe.transformer
    decisions, marks = [], []
    decide = FBCHeadBlockHook._should_compute_remaining_blocks

    @torch.compiler.disable
    def recorded(self, residual):
        full = decide(self, residual)   # the hook's own decision
        prev = self.state_manager.get_state().head_block_residual
        # its measure, as 0.42.1 computes it (for the report; the decision above is the hook's)
        measure = None if prev is None else ((residual - prev).abs().mean() / prev.abs().mean()).item()
        decisions.append((full, measure))
        return full

    def before(module, args):
        if not marks:
            sync(device)
            marks.append(time.perf_counter())

    def step_done(pipe_, i, t, kwargs):
        sync(device)
        marks.append(time.perf_counter())
        return {}

    handle = dit.register_forward_pre_hook(before)
    if threshold is not None:
        dit.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        FBCHeadBlockHook._should_compute_remaining_blocks = recorded
    try:
        with torch.no_grad():
            latents = pipe(prompt_embeds=text[0:1], negative_prompt_embeds=text[1:2], height=req.height,
                           width=req.width, num_frames=req.num_frames, num_inference_steps=req.steps,
                           guidance_scale=req.guidance_scale, latents=noise.clone().to(device),
                           output_type="latent", callback_on_step_end=step_done).frames
    finally:
        handle.remove()
        FBCHeadBlockHook._should_compute_remaining_blocks = decide
        if threshold is not None:
            dit.disable_cache()   # the hook's state goes with it: the next run starts clean
    step_ms = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    if threshold is None:
        decisions = [(True, None)] * (2 * req.steps)
    pairs = [decisions[i:i + 2] for i in range(0, len(decisions), 2)]   # WanPipeline: cond, then uncond
    return {"step_ms": step_ms, "full_rows": [[f for f, _ in p] for p in pairs],
            "measure": [[m for _, m in p] for p in pairs], "latents": latents.float().cpu()}


def run_dtgen(pipe, req, noise, threshold: float | None, device, text) -> dict:
    result = pipe.generate(replace(req, step_cache=None if threshold is None else f"first-block:threshold={threshold}"),
                           latents=noise, decode=False)
    report = result.record.get("step_cache")
    return {"step_ms": result.timings_ms["denoise_step"], "latents": result.latents.float().cpu(),
            "full_rows": report["full_rows"] if report else [[True, True]] * req.steps,
            "measure": report["first_block_diff"] if report else None}


def summary(run: dict) -> dict:
    full = [i for i, rows in enumerate(run["full_rows"]) if any(rows)]
    ms = run["step_ms"]
    full_ms = [m for i, m in enumerate(ms) if i in full and i > 0]
    cached_ms = [m for i, m in enumerate(ms) if i not in full]
    return {"video_s": round(sum(ms) / 1e3, 3), "step_ms_mean": round(sum(ms) / len(ms), 2),
            "full_step_ms": round(statistics.median(full_ms), 2) if full_ms else None,
            "cached_step_ms": round(statistics.median(cached_ms), 2) if cached_ms else None,
            "first_step_ms": round(ms[0], 2), "full_steps": full,
            "full_rows": ["".join("F" if f else "c" for f in rows) for rows in run["full_rows"]]}


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--tiny", action="store_true", help="the tiny default on the CPU, float32 (a check that it runs)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 50, or 10 with --tiny)")
    p.add_argument("--baseline-steps", type=int, default=None,
                   help="steps of the uncached runs (default: 5, or the full count with --tiny)")
    p.add_argument("--threshold", type=float, default=0.05, help="FirstBlockCache threshold (diffusers' default)")
    p.add_argument("--compile", action="store_true", help="compile each block once, in both")
    p.add_argument("--layers", type=int, default=30, help="DiT blocks (a quicker look; the published 1.3B has 30)")
    args = b.parse()
    from dtgen.compile import CompileOptions
    from models import registry
    from models.wan.pipeline import WanT2VPipeline   # the pipeline this compares with diffusers'

    wan = registry.spec("wan")   # its tiny default, loader, plans and request
    T2VRequest = wan.load("request")
    if args.tiny:
        device, dtype, folder = "cpu", torch.float32, wan.load("tiny")()
        shape = dict(height=48, width=64, num_frames=9)
    else:
        if not torch.cuda.is_available():
            return need_cuda(MODULE + " (or --tiny)")
        device, dtype, shape = "cuda", torch.bfloat16, dict(height=480, width=832, num_frames=81)
        folder = bench_folder(device, args.layers)
    steps = args.steps or (10 if args.tiny else 50)
    baseline_steps = args.baseline_steps or (steps if args.tiny else 5)
    loaded = wan.load("loader")(folder, wan.load("plans").PLANS["single"], dtype=dtype, device=device)
    ours = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                          compile_options=CompileOptions(enabled=args.compile, regions=args.compile))
    theirs = diffusers_pipeline(folder, dtype, device)
    theirs.set_progress_bar_config(disable=True)
    if args.compile:
        theirs.transformer.compile_repeated_blocks(fullgraph=False)
    req = T2VRequest(prompt=PROMPT, negative_prompt=NEGATIVE, steps=steps, guidance_scale=5.0, shift=3.0, seed=0,
                     **shape)
    noise = torch.randn(ours.latent_shape(req), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), loaded.controller.phase("encode"):
        text = ours.encode(req)   # [2, 512, 4096]: what dtgen's own runs encode, handed to diffusers

    runs, wall = {}, {}
    for name, fn, threshold, n in (("dtgen", run_dtgen, None, baseline_steps),
                                   ("diffusers", run_diffusers, None, baseline_steps),
                                   ("dtgen", run_dtgen, args.threshold, steps),
                                   ("diffusers", run_diffusers, args.threshold, steps)):
        pipe = ours if name == "dtgen" else theirs
        extra = (device, text)
        key = f"{name} {'first-block' if threshold is not None else 'uncached'}"
        t0 = time.perf_counter()
        fn(pipe, replace(req, steps=2), noise, threshold, *extra)   # warm-up (and compile)
        if args.compile and threshold is not None:
            # A first-block step whose CFG rows disagree runs the other blocks on one row: one
            # row's graphs too (dtgen: the block region at batch 1; diffusers runs one row always).
            fn(pipe, replace(req, steps=2, guidance_scale=1.0), noise, threshold, *extra)
        t1 = time.perf_counter()
        runs[key] = fn(pipe, replace(req, steps=n), noise, threshold, *extra)
        wall[key] = {"warmup_s": round(t1 - t0, 1), "run_s": round(time.perf_counter() - t1, 1)}
        print(f"{key}: {summary(runs[key])['video_s']:.2f} s for {n} steps", flush=True)

    ours_c, theirs_c = runs["dtgen first-block"], runs["diffusers first-block"]
    same = ours_c["full_rows"] == theirs_c["full_rows"]
    parted = None
    if not same:   # the first step and branch where they part (later ones follow from it)
        i, b = next((i, b) for i in range(steps) for b in range(2)
                    if ours_c["full_rows"][i][b] != theirs_c["full_rows"][i][b])
        parted = {"step": i, "branch": ("cond", "uncond")[b], "threshold": args.threshold,
                  "dtgen_measure": ours_c["measure"][i][b], "diffusers_measure": theirs_c["measure"][i][b]}
    result = {"what": "Wan FirstBlockCache, dtgen vs diffusers' hook, one process, same folder, weights and noise",
              "diffusers": __import__("diffusers").__version__, "dtype": str(dtype).replace("torch.", ""),
              "model": "tiny default" if args.tiny else f"Wan2.1 1.3B DiT shapes ({args.layers} blocks), random "
                                                         "weights, time_proj x 0.01",
              "video": [shape["num_frames"], shape["height"], shape["width"]],
              "tokens_per_step": ours.latent_shape(req)[2] * ours.latent_shape(req)[3] * ours.latent_shape(req)[4] // 4,
              "steps": steps, "baseline_steps": baseline_steps, "threshold": args.threshold,
              "compiled": "per block, both" if args.compile else "eager, both",
              "runs": {k: summary(v) for k, v in runs.items()}, "wall": wall,
              "same_decisions": same, "first_parting": parted,
              "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if device.startswith("cuda")
              else None,
              "first_block_measure": {"dtgen": ours_c["measure"], "diffusers": theirs_c["measure"]},
              "rel_l2_latents_dtgen_vs_diffusers": rel_err(ours_c["latents"], theirs_c["latents"]),
              "rel_l2_latents_uncached_dtgen_vs_diffusers": rel_err(
                  runs["dtgen uncached"]["latents"], runs["diffusers uncached"]["latents"])
              if baseline_steps == steps else None}
    r = result["runs"]
    result["ratio_video_dtgen_over_diffusers"] = round(r["dtgen first-block"]["video_s"]
                                                       / r["diffusers first-block"]["video_s"], 3)
    for name in ("dtgen", "diffusers"):   # the uncached video at `steps` steps, from its per-step time
        ms = runs[f"{name} uncached"]["step_ms"]
        uncached_s = (ms[0] + (steps - 1) * statistics.median(ms[1:] or ms)) / 1e3
        r[f"{name} uncached"]["video_s_at_steps"] = round(uncached_s, 2)
        r[f"{name} first-block"]["speedup_vs_uncached"] = round(uncached_s / r[f"{name} first-block"]["video_s"], 2)

    for key, row in r.items():
        print(f"{key:24s} video {row['video_s']:8.2f} s  full step {row['full_step_ms']} ms  reused "
              f"{row['cached_step_ms']} ms  rows per step (F full, c reused): {' '.join(row['full_rows'])}")
    print(f"same decisions: {same}" + ("" if same else f"; they part at {parted}") + "; dtgen / diffusers "
          f"{result['ratio_video_dtgen_over_diffusers']:.3f}; final latents' rel L2 "
          f"{result['rel_l2_latents_dtgen_vs_diffusers']:.2e}")
    b.write(result, device)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
