"""Failures forced at a given step, for the tests of the error paths: a rank raises, hangs or
runs out of memory where a test says, in a real server or CLI run and in every rank process
it starts. The product has no such switch; only tests install this.

    python -m tests.support.faults SPEC MODULE [ARGS...]

runs what `python -m MODULE ARGS` runs (`dtgen serve ...`, `dtgen run ...`, examples.X) with
SPEC armed.
SPEC is RANK:PHASE:STEP[:MODE][,...]; each item fires once, on RANK (* every rank) after STEP
of PHASE: it raises there (no MODE), hangs there ("hang": a stall watch must notice), or makes
the model's last block raise inside the next step ("inside": a RuntimeError, "oom": an
out-of-memory error) or hang there ("hang_inside": a rank to kill in the middle of a step),
after the collectives of the blocks before it.
- A server fails in its adapter's step hook (`ServeAdapter.on_step`, which every rank calls
  before the ranks agree to go on), in the first job that gets there; warm-ups never call it.
- A CLI fails in its timed requests' progress hook (`request_progress` of the model's CLI
  module, the model the command line names), not in its warm-up, raising `InjectedFailure`;
  "inside" and "oom" need a server.

How the ranks get it: under torchrun every rank runs this module. A spawned rank runs it again
as its main module (`__mp_main__`: multiprocessing's start preparation, before the rank's job),
and that import arms it from the environment this module's `main` sets (`SPEC_ENV`,
`MODULE_ENV`: the model's CLI module).
"""
from __future__ import annotations

import importlib
import os
import re
import sys
import time

import torch

SPEC_ENV, MODULE_ENV = "DTGEN_TEST_FAULTS", "DTGEN_TEST_FAULTS_MODULE"
MODES = ("", "hang", "inside", "oom", "hang_inside")

# The block an "inside" or "oom" failure raises from, by pipeline class: the model's last.
_LAST_BLOCK = {
    "HunyuanT2IPipeline": lambda pipe: pipe.model.model.layers[-1],
    "WanT2VPipeline": lambda pipe: pipe.model.transformer.blocks[-1],
    "QwenImagePipeline": lambda pipe: pipe.model.transformer.transformer_blocks[-1],
}


class InjectedFailure(RuntimeError):
    """Raised on purpose in a CLI run (tests of the error path)."""


def parse(text: str) -> list[tuple]:
    """"RANK:PHASE:STEP[:MODE][,...]" -> [(rank or "*", phase, step, mode)]; ValueError (one
    line) for a bad item."""
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if (len(parts) not in (3, 4) or not (parts[0].isdigit() or parts[0] == "*")
                or not re.fullmatch(r"[a-z_]+", parts[1]) or not parts[2].isdigit()
                or (parts[3:] or [""])[0] not in MODES):
            raise ValueError(f"faults {text!r}: expected RANK:PHASE:STEP[:hang|:inside|:oom|:hang_inside][,...], "
                             "RANK a number or *")
        out.append((parts[0] if parts[0] == "*" else int(parts[0]), parts[1], int(parts[2]), (parts[3:] or [""])[0]))
    return out


class Injections:
    """This rank's share of the failures, each once, at the step where it is due: `at(phase,
    done)` raises, hangs, or makes the block `last_block()` returns raise in its next forward."""

    def __init__(self, faults: list[tuple], rank: int, last_block=None, error: type = RuntimeError):
        self.faults, self.rank, self.last_block, self.error = list(faults), rank, last_block, error
        if last_block is None and any(mode in ("inside", "oom", "hang_inside") for *_, mode in self.faults):
            raise ValueError("faults: 'inside', 'oom' and 'hang_inside' act in the model's last block: give them "
                             "to a server")

    def at(self, phase: str, done: int) -> None:
        for i, (rank, p, step, mode) in enumerate(self.faults):
            if (rank == "*" or rank == self.rank) and (p, step) == (phase, done):
                del self.faults[i]
                break
        else:
            return
        while mode == "hang":  # a stall watch must notice, report and end the job
            time.sleep(1.0)
        if mode == "hang_inside":
            hang_inside(self.last_block())
            return
        what = f"injected failure: rank {self.rank} fails"
        if mode == "":
            raise self.error(f"{what} after {phase} step {done}")
        error = (torch.OutOfMemoryError(f"{what} (out of memory) inside the step after {phase} step {done}")
                 if mode == "oom" else self.error(f"{what} inside the step after {phase} step {done}"))
        raise_inside(self.last_block(), error)


