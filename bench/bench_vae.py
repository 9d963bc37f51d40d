"""Benchmark the spatially split VAE decode (models/hunyuan_image3/parallel_vae.py).

    python -m bench.bench_vae [--latent 64x64] [--dtype bf16] [--out outputs/bench_vae.json]
    torchrun --nproc-per-node 4 -m bench.bench_vae [...]
    python -m bench.bench_vae --suite [--out outputs/bench_vae_suite.json]   # one GPU: the variants below
    python -m bench.bench_vae --suite --variants bf16_fast_eager,bf16_cl_eager,... [--only-bf16]

``--variants`` runs only the named ones (in the suite's order; `suite_variants` lists them),
``--only-bf16`` leaves out the fp32 ones (fp32_plain_eager alone took 2.6 s a call and 129 s
of first call on an H200). Decode variants are compared against fp32_plain_eager when it
runs, else against bf16_fast_eager (the bf16 NCDHW decode, computed untimed if not
selected); encode variants (enc_*: the posterior mean of the 16h x 16w image, the edit's
reference encode) against enc_bf16_fast_eager. The JSON's "reference" says which, and each
row its "vs" and "speedup_vs_ref". The channels-last variants (*_cl_*: the decoder / encoder
kept channels_last_3d, HunyuanVAE.set_channels_last; "cl_cached" keeps the 2-D kernels)
measure what cuDNN's layout conversions and the NCDHW convs cost (module docstring of
models/hunyuan_image3/vae.py).

``--suite`` (one process): the plain decode of one 1024x1024 image in float32 and bfloat16,
each with the decoder's fast paths (models/hunyuan_image3/vae.py: folded 2-D convs on 1 and
2 frames, var_mean GroupNorm statistics, in-place SiLU / residuals / upsampler shortcut, the
image's conv_out on the last two frames) and with the plain ops (F.conv3d, nn.GroupNorm, the
materialized shortcut: the code before them), eager and under torch.compile, float32 with
cuDNN's TF32 off (exact float32) and on (PyTorch's default for convolutions), channels_last_3d
memory format once, and with `row_chunks=4` (--vae-chunks 4). Each: median ms, peak GiB, and
its deviation from the exact float32 plain decode (max abs, relative L2): the fp32 variants
must stay at float32 rounding (the golden tolerance is rtol 1e-4, atol 1e-5), the bf16 ones
say what bf16 costs.

Model: the official HunyuanImage-3 VAE decoder shape (block_out_channels
[128, 256, 512, 1024, 1024], 2 layers per block, 32 latent channels, x16 space, x4 time)
with random weights (the tiny checkpoint's recipe), so no checkpoint is needed. A 64x64
latent is a 1024x1024 image.

One process (no torchrun): the plain decode; ``parallel_decode`` over a 1-rank group (the
wrapper's own overhead: GroupNorm in dtgen, no exchange); and, as the no-communication
floor of a P-rank split, the plain decode of a 1/P latent slice for P = 2, 4, 8 (same convs
and norms per rank; attention over local keys only, a small share here).

Under torchrun with P ranks (one GPU each, NCCL): the plain decode on every rank, then the
split decode along height and width (full image gathered on every rank), with the max
deviation from the plain decode and the peak memory per rank. Times are medians over
``--reps`` calls after ``--warmup``, CUDA-synchronized.

Runs on the CPU too (gloo; ``--tiny`` for a small config), for checking the script itself.

Measured (H200, torch 2.11.0+cu130, bf16, 64x64 latent -> 1024x1024, median of 3-5):
  1 GPU: plain decode 379 ms (peak 8.7 GiB); parallel_decode on a 1-rank group 270 ms
    (its GroupNorm, one eval-mode batch_norm pass, is faster than nn.GroupNorm on these
    5-D bf16 shapes); plain decode of a 1/2, 1/4, 1/8 latent slice 189, 98, 51 ms
    (peak 5.2, 3.5, 2.6 GiB).
  2 GPUs (NCCL, torchrun): split along height 162 ms, width 157 ms (p2p halos); 158 / 159 ms
    with exchange="allgather"; 2.3x the plain decode (370 ms), peak 5.7 GiB per rank; max
    abs deviation from the plain bf16 decode 0.047 on outputs up to 3.17 (bf16 rounding;
    the 1-rank path alone differs by 0.039).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dtgen.launch import init_from_torchrun, under_torchrun
from models.hunyuan_image3.parallel_vae import parallel_decode
from models.hunyuan_image3.vae import HunyuanVAE, VAEConfig

OFFICIAL_VAE = {"block_out_channels": [128, 256, 512, 1024, 1024], "layers_per_block": 2, "latent_channels": 32,
                "out_channels": 3, "ffactor_spatial": 16, "ffactor_temporal": 4,
                "scaling_factor": 0.562679178327931, "shift_factor": None, "upsample_match_channel": True}
TINY_VAE = {**OFFICIAL_VAE, "block_out_channels": [32, 32, 64, 64, 64]}   # encoder: its last width is 2*latent
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_vae(cfg: dict, dtype: torch.dtype, device: torch.device, seed: int = 0,
              with_encoder: bool = False) -> HunyuanVAE:
    """Random weights with the tiny checkpoint's recipe (norm scales ~1, small conv weights)."""
    with torch.device("meta"):
        vae = HunyuanVAE(VAEConfig.from_dict({**cfg, "only_decoder": not with_encoder}), with_encoder=with_encoder)
    g = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, p in vae.named_parameters():
        shape = tuple(p.shape)
        r = torch.randn(shape, generator=g, device=device)
        if name.endswith("weight") and len(shape) == 1:
            t = 1 + 0.1 * r
        elif name.endswith("bias"):
            t = 0.02 * r
        else:
            t = min(0.05, 1 / math.sqrt(math.prod(shape[1:]))) * r
        state[name] = t.to(dtype)
    vae.load_state_dict(state, assign=True)
    return vae.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, warmup: int, reps: int, barrier=None) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if barrier:
            barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_gib(device, fn) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


