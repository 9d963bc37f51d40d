"""The HunyuanImage-3 VAE on one GPU: its decode's variants, and the FLOPs it must compute with their floors.

`--suite`: one 1024x1024 image (a 64x64 latent) through the released VAE shape (random weights): the decode
in float32 and bfloat16, with the decoder's fast paths (folded 2-D convs on 1 and 2 frames, var_mean
GroupNorm statistics, in-place SiLU and residuals, conv_out on the last two frames) and with the plain ops
(F.conv3d, nn.GroupNorm: the code before them), cuDNN's TF32 off and on, channels-last
resident, `row_chunks=4` (--vae-chunks 4), and the edit's encode. Each: median ms, first-call seconds,
peak GiB and its deviation from the reference decode (fp32_plain_eager when it runs, else
bf16_fast_eager; encodes against enc_bf16_fast_eager). `--variants` runs only the named ones,
`--only-bf16` leaves out the fp32 ones (fp32_plain_eager alone: 2.6 s a call on an H200).
`--flops` (no GPU): the decode traced on meta under torch's FLOP counter, per convolution: `flops_now`
(what `vae.decode` asks of its convolutions: a 3x3x3 conv over T >= 3 frames also multiplies the zero time
padding) and `flops_needed` (only the frame-taps that meet a frame: no exact method computes fewer), with
their floors at plain fp32 and TF32 (datasheet) and bf16 (measured) rates.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.floors import DENSE_BF16_TFLOPS, FP32_DATASHEET_TFLOPS, TF32_DATASHEET_TFLOPS
from bench.harness import Bench, summary, sync, time_ms
from models.hunyuan_image3.vae import HunyuanVAE, VAEConfig

MODULE = "bench.bench_vae"
TARGET_MS = 150.0   # the target: the VAE decode 1024x1024 on one GPU, golden-exact in float32
OFFICIAL_VAE = {"block_out_channels": [128, 256, 512, 1024, 1024], "layers_per_block": 2, "latent_channels": 32,
                "out_channels": 3, "ffactor_spatial": 16, "ffactor_temporal": 4,
                "scaling_factor": 0.562679178327931, "shift_factor": None, "upsample_match_channel": True}
TINY_VAE = {**OFFICIAL_VAE, "block_out_channels": [32, 32, 64, 64, 64]}   # encoder: its last width is 2*latent
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


def run_suite(args, device: torch.device, report: dict, b: Bench) -> dict:
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
    report["reference"] = {**ref_names, "note": "max_abs_dev / rel_l2 of each variant against these (decode: "
                           "the image; encode: the posterior mean); one not selected is computed once, untimed"}
    report["variants_run"] = [v["name"] for v in variants]

    def measure(v):
        try:
            _measure(v)
        except Exception as e:   # one variant failing (a compile, say) leaves the others standing
            out[v["name"]] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "note": v["note"]}
            print(v["name"], out[v["name"]], flush=True)

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
        out[name] = {"ms": round(summary(time_ms(fn, args.reps, args.warmup, device))["median"], 2),
                     "peak_gib": None if peak is None else round(peak, 3),
                     "first_call_s": round(first_s, 2), "max_abs_dev": diff.abs().max().item(),
                     "rel_l2": (diff.norm() / ref.norm().clamp_min(1e-30)).item(),
                     "vs": ref_names[v["kind"]], "kind": v["kind"], "layout": v["layout"],
                     "cudnn_tf32": torch.backends.cudnn.allow_tf32, "note": v["note"]}
        base = out.get(ref_names[v["kind"]], {}).get("ms")
        if base and name != ref_names[v["kind"]]:
            out[name]["speedup_vs_ref"] = round(base / out[name]["ms"], 3)
        print(name, out[name], flush=True)
        b.write({**report, "results": out}, device, quiet=True)   # after every variant: a run cut short keeps it

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

    def decode(dtype, **kw):
        return lambda vaes, latents, pixels: (lambda: vaes[dtype].decode(latents, **kw))

    def encode(dtype, **kw):
        return lambda vaes, latents, pixels: (
            lambda: vaes[dtype].encode(pixels, torch.Generator().manual_seed(0), **kw).mean)

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
                var("enc_bf16_cl_chunks4_eager", encode("bf16", row_chunks=4),
                    "encode: " + cl_note + ", --vae-chunks 4", layout="cl", kind="encode"),
                var("fp32_tf32_plain_eager", decode("fp32"), "cuDNN TF32 on (torch's default)", "fp32", tf32=True,
                    plain=True),
                var("fp32_tf32_fast_eager", decode("fp32"), "cuDNN TF32 on", "fp32", tf32=True),
                var("bf16_plain_eager", decode("bf16"), plain=True),
                var("fp32_fast_chunks4_eager", decode("fp32", row_chunks=4),
                    "--vae-chunks 4: two whole maps at once instead of three", "fp32")]
    if not cuda:   # TF32 means nothing on the CPU
        variants = [v for v in variants if not v["tf32"]]
    return variants


def conv_flops(layers: list[dict]) -> tuple[float, float]:
    now = needed = 0.0
    for c in layers:
        per_tap = 2.0 * c["out"] * c["in"] * c["k"] ** 2 * c["h"] * c["w"] * c["batch"]
        t, k = c["frames"], c["k"]
        if k == 1:
            taps_now = taps_needed = t
        else:
            taps_now = 1 if t == 1 else (4 if t == 2 and c["folded"] else 3 * t)
            taps_needed = 1 if t == 1 else 3 * t - 2
        now += per_tap * taps_now
        needed += per_tap * taps_needed
    return now, needed


def trace(size: int) -> dict:
    from models.hunyuan_image3.presets import full_config
    cfg = VAEConfig.from_dict(full_config()["vae"])
    with torch.device("meta"):
        vae = HunyuanVAE(cfg)
    layers = []

    def record(module, args, output):
        x = args[0]
        layers.append({"name": names[module], "in": x.shape[1], "out": module.out_channels, "k": module.kernel_size[0],
                       "frames": x.shape[2], "h": output.shape[-2], "w": output.shape[-1], "batch": x.shape[0],
                       "folded": module.kernel_size[0] == 3 and x.shape[2] <= VAEConv3d.FOLD_MAX_FRAMES})

    from models.hunyuan_image3.vae import VAEConv3d
    names = {m: n for n, m in vae.named_modules() if isinstance(m, VAEConv3d)}
    for m in names:
        m.register_forward_hook(record)
    f = cfg.ffactor_spatial
    z = torch.empty(1, cfg.latent_channels, size // f, size // f, device="meta")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.decode(z)
    counted = counter.get_total_flops()
    now, needed = conv_flops(layers)
    by_level: dict[str, float] = {}
    for c in layers:
        level = ".".join(c["name"].split(".")[:3]) if c["name"].startswith("decoder.up.") else c["name"].split(".")[1]
        by_level[level] = by_level.get(level, 0.0) + conv_flops([c])[1]
    rates = {"fp32 (datasheet, no tensor cores)": FP32_DATASHEET_TFLOPS,
             "tf32 (datasheet, dense)": TF32_DATASHEET_TFLOPS,
             "bf16 (measured GEMM rate, bench/floors.py)": DENSE_BF16_TFLOPS}
    return {
        "size": size, "frames_decoded": cfg.ffactor_temporal, "convolutions": len(layers),
        "flop_counter_total": counted, "flops_now": now, "flops_needed": needed,
        "flops_counter_matches_now": abs(counted - now) / now < 0.01,   # the rest is the mid-block attention
        "needed_tflop_by_level": {k: v / 1e12 for k, v in by_level.items()},
        "floor_ms_of_needed": {name: needed / (rate * 1e12) * 1e3 for name, rate in rates.items()},
        "floor_ms_of_now": {name: now / (rate * 1e12) * 1e3 for name, rate in rates.items()},
        "rates_tflops": rates,
    }


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    ap = b.parser
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--suite", action="store_true", help="the decode's variants (module docstring)")
    mode.add_argument("--flops", action="store_true", help="the decode's FLOPs and floors (on meta; no GPU)")
    ap.add_argument("--sizes", default="1024", help="with --flops: square image sides, comma-separated")
    ap.add_argument("--latent", default="64x64", help="latent HxW (64x64 -> 1024x1024 image)")
    ap.add_argument("--tiny", action="store_true", help="32-channel decoder (CPU check of this script)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=None, metavar="NAME,NAME",
                    help="run only these variants, in the suite's order (an unknown name lists them)")
    ap.add_argument("--only-bf16", action="store_true", help="leave out the fp32 variants")
    args = b.parse()
    if args.flops:
        runs = [trace(int(s)) for s in args.sizes.split(",")]
        for r in runs:
            print(f"{r['size']}x{r['size']}: {r['flops_now'] / 1e12:.1f} TFLOP now (counter "
                  f"{r['flop_counter_total'] / 1e12:.1f}), {r['flops_needed'] / 1e12:.1f} needed; its floors: "
                  + ", ".join(f"{k.split()[0]} {v:.0f} ms" for k, v in r["floor_ms_of_needed"].items()))
        b.write({"target_ms": TARGET_MS, "runs": runs}, "cpu")
        return 0
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.backends.cudnn.benchmark = True
    report = {"latent": args.latent, "tiny": args.tiny, "reps": args.reps, "warmup": args.warmup}
    report["results"] = run_suite(args, device, report, b)
    b.write(report, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
