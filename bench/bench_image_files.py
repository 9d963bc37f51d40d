"""The PNG of one generated image: dtgen's writer (dtgen/image_files.py) against Pillow's default.

    .venv/bin/python -m bench.bench_image_files --out bench/results/<dir>/bench_image_files.json

Two 1024x1024 RGB images: uniform noise (what random weights decode to; incompressible) and a
smooth image with a little noise (closer to a generated picture). Each encoder `--runs` times
per image after one warm-up; the JSON holds every time (ms), the median and range, the bytes,
and a check that dtgen's file reads back to the same pixels through Pillow.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from dtgen.image_files import MAX_THREADS, encode_png


def images(size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    smooth = np.stack([(x / 4) % 256, (y / 4) % 256, ((x + y) / 8) % 256], -1).astype(np.int16)
    smooth = np.clip(smooth + rng.integers(-6, 7, smooth.shape), 0, 255).astype(np.uint8)
    return {"noise": rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "smooth": smooth}


def pillow_png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def timed(fn, pixels: np.ndarray, runs: int) -> tuple[list[float], bytes]:
    data = fn(pixels)   # warm-up (the thread pool starts here)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        data = fn(pixels)
        times.append((time.perf_counter() - start) * 1e3)
    return times, data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    result = {"command": "python -m bench.bench_image_files " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "cpus": os.cpu_count(),
              "threads": min(MAX_THREADS, os.cpu_count() or 1), "size": args.size, "images": {}}
    for name, pixels in images(args.size).items():
        row = {}
        for encoder, fn in (("pillow", pillow_png), ("dtgen", encode_png)):
            times, data = timed(fn, pixels, args.runs)
            row[encoder] = {"ms": times, "median_ms": statistics.median(times), "min_ms": min(times),
                            "max_ms": max(times), "bytes": len(data)}
            if encoder == "dtgen":
                row[encoder]["reads_back_exact"] = bool(np.array_equal(np.asarray(Image.open(io.BytesIO(data))), pixels))
        row["pillow_over_dtgen"] = row["pillow"]["median_ms"] / row["dtgen"]["median_ms"]
        result["images"][name] = row
        print(f"{name}: Pillow {row['pillow']['median_ms']:.1f} ms ({row['pillow']['bytes'] / 1e6:.2f} MB), "
              f"dtgen {row['dtgen']['median_ms']:.1f} ms ({row['dtgen']['bytes'] / 1e6:.2f} MB), "
              f"{row['pillow_over_dtgen']:.2f}x", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
