"""The GPU runner: the suites' steps (bench/suites.py), each in its own process under a time limit.

    python -m bench run-all decode,memory --out outputs/gpu     # every step of both suites
    python -m bench run-all kernels:moe,e2e:t2i --with t2i="--profile /tmp/prof" --limit t2i=300
    python -m bench run-all decode --tests "tests/framework/test_decode_gemv.py"   # GPU tests first
    python -m bench run-all --list                               # every step's command; nothing runs

Each step writes {out}/<step>.log and, where its script writes one, {out}/<step>.json; {out}/summary.txt
gets a line a step: its exit status (124: past its limit) and seconds. A step past its limit is ended
(its process group: torchrun's ranks too) and the next one starts. `bash bench/run_gpu.sh` sets a GPU
machine up first (carried wheels, golden cases).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.suites import SUITES, Step, Suite

PROG = "python -m bench run-all"
TAIL = 8   # log lines printed after each step


def _select(spec: str) -> list[tuple[Suite, Step]]:
    """`SUITE[,SUITE|SUITE:STEP...]` (empty: every suite) -> the steps, in the order given."""
    chosen = []
    for item in [x for x in spec.split(",") if x] or [s.name for s in SUITES]:
        name, _, step = item.partition(":")
        suite = next((s for s in SUITES if s.name == name), None)
        if suite is None:
            raise ValueError(f"unknown suite {name!r}; the suites: {', '.join(s.name for s in SUITES)}")
        steps = [st for st in suite.steps if not step or st.name == step]
        if not steps:
            raise ValueError(f"{name} has no step {step!r}; its steps: {', '.join(st.name for st in suite.steps)}")
        chosen += [(suite, st) for st in steps]
    return chosen


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{flag} {item!r}: STEP=VALUE")
        out[name] = value
    return out


def command(suite: Suite, step: Step, out: Path, extra: str = "") -> list[str]:
    """The step's command line, `extra` flags added to its script's (before a `--` that passes the rest on)."""
    part = next(p for p in suite.parts if p.name == step.part)
    args = shlex.split(step.args.format(out=out, ref_image=out / "ref_image.png"))
    at = args.index("--") if "--" in args else len(args)
    args[at:at] = shlex.split(extra)
    launch = [sys.executable]
    if step.gpus > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(step.gpus)]
    return launch + ["-m", part.module, *part.args, *args]


OUTPUT_FLAGS = ("--out", "--report", "--output")   # where a run writes: not what it measures


def measured(argv: list[str]) -> tuple[str, ...] | None:
    """`-m MODULE ARGS` less the flags that name its output files: what two commands must share to
    measure the same thing. None for a command that is not `python -m ...`."""
    if len(argv) < 3 or argv[0] not in ("python", "python3", sys.executable) or argv[1] != "-m":
        return None
    out, skip = [], False
    for a in argv[2:]:
        if skip:
            skip = False
        elif a in OUTPUT_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in OUTPUT_FLAGS)):
            out.append(a)
    return tuple(out)


def rerun_index() -> dict[tuple[str, ...], str]:
    """What each one-GPU step measures -> `SUITE:STEP` (bench.report names the step under a file it
    reruns)."""
    index = {}
    for suite in SUITES:
        for step in suite.steps:
            key = measured(command(suite, step, Path("OUT"))) if step.gpus == 1 else None
            if key is not None:
                index.setdefault(key, f"{suite.name}:{step.name}")
    return index


def _reference_image(path: Path) -> None:
    """A random 1024x1024 RGB PNG: an edit's reference (what it holds does not change the work)."""
    if path.exists():
        return
    import numpy as np
    from PIL import Image
    Image.fromarray((np.random.RandomState(5).rand(1024, 1024, 3) * 255).astype("uint8")).save(path)


def run_step(name: str, cmd: list[str], limit_s: float, out: Path) -> int:
    """The command under `limit_s`, its output in {out}/<name>.log; its exit status (124 past the limit)."""
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            rc = 124
    line = f"{name} rc={rc} {time.monotonic() - t0:.0f}s"
    with open(out / "summary.txt", "a") as summary:
        summary.write(line + "\n")
    print(line)
    lines = (out / f"{name}.log").read_text(errors="replace").splitlines()
    print("\n".join(f"  {x}" for x in [x for x in lines if "it/s]" not in x][-TAIL:]), flush=True)
    return rc


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("select", nargs="?", default="", metavar="SUITE[,SUITE|SUITE:STEP...]",
                   help="the suites (every step) or single steps; default: every suite")
    p.add_argument("--out", type=Path, default=Path("outputs/bench"), help="the run's folder (default outputs/bench)")
    p.add_argument("--with", dest="extra", action="append", default=[], metavar="STEP=FLAGS",
                   help="more flags for a step (its script's)")
    p.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="a step's time limit")
    p.add_argument("--tests", metavar="PATHS", help="first, these GPU tests (pytest; e.g. tests)")
    p.add_argument("--tests-marker", default="gpu and not multigpu", help="their marker (make test-gpu2: multigpu)")
    p.add_argument("--tests-limit", type=float, default=330)
    p.add_argument("--list", action="store_true", help="print each step's limit and command; run nothing")
    args = p.parse_args(argv)
    try:
        chosen = _select(args.select)
        extra, limits = _pairs(args.extra, "--with"), _pairs(args.limit, "--limit")
        limits = {k: float(v) for k, v in limits.items()}
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    unknown = sorted((set(extra) | set(limits)) - {st.name for _, st in chosen})
    if unknown:
        print(f"{PROG}: --with/--limit for steps not selected: {', '.join(unknown)}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    plan = [(st, command(s, st, out, extra.get(st.name, "")), limits.get(st.name, st.limit_s)) for s, st in chosen]
    if args.list:
        for st, cmd, limit in plan:
            gpus = f", {st.gpus} GPUs" if st.gpus > 1 else ""
            print(f"{st.name} ({limit:.0f} s{gpus}): {shlex.join(cmd)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    if args.tests:
        failed += run_step("tests", [sys.executable, "-m", "pytest", "-q", "-m", args.tests_marker, "-p",
                                     "no:cacheprovider", "--durations=10", "-rfs", *shlex.split(args.tests)],
                           args.tests_limit, out) != 0
    gpus = _gpus() if any(st.gpus > 1 for st, _, _ in plan) else None
    for st, cmd, limit in plan:
        if gpus is not None and st.gpus > gpus:
            print(f"{st.name}: skipped ({st.gpus} GPUs, {gpus} here)")
            continue
        if "{ref_image}" in st.args:
            _reference_image(out / "ref_image.png")
        failed += run_step(st.name, cmd, limit, out) != 0
    return 1 if failed else 0
