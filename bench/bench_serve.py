"""Server overhead: the same generations through `examples.hunyuan_serve` and in process.

    python -m bench.bench_serve [--world-size 2 --plan tp2] [--requests 5] [-- extra model flags]
    python -m bench.bench_serve --torchrun --world-size 2 --plan tp2 -- --random-weights full ...  (GPUs)

Runs `examples.hunyuan_t2i` with N prompts (in process, its report's per-request totals),
then a server with the same flags, and sends the same N requests one after another over
HTTP. Three figures per request, medians over the N:
- in process: the CLI's request total (`timings_ms.total`);
- server, inside: the pipeline's total as the server ran it (the per-step agreement of the
  ranks included, which the CLI does not do);
- server, end to end: what the client waited (HTTP, JSON, queue hand-off, PNG and base64).
Overhead = end to end / in process - 1. Target: <= 2% on the tiny model (issue 12).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_OVERHEAD = 0.02


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--plan", default="single")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--size", default="256x256", help="HxW (square by default, so WxH is the same)")
    p.add_argument("--torchrun", action="store_true",
                   help="launch both through torchrun, one process per rank (GPUs); else one process that "
                        "spawns its CPU ranks")
    p.add_argument("--timeout", type=float, default=900, help="seconds the server may take to become ready")
    p.add_argument("--out", default="outputs/bench_serve.json")
    p.add_argument("extra", nargs="*", help="more model flags for both runs (after --)")
    args = p.parse_args()
    prompts = [f"a red fox in fresh snow, take {i}" for i in range(args.requests)]
    common = ["--world-size", str(args.world_size), "--plan", args.plan, "--steps", str(args.steps),
              "--image-size", args.size, *args.extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              str(args.world_size)] if args.torchrun else [sys.executable]

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "t2i.json"
        cli = [*launch, "-m", "examples.hunyuan_t2i", *common, "--warmup", "--report", str(report),
               "--output", str(Path(tmp) / "img.png")]
        for prompt in prompts:
            cli += ["--prompt", prompt]
        subprocess.run(cli, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        in_process = [r["timings_ms"]["total"] for r in json.loads(report.read_text())["requests"]]

    port = _free_port()
    server_log = Path(args.out).with_suffix(".server.log")   # where to look when it fails
    server_log.parent.mkdir(parents=True, exist_ok=True)
    with server_log.open("w") as log:
        server = subprocess.Popen([*launch, "-m", "examples.hunyuan_serve", *common, "--port", str(port)],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    ready_by = time.monotonic() + args.timeout
    try:
        while True:
            try:
                with urllib.request.urlopen(base + "/ready", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
            if server.poll() is not None:
                sys.exit(f"the server exited before it was ready (its output: {server_log})")
            if time.monotonic() > ready_by:
                sys.exit(f"the server was not ready within {args.timeout:.0f} s")
        inside, end_to_end, new_graphs = [], [], []
        h, w = args.size.split("x")
        for prompt in prompts:
            t0 = time.perf_counter()
            answer = _post(base + "/v1/images/generations", {"prompt": prompt, "size": f"{w}x{h}", "seed": 0})
            end_to_end.append((time.perf_counter() - t0) * 1e3)
            inside.append(answer["dtgen"]["timings_ms"]["total"])
            new_graphs.append(answer["dtgen"]["new_graphs"])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)

    med = {k: statistics.median(v) for k, v in
           (("in_process_ms", in_process), ("server_inside_ms", inside), ("server_end_to_end_ms", end_to_end))}
    overhead = med["server_end_to_end_ms"] / med["in_process_ms"] - 1
    result = dict(world_size=args.world_size, plan=args.plan, steps=args.steps, size=args.size,
                  requests=args.requests, medians=med, per_request=dict(in_process_ms=in_process,
                                                                         server_inside_ms=inside,
                                                                         server_end_to_end_ms=end_to_end,
                                                                         new_graphs=new_graphs),
                  overhead=overhead, outside_generate_ms=med["server_end_to_end_ms"] - med["server_inside_ms"],
                  target_overhead=TARGET_OVERHEAD)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{args.plan} on {args.world_size} rank(s), {args.requests} requests of {args.steps} steps at {args.size}")
    for k, v in med.items():
        print(f"  {k:<22} {v:9.1f} ms (median)")
    print(f"  overhead               {overhead * 100:+.2f}% (target <= {TARGET_OVERHEAD * 100:.0f}%); outside the "
          f"pipeline {result['outside_generate_ms']:.1f} ms")
    print(f"  graphs compiled by each request after /ready: {new_graphs}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
