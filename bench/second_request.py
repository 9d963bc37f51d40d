"""Why a later request of a bucket runs slower than the first, on one GPU.

    python -m bench.second_request --out $OUT/second_request.json [--layers 16] [--profile] [-- more example flags]

`bench/results/h200-2026-12-01-regions-ti2i/single_16_regions*.json`: plan `single`, 16 layers,
`--compile --compile-regions`, prompts of 1251 and 1200 tokens (one bucket). The first
request's cached denoise steps ran ~259 ms, the second's ~290 (warm process) and ~315 (cold
process), with 0 new graphs; the first (whole-sequence) step did not move, and on 2 x H200
(`tp2`, 32 layers, the same per-GPU work) the second request was within 0.4%. The inputs of
the second request are the same in both processes (seeded), yet it differed by 8% between
them, while the first request did not move: something outside the computation.

This runs the same model (random weights, one process, compiled regions, warm-up, heap
frozen, as `examples.hunyuan_t2i` does) through the prompts 1251, 1200, 1251, 1200, 1200,
1251 (`--prompt-tokens` to change), and records for each request:
- every denoise step's device time (CUDA events around each CFG branch's step call);
- the GPU's SM clock, power, temperature and clock-event reasons over its cached steps
  (`nvidia-smi` sampled every 100 ms, raw samples in `<out>.smi.csv`);
- the caching allocator's counters (cudaMalloc / cudaFree calls, retries) over the request.
With `--profile`, one more 1251 and one more 1200 request under torch.profiler: the device
time of their denoise kernels, by kernel, and the difference.

How to read it:
- slower in position (every request after the first slower, whatever its length), with the
  SM clock lower and a power or thermal reason set: the GPU clocks down under sustained
  load (power cap / thermal), not dtgen; figures must then be taken at a settled clock;
- slower by prompt length (every 1200 request slower, in any position), clock steady: the
  computation differs (the bucket's hole, the routing of that prompt's rows); the profile
  diff names the kernels;
- cudaMalloc / cudaFree or retries during a slow request: the allocator (fragmentation
  after the VAE decode); try `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`;
- none of these, and the profile shows idle time between kernels: the host (launch
  latency of the eager code between the compiled layers).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from dtgen.host import settle_heap
from dtgen.launch import RankContext
from models.hunyuan_image3.cli import _requests, build_parser, build_pipeline, finish_args, prepare

DEFAULTS = ["--plan", "single", "--random-weights", "full", "--layers", "16", "--prompt-tokens",
            "1251,1200,1251,1200,1200,1251", "--max-new-tokens", "256", "--ignore-eos", "--image-size", "1024x1024",
            "--steps", "10", "--compile", "--compile-regions"]
SMI_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
# nvidia-smi's clock-event reason bits (older drivers call them throttle reasons)
REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "sw power cap", 0x8: "hw slowdown", 0x10: "sync boost",
           0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake", 0x100: "display clocks"}


class Telemetry:
    """nvidia-smi samples (monotonic time, values) in a thread; none when nvidia-smi is missing."""

    def __init__(self, csv_path: Path, period_ms: int = 100, enabled: bool = True):
        self.samples: list[tuple[float, list[str]]] = []
        self.problem = None
        fields = SMI_FIELDS
        ok = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True) if enabled and _has("nvidia-smi") else None
        if ok is not None and ok.returncode != 0:   # an older driver: "throttle" for "event"
            fields = fields.replace("clocks_event_reasons", "clocks_throttle_reasons")
            ok = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True)
        if ok is None or ok.returncode != 0:
            self.problem = "nvidia-smi missing or refused the query: no clock, power or temperature"
            self.proc = None
            return
        self.csv = csv_path.open("w")
        self.csv.write(f"monotonic_s,{fields}\n")
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                      "-i", "0", f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            now = time.monotonic()
            self.samples.append((now, [v.strip() for v in line.split(",")]))
            self.csv.write(f"{now:.3f},{line.strip()}\n")

    def window(self, start: float, end: float) -> dict:
        rows = [v for t, v in self.samples if start <= t <= end]
        if not rows:
            return {"samples": 0}

        def col(i):
            return [float(r[i]) for r in rows if len(r) > i and r[i].replace(".", "", 1).isdigit()]
        bits = 0
        for r in rows:
            try:
                bits |= int(r[4], 16)
            except (IndexError, ValueError):
                pass
        sm, power, temp = col(0), col(2), col(3)
        return {"samples": len(rows), "sm_mhz_mean": _mean(sm), "sm_mhz_min": min(sm, default=None),
                "power_w_mean": _mean(power), "temp_c_max": max(temp, default=None),
                "reasons": [name for bit, name in REASONS.items() if bits & bit]}

    def close(self):
        if self.proc is not None:
            self.proc.terminate()
            self.csv.close()


def _has(cmd: str) -> bool:
    from shutil import which
    return which(cmd) is not None


def _mean(xs):
    return round(statistics.fmean(xs), 1) if xs else None


ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")


def _alloc_counters() -> dict:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    out = {k: stats.get(k, 0) for k in ALLOC_KEYS}
    out["reserved_gb"] = round(stats.get("reserved_bytes.all.current", 0) / 1e9, 2)
    return out


def run_request(pipe, req, telemetry: Telemetry, profile: bool = False) -> dict:
    """One request with its denoise steps timed by events around each branch call."""
    calls = []
    inner = pipe._denoise_fn
    cuda = pipe.device.type == "cuda"

    def mark():
        if not cuda:   # a CPU smoke run (--device cpu --random-weights tiny): host time
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def timed(*a, **k):
        start = mark()
        out = inner(*a, **k)
        calls.append((start, mark()))
        return out

    stamps = {}

    def progress(phase, done, total):
        if phase == "denoise" and done == 1:
            stamps["cached_start"] = time.monotonic()
        if phase == "denoise" and done == total:
            stamps["cached_end"] = time.monotonic()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pipe._denoise_fn = timed
    before = _alloc_counters()
    sync()
    t0 = time.monotonic()
    prof = None
    try:
        if profile:
            from torch.profiler import ProfilerActivity
            prof = torch.profiler.profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
            prof.__enter__()
        result = pipe.generate(req, progress=progress)
        sync()
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
        pipe._denoise_fn = inner
    t1 = time.monotonic()
    after = _alloc_counters()
    branches = len(calls) // req.steps
    def ms(a, b):
        return a.elapsed_time(b) if cuda else (b - a) * 1e3
    steps = [ms(calls[i * branches][0], calls[i * branches + branches - 1][1]) for i in range(req.steps)]
    row = {"prompt_tokens": len(req.prompt_ids) + 1, "timings_ms": result.timings_ms,
           "step_ms": [round(s, 2) for s in steps],
           "cached_step_ms": {"mean": round(statistics.fmean(steps[1:]), 2), "min": round(min(steps[1:]), 2),
                              "max": round(max(steps[1:]), 2)},
           "allocator": {k: after[k] - before[k] for k in ALLOC_KEYS} | {"reserved_gb": after["reserved_gb"]},
           "gpu_during_cached_steps": telemetry.window(stamps.get("cached_start", t0), stamps.get("cached_end", t1)),
           "gpu_during_request": telemetry.window(t0, t1)}
    if prof is not None:
        kernels = {}
        for e in prof.key_averages():
            total = e.self_device_time_total if cuda else e.self_cpu_time_total
            if total > 0:
                kernels[e.key[:90]] = round(total / 1e3, 3)   # ms over the request
        row["kernel_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
    return row


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser("python -m bench.second_request", __doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/second_request.json")
    parser.add_argument("--profile-pair", action="store_true", dest="profile_pair",
                        help="after the timed requests, one request of each of the first two prompt lengths "
                             "under torch.profiler (device time by kernel)")
    # `--profile` is the example's own flag (a profiled run after the timed ones); here it means the pair
    argv = ["--profile-pair" if a == "--profile" else a for a in argv]
    args = finish_args(parser.parse_args(DEFAULTS + argv))
    problem, _ = prepare(args)
    if problem is not None:
        sys.exit(f"error: {problem}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pipe, loaded, device, dtype = build_pipeline(RankContext(0, 1, 0, torch.device("cpu"), "none"), args)
    if device.type != "cuda":
        print("note: no GPU: a smoke run of the script (host times, no telemetry)")
    requests = _requests(args)
    t0 = time.perf_counter()
    pipe.generate(replace(requests[0], steps=min(args.steps, 2)))   # the warm-up, as the example runs it
    warmup_s = time.perf_counter() - t0
    settle_heap()
    telemetry = Telemetry(out.with_suffix(".smi.csv"), enabled=device.type == "cuda")
    rows = []
    try:
        for i, req in enumerate(requests):
            rows.append({"position": i, **run_request(pipe, req, telemetry)})
            r = rows[-1]
            g = r["gpu_during_cached_steps"]
            print(f"request {i}: {r['prompt_tokens']} tokens, cached steps {r['cached_step_ms']['mean']:.1f} ms "
                  f"({r['cached_step_ms']['min']:.1f}-{r['cached_step_ms']['max']:.1f}), first "
                  f"{r['step_ms'][0]:.1f}; SM {g.get('sm_mhz_mean')} MHz, {g.get('power_w_mean')} W, "
                  f"{g.get('temp_c_max')} C, reasons {g.get('reasons')}; allocator {r['allocator']}", flush=True)
        profiled = []
        if args.profile_pair:
            lengths = sorted({len(r.prompt_ids) for r in requests}, key=[len(r.prompt_ids) for r in requests].index)
            for n in lengths[:2]:
                req = next(r for r in requests if len(r.prompt_ids) == n)
                profiled.append({"position": len(rows) + len(profiled), **run_request(pipe, req, telemetry, True)})
    finally:
        telemetry.close()
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "argv": argv,
              "layers": args.layers, "warmup_s": round(warmup_s, 1), "telemetry": telemetry.problem or "nvidia-smi",
              "requests": rows, "profiled": profiled}
    if len(profiled) == 2:
        a, b = (p["kernel_ms"] for p in profiled)
        diff = {k: round(b.get(k, 0.0) - a.get(k, 0.0), 3) for k in set(a) | set(b)}
        report["kernel_ms_diff"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:25])
        print(f"profiled: {profiled[0]['prompt_tokens']} tokens {sum(a.values()):.1f} ms of kernels, "
              f"{profiled[1]['prompt_tokens']} tokens {sum(b.values()):.1f} ms; largest differences:")
        for k, v in list(report["kernel_ms_diff"].items())[:10]:
            print(f"  {v:+9.3f} ms  {k}")
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
