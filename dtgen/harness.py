"""What every model's command shares: the launch and compile flags, the launch checks, running a
rank function on every rank, the ranks' facts for the report, `--check` numbers and the table.

A model's command (models/<m>/cli.py, run by `dtgen run`) supplies its model's flags, a
`run_rank(ctx, args) -> dict` and its report. Nothing here knows a model.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from .compile import CompileReport, StepCompiler, graph_breaks, unique_graphs
from .devices import parse_device, parse_dtype
from .launch import RankContext, RankFailure, run_on_ranks, under_torchrun


# Under torchrun, how long the ranks other than 0 wait before leaving after a refused command line.
REFUSE_GRACE_S = 3.0


# ---- flags ----------------------------------------------------------------------------------
def add_launch_flags(p: argparse.ArgumentParser, plans) -> None:
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: torchrun's WORLD_SIZE, else 1; without torchrun, >1 spawns CPU gloo ranks)")
    p.add_argument("--plan", default=None, help=f"one of {sorted(plans)}")
    p.add_argument("--stall-timeout", type=float, default=300.0,
                   help="under torchrun: seconds without progress (while no rank compiles) before a rank prints "
                        "every thread's stack; after twice that the job ends")


COMPILE_MODES = ("regions", "step")


def add_compile_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (fullgraph), as --compile-mode says; a warm-up run compiles "
                        "every graph first")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                   help="with --compile: 'regions' compiles one decoder layer (block) once for all of them and "
                        "runs the code between layers eagerly (compile time flat with depth; on GPU the AR decode "
                        "step is still one CUDA graph), 'step' compiles each phase step as one graph "
                        "(default: regions on GPU, step on the CPU)")
    p.add_argument("--compile-backend", default=None,
                   help="with --compile: the torch.compile backend (inductor, the default; aot_eager, eager, ...)")
    p.add_argument("--compile-regions", action="store_true",
                   help="with --compile: the same as --compile-mode regions (kept for older command lines)")


def run_device_type(args: argparse.Namespace) -> str:
    """'cuda' or 'cpu': where the ranks of this command line will run (spawned ranks: the CPU)."""
    if args.world_size > 1 and not under_torchrun():
        return "cpu"
    return parse_device(args.device).type


def compile_problem(args: argparse.Namespace) -> str | None:
    """A compile flag that needs another, given without it, as one line (or None); then the
    defaults that depend on the device: --compile-mode (regions on GPU, step on the CPU) and
    --compile-backend (inductor). Flags a model's CLI lacks are skipped (Wan has no CUDA-graph
    decode)."""
    given = {"--compile-mode": args.compile_mode is not None, "--compile-regions": args.compile_regions,
             "--compile-backend": args.compile_backend is not None,
             "--compile-autotune": bool(getattr(args, "compile_autotune", False)),
             "--cuda-graph" if getattr(args, "cuda_graph", None) else "--no-cuda-graph":
                 getattr(args, "cuda_graph", None) is not None}
    if not args.compile:
        for flag, on in given.items():
            if on:
                return f"{flag} needs --compile (without it every step runs eagerly)"
    if args.compile_regions and args.compile_mode == "step":
        return "--compile-regions is --compile-mode regions: give one of them, not --compile-mode step too"
    device = run_device_type(args)
    if getattr(args, "cuda_graph", None) is not None and device != "cuda":
        flag = "--cuda-graph" if args.cuda_graph else "--no-cuda-graph"
        return f"{flag} applies on CUDA (the decode step's CUDA graph); this run's device is {device}"
    args.compile_backend = args.compile_backend or "inductor"
    if getattr(args, "compile_autotune", False) and args.compile_backend != "inductor":
        return (f"--compile-autotune tunes inductor's GEMMs: it needs --compile-backend inductor, "
                f"not {args.compile_backend}")
    if args.compile_regions:
        args.compile_mode = "regions"
    if args.compile_mode is None:
        args.compile_mode = "regions" if device == "cuda" else "step"
    return None


def add_report_flags(p: argparse.ArgumentParser, output: str) -> None:
    p.add_argument("--check", action="store_true", help="also run the single-process model and report deviations")
    p.add_argument("--profile", nargs="?", const="outputs/profile", default=None, metavar="DIR",
                   help="after the timed run, one more run under the profiler (the timed figures never are): "
                        "per-phase table, Chrome traces, top kernels and a PNG chart into DIR (outputs/profile)")
    p.add_argument("--output", default=output)
    p.add_argument("--report", help="write a JSON report here")


def add_run_flags(p: argparse.ArgumentParser, plans, output: str, cli: bool, cli_only: dict, model: str):
    """The launch and compile flags; then on a CLI the report flags, or on a server (`cli=False`,
    examples.serve) the values of the flags only a CLI reads (`cli_only`, the report's off)
    and a group for the model's own server flags, returned (None on a CLI)."""
    add_launch_flags(p, plans)
    add_compile_flags(p)
    if cli:
        add_report_flags(p, output)
        return None
    p.set_defaults(**{"check": False, "profile": None, "output": None, "report": None, **cli_only})
    return p.add_argument_group(f"server ({model})")


def finish_launch_args(args: argparse.Namespace, default_plan: Callable[[int], str]) -> argparse.Namespace:
    """--world-size from torchrun when not given; --plan from the world size when not given."""
    if args.world_size is None:
        args.world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1
    if args.plan is None:
        args.plan = default_plan(args.world_size)
    return args


def launch_problem(args: argparse.Namespace, plan) -> str | None:
    """The first problem with how the run is launched, as one line, or None."""
    if plan.world_size != args.world_size:
        return f"plan '{plan.name}' runs on {plan.world_size} ranks, --world-size is {args.world_size}"
    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != args.world_size:
        return f"--world-size {args.world_size} but torchrun started {os.environ['WORLD_SIZE']} ranks"
    if args.world_size > 1 and not under_torchrun() and args.device not in ("auto", "cpu"):
        return "spawned ranks run on the CPU (gloo); start multi-GPU runs with torchrun"
    parse_dtype(args.dtype, parse_device(args.device) if args.world_size == 1 or under_torchrun()
                else torch.device("cpu"))  # raises ValueError naming a bad --dtype / --device
    return None


def output_path_problem(path: str | None, flag: str) -> str | None:
    """One line when the file `flag` names could not be written (checked before anything
    loads): a folder at that path, or a first existing folder above it that is a file or
    cannot be written in. Folders still missing are fine: the writer makes them."""
    if path is None:
        return None
    target = Path(path)
    if target.is_dir():
        return f"{flag} {path} is a folder; name the file to write"
    above = target.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        return f"{flag} {path}: {above} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK):  # as root: still refused on a read-only file system
        return f"{flag} {path}: the folder {above} cannot be written"
    return None


def refuse(problem: str) -> int:
    """Print a command-line problem as one line and return exit status 2. Under torchrun
    every rank runs main(): rank 0 alone prints, and the others leave a moment later, because
    torchrun stops every rank as soon as one exits and rank 0 could be stopped before its line
    is out (seen on a loaded 2-core machine)."""
    if under_torchrun() and int(os.environ.get("RANK", 0)) != 0:
        time.sleep(REFUSE_GRACE_S)
    else:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    return 2


# ---- running ----------------------------------------------------------------------------------
def rank_device(ctx: RankContext, args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    device = ctx.device if ctx.backend == "nccl" else parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    if device.type == "cuda" and dtype == torch.float32:
        # float32 means float32: cuDNN convolutions default to TF32 (10-bit mantissa), whose
        # rounding turns 1e-6 input differences into 1e-3 output ones.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return device, dtype


def example_main(args: argparse.Namespace, prepare: Callable, run_rank: Callable[[RankContext, argparse.Namespace], dict],
                 write_report: Callable, preload: tuple[str, ...] = ()) -> int:
    """An example's main: `prepare(args)` -> (problem or None, tiny); then run_rank(ctx, args)
    on every rank (spawned gloo ranks, torchrun's, or here) and `write_report(args, rank 0's
    result, tiny)` on rank 0. Exit status: 0, 1 after a rank failed, 2 for a refused command line."""
    problem, tiny = prepare(args)
    if problem is not None:
        return refuse(problem)
    if tiny and int(os.environ.get("RANK", "0")) == 0:
        print("note: no --checkpoint, so this runs the tiny default, a random model: its output is noise; "
              "a real checkpoint goes in --checkpoint DIR")
    try:
        results = run_on_ranks(run_rank, args.world_size, args, stall_s=args.stall_timeout, preload=preload)
    except RankFailure as e:  # spawned ranks; under torchrun a failure never returns here
        if e.report() is not None:
            print(f"error: {e.report()}", file=sys.stderr)
        return 1
    except Exception as e:  # one process: an error whose message says it all, as ranks say it (dtgen.launch)
        if not getattr(e, "one_line", False):   # a request the model cannot take, an option the device cannot run
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    main_result = next((r for r in results if r["rank"] == 0), None)
    if main_result is not None:  # under torchrun only rank 0 reports
        write_report(args, main_result, tiny)
    return 0


def gather_rank_facts(ctx: RankContext, facts: dict, control_group) -> list[dict]:
    """Every rank's small facts, on every rank (under torchrun only rank 0 reports)."""
    if ctx.world_size == 1:
        return [facts]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, facts, group=control_group)
    return everyone


@contextmanager
def reference_threads(ctx: RankContext, device: torch.device):
    """For `--check`'s single-process reference on rank 0: spawned CPU ranks run one thread
    each; once every other rank is done, the reference may use all the cores."""
    threads = torch.get_num_threads()
    if ctx.backend == "gloo" and device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def compile_facts(compiler: StepCompiler, warm_graphs: int) -> dict:
    """The report's compile section: graphs, breaks, recompiles after the warm-up, seconds,
    what dynamo traced (grows with depth unless the layers share a region), cache hits."""
    breaks = graph_breaks()
    out = CompileReport(graphs=unique_graphs(), graph_breaks=sum(breaks.values()), break_reasons=breaks,
                        recompiles_after_warmup=unique_graphs() - warm_graphs, compile_s=compiler.compile_s).as_dict()
    out["regions"] = compiler.options.regions
    out["mode"] = "regions" if compiler.options.regions else "step"
    out["ops_traced"] = int(counters["stats"].get("calls_captured", 0))
    out["cudagraph_skips"] = int(counters["inductor"].get("cudagraph_skips", 0))
    # the on-disk caches (inductor's FX graph cache, AOTAutograd's): hits are graphs not compiled again
    out["cache"] = {k: int(counters[group].get(k, 0)) for group, k in (
        ("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
        ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"))}
    return out


# ---- numbers and the table ----------------------------------------------------------------------
def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((float((x.float().cpu() - y.float().cpu()).abs().max()) for x, y in zip(a, b)), default=0.0)


def rel_l2(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all the tensors together."""
    if len(a) != len(b) or not b:
        return float("inf") if len(a) != len(b) else 0.0
    diff = sum(float((x.float().cpu() - y.float().cpu()).pow(2).sum()) for x, y in zip(a, b))
    ref = sum(float(y.float().cpu().pow(2).sum()) for y in b)
    return (diff / max(ref, 1e-30)) ** 0.5


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