@contextlib.contextmanager
def plain_ops():
    """The VAE decoder as it was before its fast paths: F.conv3d for every conv, nn.GroupNorm,
    the upsampler's shortcut materialized (the reference of `--suite`)."""
    from models.hunyuan_image3 import vae as v

    def plain_upsample(self, x):
        return v._depth_to_space(self.conv(x), self.rt) + v._depth_to_space(x.repeat_interleave(self.repeats, dim=1),
                                                                            self.rt)

    def plain_resnet(self, x):
        h = self.conv1(torch.nn.functional.silu(self.norm1(x)))
        h = self.conv2(torch.nn.functional.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h
    saved = (v.VAEConv3d.forward, v.VAEGroupNorm.forward, v.Upsample.forward, v.ResnetBlock.forward)
    v.VAEConv3d.forward, v.VAEGroupNorm.forward = torch.nn.Conv3d.forward, torch.nn.GroupNorm.forward
    v.Upsample.forward, v.ResnetBlock.forward = plain_upsample, plain_resnet
    try:
        yield
    finally:
        v.VAEConv3d.forward, v.VAEGroupNorm.forward, v.Upsample.forward, v.ResnetBlock.forward = saved


def conv_flops(cfg: dict, h: int, w: int) -> dict:
    """The decoder's convolution FLOPs for one [h, w] latent: as 3-D convs over every frame
    (what F.conv3d computes, zero-padding taps included) and with the T <= 2 folds (what the
    fast path computes). Counted on meta, nothing allocated."""
    from models.hunyuan_image3.vae import VAEConv3d
    with torch.device("meta"):
        vae = HunyuanVAE(VAEConfig.from_dict(cfg))
    total = {"conv3d_tflop": 0.0, "folded_tflop": 0.0}

    def count(m, inp, _out):
        _, c, t, hh, ww = inp[0].shape
        k = m.kernel_size[0]
        frame = 2 * m.out_channels * c * k * k * hh * ww / 1e12
        total["conv3d_tflop"] += frame * k * t
        total["folded_tflop"] += frame * (t if k == 1 else 1 if t == 1 else 4 if t == 2 else 3 * t)
    hooks = [m.register_forward_hook(count) for m in vae.modules() if isinstance(m, VAEConv3d)]
    with torch.no_grad():
        vae.decoder(torch.empty(1, cfg["latent_channels"], 1, h, w, device="meta"))
    for hk in hooks:
        hk.remove()
    return {k: round(v, 2) for k, v in total.items()}


def run_suite(args, device: torch.device, report: dict | None = None) -> dict:
    """The one-GPU variants (module docstring): {name: {ms, peak_gib, max_abs_dev, rel_l2, ...}}.

    Decode variants are compared against `reference` (fp32_plain_eager when it is selected,
    else bf16_fast_eager: the bf16 NCDHW decode), encode variants (enc_*: the posterior mean
    of a 16h x 16w image) against enc_bf16_fast_eager; a reference that is not selected is
    computed once, untimed. `report["reference"]` says which."""
    h, w = (int(v) for v in args.latent.lower().split("x"))
    cfg = TINY_VAE if args.tiny else OFFICIAL_VAE
    latents = torch.randn(1, 32, h, w, generator=torch.Generator().manual_seed(1)).to(device)
    pixels = (torch.rand(1, 3, 16 * h, 16 * w, generator=torch.Generator().manual_seed(2)) * 2 - 1).to(device)
    cuda = device.type == "cuda"
    variants = suite_variants(args, cuda)
    names = [v["name"] for v in variants]
    if args.variants:
        wanted = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known: {names}")
        variants = [v for v in variants if v["name"] in wanted]
    if args.only_bf16:
        variants = [v for v in variants if "fp32" not in v["name"]]
    dtypes = {v["dtype"] for v in variants}
    encode = any(v["kind"] == "encode" for v in variants)
    vaes = {name: build_vae(cfg, dtype, device, with_encoder=encode) for name, dtype in
            (("fp32", torch.float32), ("bf16", torch.bfloat16)) if name in dtypes or (name == "bf16" and encode)}
    if "bf16" not in vaes:   # the bf16 reference of a run without fp32_plain_eager
        vaes["bf16"] = build_vae(cfg, torch.bfloat16, device, with_encoder=encode)
    out: dict = {}
    decode_ref = "fp32_plain_eager" if "fp32_plain_eager" in [v["name"] for v in variants] else "bf16_fast_eager"
    refs: dict = {"decode": None, "encode": None}
    ref_names = {"decode": decode_ref, "encode": "enc_bf16_fast_eager"}
    if report is not None:
        report["reference"] = {**ref_names, "note": "max_abs_dev / rel_l2 of each variant against these (decode: "
                               "the image; encode: the posterior mean); one not selected is computed once, untimed"}
        report["variants_run"] = [v["name"] for v in variants]

    def measure(v):
        try:
            _measure(v)
        except Exception as e:   # one variant failing (a compile, say) leaves the others standing
            out[v["name"]] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "note": v["note"]}
            print(v["name"], json.dumps(out[v["name"]]), flush=True)

    def _measure(v):
        name, fn = v["name"], v["make"](vaes, latents, pixels)
        if cuda:   # the peak of the first call (its cuDNN algorithm search included)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        image = fn().float()
        sync(device)
        first_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        if name == ref_names[v["kind"]]:
            refs[v["kind"]] = image
        ref = refs[v["kind"]]
        diff = image - ref
        out[name] = {"ms": round(median_ms(fn, device, args.warmup, args.reps), 2),
                     "peak_gib": None if peak is None else round(peak, 3),
                     "first_call_s": round(first_s, 2), "max_abs_dev": diff.abs().max().item(),
                     "rel_l2": (diff.norm() / ref.norm().clamp_min(1e-30)).item(),
                     "vs": ref_names[v["kind"]], "kind": v["kind"], "layout": v["layout"],
                     "cudnn_tf32": torch.backends.cudnn.allow_tf32, "note": v["note"]}
        base = out.get(ref_names[v["kind"]], {}).get("ms")
        if base and name != ref_names[v["kind"]]:
            out[name]["speedup_vs_ref"] = round(base / out[name]["ms"], 3)
        print(name, json.dumps(out[name]), flush=True)
        if report is not None and args.out:   # after every variant: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({**report, "results": out}, indent=1))

    tf32 = torch.backends.cudnn.allow_tf32
    with torch.inference_mode():
        for kind in ("decode", "encode"):   # the references first, untimed, where not selected
            if any(v["kind"] == kind for v in variants) and ref_names[kind] not in [v["name"] for v in variants]:
                vae = vaes["bf16"].set_channels_last(False)
                refs[kind] = (vae.decode(latents) if kind == "decode" else
                              vae.encode(pixels, torch.Generator().manual_seed(0)).mean).float()
        for v in variants:
            torch.backends.cudnn.allow_tf32 = v["tf32"]
            for vae in vaes.values():
                vae.set_channels_last(v["layout"] != "ncdhw", cache_weights=v["layout"] == "cl_cached")
            with plain_ops() if v["plain"] else contextlib.nullcontext():
                measure(v)
            for vae in vaes.values():
                vae.set_channels_last(False)
    torch.backends.cudnn.allow_tf32 = tf32
    return out


