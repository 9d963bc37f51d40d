"""Where a process's start goes: a model's example on rank 0, timed from the inside.

    torchrun --nproc-per-node 2 -m bench.startup_profile OUT_PREFIX [--cprofile] [--model M] -- <its arguments>

The model's example (its CLI) comes from the registry (models/registry.py): `--model` one of
its names, default the first (HunyuanImage-3, examples.hunyuan_t2i); its arguments follow `--`.

Rank 0 writes OUT_PREFIX.txt:
- the process's age when `main` starts (interpreter, imports) and when it ends;
- dynamo's own per-phase times for every graph (tracing, inductor, cache loads);
- every C build that Triton ran (a launcher or driver stub compiled with the system
  compiler: on a warm cache there should be none), with its time and the cache folder;
- with --cprofile, the functions with the most cumulative and the most own time. cProfile
  slows Python-heavy work (dynamo's tracing) far more than GPU or I/O waits: read the
  shares, not the seconds.
The other ranks run unprofiled.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time


def _record_triton_builds(builds: list[str]) -> None:
    """Note every C module Triton compiles (its `_build` runs the system compiler)."""
    from triton.runtime import build

    original = build._build

    def timed_build(name, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(name, *args, **kwargs)
        finally:
            builds.append(f"{name}: {time.perf_counter() - start:.2f} s "
                          f"(TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR', '-')})")

    build._build = timed_build


def parse_args(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this bench's options, the example's arguments): the bench's before `--`."""
    from models import registry
    p = argparse.ArgumentParser(prog="python -m bench.startup_profile", description=__doc__.split("\n")[0],
                                usage="%(prog)s OUT_PREFIX [--cprofile] [--model M] -- <the example's arguments>")
    p.add_argument("prefix", metavar="OUT_PREFIX")
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--model", choices=registry.names(), default=registry.default().name,
                   help="whose example to start (the registry's name)")
    if "--" not in args:
        if {"-h", "--help"} & set(args):
            p.parse_args(args)   # prints the help and exits
        p.error("the example's arguments follow `--`")
    split = args.index("--")
    return p.parse_args(args[:split]), args[split + 1:]


def main() -> int:
    from models import registry
    opts, argv = parse_args(sys.argv[1:])
    from dtgen.host import process_age_s
    example = registry.spec(opts.model).load("cli")

    if int(os.environ.get("RANK", 0)) != 0:
        return example.main(argv)
    builds: list[str] = []
    _record_triton_builds(builds)
    text = io.StringIO()
    text.write(f"process age at main: {process_age_s():.2f} s\n")
    profile = cProfile.Profile() if opts.cprofile else None
    code = profile.runcall(example.main, argv) if profile else example.main(argv)
    text.write(f"process age at the end: {process_age_s():.2f} s\n")
    text.write(f"== Triton C builds: {len(builds)}\n" + "".join(f"  {b}\n" for b in builds))
    from torch._dynamo.utils import compile_times
    text.write("== dynamo compile_times (one column per graph, in compile order)\n"
               + str(compile_times(repr="str")) + "\n")
    if profile:
        stats = pstats.Stats(profile, stream=text)
        text.write("== by cumulative time\n")
        stats.sort_stats("cumulative").print_stats(70)
        text.write("== by own time\n")
        stats.sort_stats("tottime").print_stats(30)
    os.makedirs(os.path.dirname(opts.prefix) or ".", exist_ok=True)
    with open(opts.prefix + ".txt", "w") as f:
        f.write(text.getvalue())
    return code


if __name__ == "__main__":
    from dtgen.launch import exit_process  # NCCL communicators stay up under torchrun: see there

    exit_process(main())
