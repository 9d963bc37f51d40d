"""The `dtgen` command (`python -m dtgen` too): one entry point for every registered model.

    dtgen models                                     # each model: what it makes, its plans, its checkpoint layout
    dtgen run --model wan --steps 2                  # one job on the tiny default, one process (CPU)
    dtgen run --model qwen-image --world-size 2 --plan cfg2 --check    # 2 gloo ranks spawned here
    dtgen run --checkpoint /path/to/Wan2.1-T2V-14B-Diffusers --height 480 --width 832
    torchrun --nproc-per-node 4 -m dtgen run --checkpoint /path/to/HunyuanImage-3 --world-size 4 --plan hybrid
    dtgen serve --model qwen-image --port 8000      # the HTTP server (images; video jobs for Wan)
    dtgen bench                                      # the benchmark suites (python -m bench)
    torchrun --nproc-per-node 2 -m dtgen serve --checkpoint /path/to/HunyuanImage-3 --world-size 2 \\
        --plan tp2 --compile --warmup-shapes 256:1024x1024 --port 8000

`run` and `serve` take the model the --checkpoint folder holds (its layout: models/registry.py
detects it), or --model's tiny default when there is no checkpoint (with one, --model must
agree). Every other flag is the model's own: `dtgen run --model M --help` lists them (plan,
world size, device, dtype, compile, profile, report, check, memory levers, the request's
fields); on `serve` the request flags are the defaults of the fields a request leaves out.

The server: rank 0 answers HTTP (HunyuanImage-3's official folder: /v1/images/generations
and /v1/images/edits; a diffusers WanPipeline folder: /v1/videos; a diffusers
QwenImagePipeline folder: /v1/images/generations); every rank warms up first (/ready says
when), then runs each job in lockstep with the others. The generic server is `dtgen.serve`;
this module only plugs the model's pipeline in (its CLI's `serve_adapter`).

dtgen's core knows no model: the registry is the module `MODEL_REGISTRY` names, imported
when a command needs it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from dtgen.harness import refuse
from dtgen.launch import RankContext, RankFailure, exit_process, run_on_ranks
from dtgen.registry import MODEL_REGISTRY, ModelSpec

COMMANDS = {"run": "one job of a model (`dtgen run --model M --help`: its flags)",
            "serve": "serve a model over HTTP (`dtgen serve --model M --help`)",
            "models": "list the models, their plans and checkpoint layouts",
            "bench": "the benchmark suites of a source checkout (`dtgen bench` lists them)"}


def _registry():
    return importlib.import_module(MODEL_REGISTRY)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    registry = _registry()
    g.add_argument("--model", choices=registry.names(), default=None,
                   help=f"the tiny default to serve without --checkpoint (default {registry.default().name}); with "
                        "one, it must be the model the checkpoint holds")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-queued", type=int, default=16, help="jobs waiting; more are answered 429")
    g.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="a job not done this long after it was submitted is cancelled and answered 504")
    g.add_argument("--ping", type=float, default=1.0, metavar="SECONDS",
                   help="while idle, rank 0 checks the other ranks this often")
    g.add_argument("--end-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="after a job fails on one rank, how long every other rank has to leave it; a rank still "
                        "inside (stuck in a collective its peer left) ends the server with the job's message")
    g.add_argument("--max-upload-mb", type=float, default=32.0,
                   help="a request body (an edit's image) larger than this is answered 413")
    g.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="run up to N waiting requests of one denoise shape together, their denoise steps as rows "
                        "of one batch (each keeps its seed, guidance, cache, progress, cancel and deadline); "
                        "for models whose spec names what a batch shares (`dtgen models` says which; default: 4 on a "
                        "GPU, 1 on the CPU, where a batch saves no time)")
    g.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="LoRA adapters resident at once (POST /v1/loras, and the --lora files, which every request "
                        "that gives no `loras` carries); loading one more evicts the least recently used one no "
                        "queued or running request holds (default 8)")


def _server_problem(args, spec: ModelSpec) -> str | None:
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    for flag, value in (("--max-queued", args.max_queued), ("--ping", args.ping), ("--end-timeout", args.end_timeout),
                        ("--max-upload-mb", args.max_upload_mb)):
        if value <= 0:
            return f"{flag} must be > 0, got {value}"
    if args.deadline is not None and args.deadline <= 0:
        return f"--deadline must be > 0 seconds, got {args.deadline}"
    if args.max_batch is not None and args.max_batch < 1:
        return f"--max-batch must be >= 1, got {args.max_batch}"
    if not hasattr(args, "lora"):   # a model whose command has no --lora
        if args.max_loras is not None:
            return f"--max-loras: {spec.title}'s server takes no LoRA adapters"
    else:
        args.max_loras = 8 if args.max_loras is None else args.max_loras
        if args.max_loras < 1:
            return f"--max-loras must be >= 1, got {args.max_loras}"
        resident = 0 if getattr(args, "lora_merge", False) else len(args.lora or [])
        if resident > args.max_loras:
            return f"--max-loras {args.max_loras}: {resident} --lora adapters are resident from the start"
    if not spec.batches:
        if args.max_batch is not None and args.max_batch > 1:
            return (f"--max-batch {args.max_batch}: {spec.title}'s server runs one request at a time (its spec "
                    "names nothing a batch shares); use --max-batch 1")
        args.max_batch = 1
    return None


def _max_batch(args) -> int:
    import torch
    return args.max_batch if args.max_batch is not None else 4 if torch.cuda.is_available() else 1


def _options(args):
    from dtgen.serve.server import ServeOptions
    return ServeOptions(host=args.host, port=args.port, max_queued=args.max_queued, deadline_s=args.deadline,
                        ping_s=args.ping, end_timeout_s=args.end_timeout,
                        max_upload_bytes=int(args.max_upload_mb * (1 << 20)), max_batch=_max_batch(args),
                        max_loras=args.max_loras,
                        models=tuple((s.makes, s.title) for s in _registry().specs()))


def choose_model(argv, only: str | None = None, prog: str = "dtgen") -> tuple[ModelSpec | None, str | None]:
    """(the model's spec, or None) and (a one-line problem, or None) from --checkpoint / --model."""
    registry = _registry()
    # no abbreviations: a model's own --check is not this parser's --checkpoint
    first = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    first.add_argument("--checkpoint")
    first.add_argument("--model", choices=registry.names())
    known, _ = first.parse_known_args(argv)
    try:
        found = registry.detect(known.checkpoint) if known.checkpoint else None
    except ValueError as e:
        return None, str(e)
    if known.model and found and known.model != found.name:
        return None, f"--model {known.model}, but --checkpoint {known.checkpoint} holds {found.name}"
    spec = found or registry.spec(known.model or only or registry.default().name)
    if only and spec.name != only:
        what = f"--checkpoint {known.checkpoint} holds {spec.name}" if found else f"--model {spec.name}"
        return None, f"{what}; this launcher serves {only} (use dtgen serve)"
    return spec, None


def serve_rank(ctx: RankContext, args) -> None:
    from dtgen.serve.server import serve
    adapter = _registry().spec(args.model).load("cli").serve_adapter(ctx, args, _max_batch(args))
    serve(ctx.rank, ctx.world_size, adapter, _options(args), heartbeat=ctx.progress, peers=ctx.peers)


def serve_main(argv=None, prog: str = "dtgen serve", only: str | None = None) -> int:
    """`dtgen serve`: the model's server on every rank (`only`: a launcher of one model)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    spec, problem = choose_model(argv, only, prog)
    if problem is not None:
        return refuse(problem)
    cli = spec.load("cli")
    what = "async video jobs" if spec.makes == "video" else "images"
    parser = cli.build_parser(prog, f"Serve {spec.title} over HTTP ({what})", cli=False)
    add_server_flags(parser)
    args = cli.finish_args(parser.parse_args(argv))
    args.model = spec.name
    problem = _server_problem(args, spec) or cli.prepare(args)[0]
    if problem is None and hasattr(cli, "serve_problem"):
        problem = cli.serve_problem(args)
    from dtgen.serve.server import ServerStopped, address_problem
    if problem is None and int(os.environ.get("RANK", "0")) == 0:  # under torchrun rank 0 alone listens
        problem = address_problem(args.host, args.port)
    if problem is not None:
        return refuse(problem)
    try:
        run_on_ranks(serve_rank, args.world_size, args, stall_s=args.stall_timeout, job_deadline_s=float("inf"),
                     preload=(spec.cli_module, "dtgen.serve.app"))
    except RankFailure as e:
        if e.report() is not None:   # else rank 0 printed why, in one line
            print(f"error: the server stops: {e.report()}", file=sys.stderr)
        return 1
    except ServerStopped:  # one process: rank 0 printed why
        return 1
    return 0


def _without_model(argv: list[str]) -> list[str]:
    """argv less `--model M` / `--model=M` (a model's own CLI has no --model)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--model":
            skip = True
        elif not a.startswith("--model="):
            out.append(a)
    return out


def run_main(argv=None) -> int:
    """`dtgen run`: one job of the model --checkpoint holds (or --model's tiny default)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv in (["-h"], ["--help"]):
        names = ", ".join(_registry().names())
        print(f"usage: dtgen run [--model {{{names}}}] [--checkpoint DIR] [the model's flags]\n\n"
              "One job of a model; `dtgen run --model M --help` lists the model's flags.")
        return 0
    spec, problem = choose_model(argv, prog="dtgen run")
    if problem is not None:
        return refuse(problem)
    if spec.cli is None:
        return refuse(f"{spec.title} has no command (its spec names no cli)")
    return spec.load("cli").main(_without_model(argv), prog=f"dtgen run --model {spec.name}")


def model_rows() -> list[dict]:
    """What `dtgen models` shows, one dict a model."""
    rows = []
    for spec in _registry().specs():
        plans = spec.load("plans").PLANS
        rows.append({"model": spec.name, "title": spec.title, "makes": spec.makes,
                     "plans": {name: plan.world_size for name, plan in plans.items()},
                     "checkpoint": spec.layout, "batches": spec.batches,
                     "tiny_default": f"dtgen run --model {spec.name} (no --checkpoint)"})
    return rows


def models_main(argv=None) -> int:
    """`dtgen models [--json]`."""
    p = argparse.ArgumentParser(prog="dtgen models", description=COMMANDS["models"])
    p.add_argument("--json", action="store_true", help="one JSON document instead of the text")
    args = p.parse_args(argv)
    rows = model_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        plans = ", ".join(f"{name} ({n} rank{'s' if n > 1 else ''})" for name, n in r["plans"].items())
        print(f"{r['model']}  {r['title']}: makes {r['makes']}s; requests "
              f"{'batch in the server' if r['batches'] else 'run one at a time in the server'}\n"
              f"    plans: {plans}\n    checkpoint: {r['checkpoint']}\n    tiny default: {r['tiny_default']}")
    return 0


def bench_main(argv=None) -> int:
    """`dtgen bench SUITE ...`: `python -m bench` of the checkout this dtgen runs from (bench/ is
    the repository's, not an installed package)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "suites.py").is_file():
        return refuse(f"dtgen bench runs the suites of a source checkout (bench/ beside dtgen/); {root} has none")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("bench.suites").main(list(argv or []))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dtgen {" + ",".join(COMMANDS) + "} ...\n\n" + "\n".join(
            f"  {name:8s}{what}" for name, what in COMMANDS.items()))
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        return refuse(f"unknown command {command!r}; choose from {', '.join(COMMANDS)}")
    return {"run": run_main, "serve": serve_main, "models": models_main, "bench": bench_main}[command](rest)


def console() -> None:
    """The `dtgen` console script."""
    exit_process(main())