def suite_variants(args, cuda: bool) -> list[dict]:
    """Every --suite variant, most telling first (a run cut short by its time limit keeps them):
    name, kind (decode / encode), dtype, layout (ncdhw; cl: HunyuanVAE.set_channels_last with
    its 2-D kernels made per call; cl_cached: kept), cuDNN TF32, plain ops, note, make(vaes,
    latents, pixels) -> the timed callable."""
    compile_note = f"torch.compile({args.compile_backend}) of the decoder"

    def decode(dtype, **kw):
        return lambda vaes, latents, pixels: (lambda: vaes[dtype].decode(latents, **kw))

    def encode(dtype, **kw):
        return lambda vaes, latents, pixels: (
            lambda: vaes[dtype].encode(pixels, torch.Generator().manual_seed(0), **kw).mean)

    def compiled(dtype):
        def make(vaes, latents, pixels):
            vae, made = vaes[dtype], {}

            def run():   # compiled on first call, inside measure's guard
                if "decoder" not in made:
                    made["decoder"] = torch.compile(vae.decoder, fullgraph=True, backend=args.compile_backend)
                image = made["decoder"](vae._to_decoder_space(latents), last_frame=True)[:, :, -1]
                return image.contiguous()
            return run
        return make

    def var(name, make, note="", dtype="bf16", layout="ncdhw", tf32=False, plain=False, kind="decode"):
        return {"name": name, "make": make, "note": note, "dtype": dtype, "layout": layout, "tf32": tf32,
                "plain": plain, "kind": kind}
    cl_note = "channels-last resident (HunyuanVAE.set_channels_last)"
    variants = [var("fp32_plain_eager", decode("fp32"), "reference: F.conv3d, nn.GroupNorm", "fp32", plain=True),
                var("fp32_fast_eager", decode("fp32"), dtype="fp32"),
                var("bf16_fast_eager", decode("bf16"), "NCDHW: the bf16 reference without fp32 variants"),
                var("bf16_cl_eager", decode("bf16"), cl_note + ", 2-D kernels made per call", layout="cl"),
                var("bf16_cl_cached_eager", decode("bf16"), cl_note + ", 2-D kernels kept (cache_weights)",
                    layout="cl_cached"),
                var("bf16_fast_chunks4_eager", decode("bf16", row_chunks=4), "--vae-chunks 4"),
                var("bf16_cl_chunks4_eager", decode("bf16", row_chunks=4), cl_note + ", --vae-chunks 4", layout="cl"),
                var("enc_bf16_fast_eager", encode("bf16"), "encode: NCDHW", kind="encode"),
                var("enc_bf16_cl_eager", encode("bf16"), "encode: " + cl_note, layout="cl", kind="encode"),
                var("enc_bf16_fast_chunks4_eager", encode("bf16", row_chunks=4), "encode: --vae-chunks 4",
                    kind="encode"),
                var("enc_bf16_cl_chunks4_eager", encode("bf16", row_chunks=4), "encode: " + cl_note + ", --vae-chunks 4",
                    layout="cl", kind="encode"),
                var("fp32_tf32_plain_eager", decode("fp32"), "cuDNN TF32 on (torch's default)", "fp32", tf32=True,
                    plain=True),
                var("fp32_tf32_fast_eager", decode("fp32"), "cuDNN TF32 on", "fp32", tf32=True),
                var("bf16_plain_eager", decode("bf16"), plain=True),
                var("fp32_fast_chunks4_eager", decode("fp32", row_chunks=4),
                    "--vae-chunks 4: two whole maps at once instead of three", "fp32")]
    if not args.no_compile:
        variants += [var("bf16_cl_compiled", compiled("bf16"), compile_note + ", " + cl_note, layout="cl"),
                     var("bf16_fast_compiled", compiled("bf16"), compile_note),
                     var("fp32_tf32_fast_compiled", compiled("fp32"), compile_note + ", cuDNN TF32 on", "fp32",
                         tf32=True),
                     var("fp32_fast_compiled", compiled("fp32"), compile_note, "fp32")]
    if not cuda:   # TF32 means nothing on the CPU
        variants = [v for v in variants if not v["tf32"]]
    return variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latent", default="64x64", help="latent HxW (64x64 -> 1024x1024 image)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--tiny", action="store_true", help="32-channel decoder (CPU check of this script)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--exchange", default="p2p", choices=["p2p", "allgather"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--suite", action="store_true", help="one process: fp32 / bf16, fast / plain ops, eager / compiled")
    ap.add_argument("--no-compile", action="store_true", help="with --suite: leave out the compiled variants")
    ap.add_argument("--variants", default=None, metavar="NAME,NAME",
                    help="with --suite: run only these variants, in the suite's order (an unknown name lists them)")
    ap.add_argument("--only-bf16", action="store_true", help="with --suite: leave out the fp32 variants (slow: "
                    "fp32_plain_eager is 2.6 s a call and 129 s of first call on an H200)")
    ap.add_argument("--compile-backend", default="inductor", help="with --suite: torch.compile backend")
    ap.add_argument("--flops", action="store_true", help="only count the decoder's conv FLOPs (on meta; any machine)")
    args = ap.parse_args()
    if args.flops:
        h, w = (int(v) for v in args.latent.lower().split("x"))
        report = {"command": "python -m bench.bench_vae " + " ".join(sys.argv[1:]), "latent": [h, w],
                  "image": [16 * h, 16 * w], "tiny": args.tiny,
                  "flops": conv_flops(TINY_VAE if args.tiny else OFFICIAL_VAE, h, w)}
        print(json.dumps(report, indent=1))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1))
        return
    if args.suite:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        torch.backends.cudnn.benchmark = True
        h, w = (int(v) for v in args.latent.lower().split("x"))
        report = {"command": "python -m bench.bench_vae " + " ".join(sys.argv[1:]),
                  "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "latent": args.latent, "tiny": args.tiny, "reps": args.reps,
                  "warmup": args.warmup, "flops": conv_flops(TINY_VAE if args.tiny else OFFICIAL_VAE, h, w)}
        report["results"] = run_suite(args, device, report)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1))
        return

    if under_torchrun():
        ctx = init_from_torchrun()
        rank, world, device = ctx.rank, ctx.world_size, ctx.device
    else:
        rank, world = 0, 1
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    torch.backends.cudnn.benchmark = True
    dtype = DTYPES[args.dtype]
    h, w = (int(v) for v in args.latent.lower().split("x"))
    vae = build_vae(TINY_VAE if args.tiny else OFFICIAL_VAE, dtype, device)
    latents = torch.randn(1, 32, h, w, generator=torch.Generator().manual_seed(1)).to(device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "world_size": world, "latent": [h, w], "dtype": args.dtype,
              "tiny": args.tiny, "exchange": args.exchange, "image": [16 * h, 16 * w], "results": {}}
    res = report["results"]
    barrier = dist.barrier if world > 1 else None

    with torch.inference_mode():
        ref = vae.decode(latents)
        res["plain"] = {"ms": median_ms(lambda: vae.decode(latents), device, args.warmup, args.reps, barrier),
                        "peak_gib": peak_gib(device, lambda: vae.decode(latents))}
        if world == 1:
            out = parallel_decode(vae, latents, None, "height", exchange=args.exchange)
            res["parallel_1rank"] = {
                "ms": median_ms(lambda: parallel_decode(vae, latents, None, "height"), device, args.warmup, args.reps),
                "max_abs_dev": (out.float() - ref.float()).abs().max().item()}
            for p in (2, 4, 8):
                if h % p == 0:
                    part = latents[:, :, : h // p].contiguous()
                    res[f"slice_1of{p}_floor"] = {
                        "ms": median_ms(lambda: vae.decode(part), device, args.warmup, args.reps),
                        "peak_gib": peak_gib(device, lambda: vae.decode(part))}
        else:
            for dim in ("height", "width"):
                def run():
                    return parallel_decode(vae, latents, None, dim, exchange=args.exchange)
                out = run()
                dev = (out.float() - ref.float()).abs().max().item()
                ms = median_ms(run, device, args.warmup, args.reps, barrier)
                res[f"split_{dim}"] = {"ms": ms, "speedup": res["plain"]["ms"] / ms, "max_abs_dev": dev,
                                       "max_abs_ref": ref.float().abs().max().item(),
                                       "peak_gib": peak_gib(device, run)}
    if rank == 0:
        text = json.dumps(report, indent=1)
        print(text)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
