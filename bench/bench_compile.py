"""Cold compile time against depth: whole-step graphs against regional compilation.

Each configuration runs the example in a fresh process with an empty compile cache (its own
$DTGEN_CACHE) on the tiny random model, compiled with inductor, and reads the compile seconds, graphs
and traced operations from its report. The figure: compile seconds at the deepest depth over the
shallowest (target <= 1.15 with regions; 1.0 is flat).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import Bench


def run(layers: int, mode: str, device: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        env["DTGEN_CACHE"] = tmp
        argv = [sys.executable, "-m", "examples.hunyuan_t2i", "--random-weights", "tiny", "--layers", str(layers),
                "--steps", "2", "--max-new-tokens", "4", "--ignore-eos", "--image-size", "256x256", "--compile",
                "--device", device, "--output", str(Path(tmp) / "i.png"), "--report", str(report)]
        argv += ["--compile-mode", "regions" if mode == "regions" else "step"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{mode} at {layers} layers failed:\n{done.stderr[-2000:]}")
        r = json.loads(report.read_text())
    c = r["compile"]
    return {"mode": mode, "layers": layers, "compile_s": c["compile_s"], "graphs": c["graphs"],
            "ops_traced": c.get("ops_traced"), "warmup_s": round(r["warmup_ms"] / 1e3, 1),
            "denoise_ms_per_step": round(r["timings_ms"]["denoise_step"], 1),
            "ar_ms_per_token": round(r["timings_ms"]["ar_decode_per_token"], 2)}


def main(argv=None) -> int:
    b = Bench("bench.bench_compile", __doc__, argv)
    p = b.parser
    p.add_argument("--layers", default="2,16")
    p.add_argument("--modes", default="regions,whole")
    p.add_argument("--device", default="cpu")
    args = b.parse()
    depths = [int(x) for x in args.layers.split(",")]
    rows = []
    for mode in args.modes.split(","):
        for layers in depths:
            rows.append(run(layers, mode, args.device))
            print(json.dumps(rows[-1]), flush=True)
    print("| mode | layers | compile s | graphs | ops traced | ratio to the shallowest |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["mode"] == r["mode"] and b["layers"] == min(depths))
        print(f"| {r['mode']} | {r['layers']} | {r['compile_s']:.1f} | {r['graphs']} | {r['ops_traced']} | "
              f"{r['compile_s'] / base['compile_s']:.2f} |")
    b.write({"rows": rows}, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