def raise_inside(module: torch.nn.Module, error: BaseException) -> None:
    """Make `module`'s next forward raise `error`, once: a failure INSIDE a step."""
    def hook(*_):
        handle.remove()
        raise error
    handle = module.register_forward_pre_hook(hook)


def hang_inside(module: torch.nn.Module) -> None:
    """Make `module`'s next forward hang: a rank stuck in the middle of a step, its peers in
    the step's next collective."""
    def hook(*_):
        while True:
            time.sleep(1.0)
    module.register_forward_pre_hook(hook)


def last_block(pipe):
    name = type(pipe).__name__
    if name not in _LAST_BLOCK:
        raise ValueError(f"faults: no last block known for {name} (tests/support/faults.py _LAST_BLOCK)")
    return _LAST_BLOCK[name](pipe)


def _arm_servers(faults: list[tuple]) -> None:
    """Every server's engine built from now on wraps its adapter's step hook."""
    from dtgen.serve import server
    if getattr(server.Engine, "faults", None) is not None:   # armed already (another copy of this module)
        return

    class FaultyEngine(server.Engine):
        def __init__(self, link, adapter, *args, **kwargs):
            injections = Injections(faults, link.rank, lambda: last_block(adapter.pipe))
            on_step = adapter.on_step

            def step(phase: str, done: int, total: int) -> None:
                on_step(phase, done, total)
                injections.at(phase, done)
            adapter.on_step = step
            super().__init__(link, adapter, *args, **kwargs)

    FaultyEngine.faults = faults
    server.Engine = FaultyEngine


def _arm_cli(cli, faults: list[tuple]) -> None:
    """The CLI module's timed requests fail where `faults` say (a module without timed
    requests, such as a server's, is left as it is)."""
    made = getattr(cli, "request_progress", None)
    if made is None or getattr(made, "faults", None) is not None:
        return

    def request_progress(ctx, *args, **kwargs):
        hook = made(ctx, *args, **kwargs)
        injections = Injections(faults, ctx.rank, error=InjectedFailure)

        def progress(phase: str, done: int, total: int) -> None:
            hook(phase, done, total)
            injections.at(phase, done)
        return progress

    request_progress.faults = faults
    cli.request_progress = request_progress


def install(spec: str, module: str | None = None) -> None:
    """Arm `spec` in this process: its servers and, when given, the model's CLI `module`."""
    faults = parse(spec)
    _arm_servers(faults)
    if module:
        _arm_cli(importlib.import_module(module), faults)


def _entry(module: str):
    """The module whose `main` `python -m MODULE` runs: MODULE, or a package's __main__."""
    found = importlib.import_module(module)
    return found if hasattr(found, "main") else importlib.import_module(module + ".__main__")


def _cli_module(args: list[str]) -> str | None:
    """The CLI module of the model the command line runs (--checkpoint's, --model's, or the
    registry's default), as `dtgen run` and `dtgen serve` choose it."""
    from dtgen.cli import choose_model
    spec, _ = choose_model(args)
    return spec.cli_module if spec is not None else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 2:
        print("usage: python -m tests.support.faults RANK:PHASE:STEP[:MODE][,...] MODULE [ARGS...]", file=sys.stderr)
        return 2
    spec, module, args = argv[0], argv[1], argv[2:]
    cli = _cli_module(args)
    os.environ[SPEC_ENV] = spec
    if cli is not None:
        os.environ[MODULE_ENV] = cli
    install(spec, cli)
    return _entry(module).main(args)


if os.environ.get(SPEC_ENV):   # a spawned rank, running the main module again as __mp_main__
    install(os.environ[SPEC_ENV], os.environ.get(MODULE_ENV))


if __name__ == "__main__":
    # Run as the module itself, not as __main__, so that what it arms (InjectedFailure in a
    # traceback) is named tests.support.faults wherever it fires.
    from dtgen.launch import exit_process
    from tests.support import faults
    exit_process(faults.main())
