"""What every benchmark script shares: its command line, timing, kernel profiles and the JSON it writes.

- `Bench(module, doc, argv)`: the script's argparse parser (its docstring as the help, `--out`),
  and `write(result)`, which writes the JSON with the command line and the environment.
- `median_ms` (triton's do_bench, of fn or of its CUDA graph's replay), `time_ms` (CUDA events; on the CPU
  wall time), `wall_ms` (a host loop between syncs), `graph_time_us` (calls replayed as one CUDA graph:
  a few-microsecond kernel's time, not its launch's), `summary` (median and range of repeats).
- `kernel_profile`: device time per call by kernel (torch.profiler), grouped by `kind_of`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def sync(device=None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 1, device=None) -> list[float]:
    """Milliseconds of each of `iters` calls after `warmup` calls: CUDA events on a GPU, wall time on the CPU."""
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def wall_ms(fn: Callable[[], object], iters: int, device=None) -> float:
    """Host milliseconds a call over `iters` back-to-back calls, synchronized before and after."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def median_ms(fn: Callable[[], object], graph: bool = False, warmup: int = 25, rep: int = 200) -> float:
    """triton.testing.do_bench's median milliseconds of fn (its L2 flushed between calls); `graph`: fn
    recorded once as a CUDA graph (after one call) and the replay timed."""
    import triton.testing
    if graph:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_time_us(calls: Sequence[Callable[[], object]], repeats: int, cuda: bool, warm: int = 2) -> dict:
    """Per-call microseconds of the no-argument `calls`: on CUDA one graph of all of them, replayed
    `repeats` times (its first `warm` calls run once on a side stream before the capture, as capture
    wants); on the CPU (smoke runs) wall time of the calls, `repeats` times."""
    if not cuda:
        return summary([wall_ms(lambda: [c() for c in calls], 1, "cpu") * 1e3 / len(calls) for _ in range(repeats)])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls[:warm]:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = time_ms(graph.replay, repeats, warmup=0)
    del graph
    return summary([t * 1e3 / len(calls) for t in times])


def kind_of(name: str) -> str:
    """A kernel's kind by its name: what a step's device time is spent on."""
    n = name.lower()
    if any(k in n for k in ("decode_gate_up", "decode_down", "moe", "expert")):
        return "routed_experts"
    if any(k in n for k in ("sdpa", "attention", "flash", "fmha", "split_kv", "qk_norm_rope")):
        return "attention"
    if any(k in n for k in ("nvjet", "gemv", "gemm", "fp8_linear", "scaled_mm", "cutlass", "xmma", "matmul")):
        return "dense_gemv"
    return "inductor" if n.startswith("triton_") else "other"   # inductor's: norms, RoPE, routing, residuals


def kernel_profile(fn: Callable[[], object], calls: int = 2, top: int = 20) -> dict:
    """Device time of `calls` calls under torch.profiler, per call: the total (us), the launches,
    the time by kind (`kind_of`) and the `top` kernels (name cut to 90 characters, us, launches)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key[:90], e.self_device_time_total / calls, e.count / calls) for e in prof.key_averages()
                   if e.self_device_time_total > 0), key=lambda r: -r[1])
    by_kind: dict[str, dict] = {}
    for name, us, n in rows:
        k = by_kind.setdefault(kind_of(name), {"us": 0.0, "launches": 0.0})
        k["us"], k["launches"] = k["us"] + us, k["launches"] + n
    return {"device_us": sum(us for _, us, _ in rows), "launches": sum(n for _, _, n in rows),
            "by_kind": by_kind, "top": [(name, round(us, 2), n) for name, us, n in rows[:top]]}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (L2, float32)."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def environment(device=None) -> dict:
    """Where a result was measured: the date, the device, torch's and triton's versions, the commit."""
    cuda = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "triton": triton_version, "commit": _commit()}


class Bench:
    """One script's run: its parser, its command line (`python -m MODULE ARGS`) and its JSON."""

    def __init__(self, module: str, doc: str, argv: list[str] | None = None):
        self.module = module
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.command = " ".join(["python -m " + module, *self.argv])
        self.parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                              formatter_class=argparse.RawDescriptionHelpFormatter)

    def parse(self, out: str | None = None) -> argparse.Namespace:
        """The arguments, `--out` added (default `out`: where the JSON goes; None: nowhere unless given)."""
        self.parser.add_argument("--out", default=out, help=f"the JSON written (default {out or 'none'})")
        self.args = self.parser.parse_args(self.argv)
        return self.args

    def write(self, result: dict, device=None, path: str | Path | None = None, quiet: bool = False) -> dict:
        """{command, the environment, **result} to `path` (default --out; none: nothing written)."""
        doc = {"command": self.command, **environment(device), **result}
        path = path or getattr(self, "args", None) and self.args.out
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
            if not quiet:
                print(f"wrote {path}", flush=True)
        return doc


def need_cuda(module: str) -> int:
    """The exit status of a GPU-only script started without a GPU (2), after saying so."""
    print(f"{module} needs a CUDA GPU", file=sys.stderr)
    return 2


def interpret_triton_on_cpu() -> None:
    """Without a GPU, Triton kernels run under the interpreter (a script's --smoke path)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
