"""What the HunyuanImage-3 VAE decode must compute, and the fastest it can then run (no GPU).

    .venv/bin/python -m bench.probes.vae_flops --out bench/results/<dir>/vae_flops.json

The released VAE config (models/hunyuan_image3/presets.py) decodes one latent frame into
ffactor_temporal = 4 frames at full size and keeps the last; the decoder's last three levels
(512, 256 and 128 channels at 256^2, 512^2 and 1024^2) run at 4 frames. The decode is traced
on the meta device (no weights, no GPU) under torch's FLOP counter, per convolution:
- `flops_now`: what `vae.decode` asks of its convolutions now (a 3x3x3 conv over T >= 3
  frames also multiplies the zero time padding: 3T frame-taps);
- `flops_needed`: only the frame-taps that meet a frame (3T - 2 for T >= 2, 1 for T = 1):
  no exact method computes fewer (the frames differ and the GroupNorm statistics span all of
  them, so no level can drop a frame before conv_out, which already reads only the last two).
The floors divide them by a matrix rate: plain fp32 and TF32 by the datasheet (dense; no
sparsity), bf16 by the rate measured here (bench/floors.py). A float32 decode in cuDNN's
default mode runs TF32 tensor-core convolutions (PyTorch allows TF32 for cuDNN unless told
not to; the examples turn it off only when the whole run is float32).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.floors import DENSE_BF16_TFLOPS, FP32_DATASHEET_TFLOPS, TF32_DATASHEET_TFLOPS
from models.hunyuan_image3.presets import full_config
from models.hunyuan_image3.vae import HunyuanVAE, VAEConfig, VAEConv3d

TARGET_MS = 150.0   # the target: the VAE decode 1024x1024 on one GPU, golden-exact in float32


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
    cfg = VAEConfig.from_dict(full_config()["vae"])
    with torch.device("meta"):
        vae = HunyuanVAE(cfg)
    layers = []

    def record(module, args, output):
        x = args[0]
        layers.append({"name": names[module], "in": x.shape[1], "out": module.out_channels, "k": module.kernel_size[0],
                       "frames": x.shape[2], "h": output.shape[-2], "w": output.shape[-1], "batch": x.shape[0],
                       "folded": module.kernel_size[0] == 3 and x.shape[2] <= VAEConv3d.FOLD_MAX_FRAMES})

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
    rates = {"fp32 (datasheet, no tensor cores)": FP32_DATASHEET_TFLOPS, "tf32 (datasheet, dense)": TF32_DATASHEET_TFLOPS,
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024", help="square image sides, comma-separated")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    result = {"command": "python -m bench.probes.vae_flops " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "target_ms": TARGET_MS,
              "runs": [trace(int(s)) for s in args.sizes.split(",")]}
    for r in result["runs"]:
        print(f"{r['size']}x{r['size']}: {r['flops_now'] / 1e12:.1f} TFLOP now (counter {r['flop_counter_total'] / 1e12:.1f}),"
              f" {r['flops_needed'] / 1e12:.1f} needed; floors of the needed: "
              + ", ".join(f"{k.split()[0]} {v:.0f} ms" for k, v in r["floor_ms_of_needed"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
