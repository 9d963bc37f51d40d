"""Which way of running the VAE's 4-frame 3x3x3 convolutions is fastest on this GPU (a probe).

    python -m bench.probes.vae_conv_probe --out $OUT/vae_conv_probe.json            (a GPU)
    python -m bench.probes.vae_conv_probe --shapes tiny --iters 1 --out /tmp/p.json  (CPU: checks only)

The decoder's last three levels (bench/probes/vae_flops.py) are 83% of its FLOPs and run
3x3x3 convolutions over T = 4 frames, which VAEConv3d hands to `F.conv3d` on [B, C, T, H, W]
(3T = 12 frame-taps, two of them on the zero time padding). Each variant below computes the
same convolution from the same NCDHW input to an NCDHW output (the decoder's layout), so a
variant's time includes the layout changes it needs; the `*_resident` variants leave them
out (what they would cost if the whole decoder kept that layout):
- conv3d:                 F.conv3d, NCDHW (today's path)
- conv3d_cl_resident:     F.conv3d on channels_last_3d input and weight (NDHWC resident)
- taps2d:                 frames as a batch of 2-D images (one copy in, one out), three
                          conv2d (one per time tap) over the frames each tap meets: 3T - 2 = 10
                          frame-taps, no padding multiplied; outputs summed in place
- taps2d_cl_resident:     the same on channels_last frames, layout kept (no copies timed)
- fold2d:                 frames folded into channels (no copy): one conv2d with a
                          [T*Cout, T*C] kernel (T^2 = 16 frame-taps, 6 of them zero)
Each is timed in float32 (cuDNN's default TF32) and bfloat16; its result is checked against
conv3d's (max relative difference, in the JSON). The time is the median of `--iters` calls
after warm-up (CUDA events); TFLOP/s counts the 10 frame-taps every exact method needs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, channels, frames, side): the decoder's 4-frame levels at 1024x1024 (128, 256 and 512
# channels at 1024^2, 512^2 and 256^2), and a small CPU shape that only checks the variants
SHAPES = {"released": [("level4_128ch_1024", 128, 4, 1024), ("level3_256ch_512", 256, 4, 512),
                       ("level2_512ch_256", 512, 4, 256)],
          "tiny": [("tiny_16ch_12", 16, 4, 12), ("tiny_8ch_3frames", 8, 3, 9)]}


def conv3d(x, w, b):
    return F.conv3d(x, w, b, padding=1)


def _taps(frames_x, w, b, bsz, t):
    """frames_x [B*T, C, H, W] (any memory format) -> [B, T, O, H, W] view of the output:
    y[t] = W1 * x[t] + W0 * x[t-1] + W2 * x[t+1] (the taps that meet a frame)."""
    c, h, wd = frames_x.shape[1:]
    fx = frames_x.view(bsz, t, c, h, wd) if frames_x.is_contiguous() else frames_x.unflatten(0, (bsz, t))
    y = F.conv2d(frames_x, w[:, :, 1], b, padding=1)
    yv = y.unflatten(0, (bsz, t))
    yv[:, 1:] += F.conv2d(fx[:, :-1].flatten(0, 1), w[:, :, 0], None, padding=1).unflatten(0, (bsz, t - 1))
    yv[:, :-1] += F.conv2d(fx[:, 1:].flatten(0, 1), w[:, :, 2], None, padding=1).unflatten(0, (bsz, t - 1))
    return yv


def taps2d(x, w, b):
    bsz, c, t, h, wd = x.shape
    frames = x.transpose(1, 2).reshape(bsz * t, c, h, wd)                # the one copy in
    return _taps(frames, w, b, bsz, t).transpose(1, 2).contiguous()      # and the one out


def fold2d(x, w, b):
    bsz, c, t, h, wd = x.shape
    o = w.shape[0]
    taps = torch.arange(t, device=x.device)
    tap = taps[None, :] - taps[:, None] + 1                              # [r, s]
    inside = ((tap >= 0) & (tap <= 2)).to(w.dtype)
    kernel = (w[:, :, tap.clamp(0, 2)] * inside[None, None, :, :, None, None]).permute(0, 2, 1, 3, 4, 5)
    kernel = kernel.reshape(o * t, c * t, 3, 3)
    y = F.conv2d(x.reshape(bsz, c * t, h, wd), kernel, b.repeat_interleave(t), padding=1)
    return y.view(bsz, o, t, h, wd)


def variants(x, w, b):
    """name -> (setup() -> args, fn(*args) -> NCDHW-comparable output)."""
    bsz, c, t, h, wd = x.shape
    frames_cl = lambda: (x.transpose(1, 2).reshape(bsz * t, c, h, wd).contiguous(memory_format=torch.channels_last),)
    return {
        "conv3d": (lambda: (x, w, b), conv3d),
        "conv3d_cl_resident": (lambda: (x.contiguous(memory_format=torch.channels_last_3d),
                                        w.contiguous(memory_format=torch.channels_last_3d), b), conv3d),
        "taps2d": (lambda: (x, w, b), taps2d),
        "taps2d_cl_resident": (lambda: (*frames_cl(), w, b), lambda f, w_, b_: _taps(f, w_, b_, bsz, t)),
        "fold2d": (lambda: (x, w, b), fold2d),
    }


def as_ncdhw(y, like):
    """A variant's output as [B, O, T, H, W] (the resident taps variant returns [B, T, O, H, W])."""
    return y if y.shape == like.shape else y.transpose(1, 2)


def timed(fn, args, iters: int, device: torch.device) -> list[float]:
    for _ in range(2):
        fn(*args)
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def probe(shapes: list, dtypes: list[torch.dtype], iters: int, device: torch.device) -> list[dict]:
    rows = []
    for name, c, t, side in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        x32 = torch.randn(1, c, t, side, side, generator=g).to(device)
        w32 = (torch.randn(c, c, 3, 3, 3, generator=g) / (27 * c) ** 0.5).to(device)
        b32 = torch.randn(c, generator=g).to(device)
        needed = 2.0 * c * c * 9 * side * side * (3 * t - 2)
        for dtype in dtypes:
            x, w, b = x32.to(dtype), w32.to(dtype), b32.to(dtype)
            with torch.no_grad():
                ref = conv3d(x, w, b).float()
                for variant, (setup, fn) in variants(x, w, b).items():
                    args = setup()
                    out = as_ncdhw(fn(*args), ref).float()
                    diff = ((out - ref).abs().max() / ref.abs().max()).item()
                    times = timed(fn, args, iters, device)
                    med = statistics.median(times)
                    rows.append({"shape": name, "channels": c, "frames": t, "side": side, "dtype": str(dtype).split(".")[-1],
                                 "variant": variant, "ms": times, "median_ms": med, "min_ms": min(times),
                                 "max_ms": max(times), "tflops_of_needed": needed / (med * 1e-3) / 1e12,
                                 "max_rel_diff_vs_conv3d": diff})
                    print(f"{name:20s} {rows[-1]['dtype']:9s} {variant:20s} {med:8.3f} ms "
                          f"{rows[-1]['tflops_of_needed']:7.1f} TFLOP/s  diff {diff:.1e}", flush=True)
                    del args, out
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="released")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"command": "python -m bench.probes.vae_conv_probe " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
              "rows": probe(SHAPES[args.shapes], [torch.float32, torch.bfloat16], args.iters, device)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
