"""Where a process's start goes: the T2I example on rank 0, timed from the inside.

    torchrun --nproc-per-node 2 -m bench.startup_profile OUT_PREFIX [--cprofile] -- <hunyuan_t2i arguments>

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


def main() -> int:
    args = sys.argv[1:]
    if "--" not in args or args.index("--") not in (1, 2) or args[1:2] not in ([], ["--"], ["--cprofile"]):
        print("usage: python -m bench.startup_profile OUT_PREFIX [--cprofile] -- <hunyuan_t2i arguments>",
              file=sys.stderr)
        return 2
    split = args.index("--")
    prefix, use_cprofile, argv = args[0], "--cprofile" in args[:split], args[split + 1:]
    from examples import hunyuan_t2i

    if int(os.environ.get("RANK", 0)) != 0:
        return hunyuan_t2i.main(argv)
    builds: list[str] = []
    _record_triton_builds(builds)
    text = io.StringIO()
    text.write(f"process age at main: {hunyuan_t2i._process_age_s():.2f} s\n")
    profile = cProfile.Profile() if use_cprofile else None
    code = profile.runcall(hunyuan_t2i.main, argv) if profile else hunyuan_t2i.main(argv)
    text.write(f"process age at the end: {hunyuan_t2i._process_age_s():.2f} s\n")
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
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".txt", "w") as f:
        f.write(text.getvalue())
    return code


if __name__ == "__main__":
    from dtgen.launch import exit_process  # NCCL communicators stay up under torchrun: see there

    exit_process(main())
