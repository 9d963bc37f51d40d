"""Serve a model over HTTP: the model is the one the checkpoint holds.

    .venv/bin/python -m examples.serve --port 8000                              # tiny HunyuanImage-3, one process
    .venv/bin/python -m examples.serve --model wan --port 8000                  # tiny Wan (video jobs)
    .venv/bin/python -m examples.serve --model qwen-image --port 8000           # tiny Qwen-Image
    .venv/bin/python -m examples.serve --world-size 2 --plan tp2 --port 8000    # 2 gloo ranks spawned here
    torchrun --nproc-per-node 2 -m examples.serve --world-size 2 --plan tp2 \\
        --checkpoint /path/to/HunyuanImage-3 --compile --warmup-shapes 256:1024x1024 --port 8000
    torchrun --nproc-per-node 2 -m examples.serve --world-size 2 --plan cfg2 \\
        --checkpoint /path/to/Wan2.1-T2V-14B-Diffusers --port 8000

The model comes from the registry (models/registry.py): the one whose checkpoint layout the
--checkpoint folder holds (HunyuanImage-3's official folder: images, /v1/images/generations and
/v1/images/edits; a diffusers WanPipeline folder: videos, /v1/videos; a diffusers
QwenImagePipeline folder: images, /v1/images/generations). `--model` picks the tiny default
when there is no --checkpoint (and, with one, must agree). Every model, plan and compile flag
of the model's CLI applies (`--model M --help` lists them); its request flags are the
defaults of fields a request leaves out. Rank 0 answers HTTP; every rank warms up first
(/ready says when), then runs each job in lockstep with the others. The generic server is
`dtgen.serve`; this file only plugs the model's pipeline in (its CLI's `serve_adapter`).
"""
from __future__ import annotations

import argparse
import sys

from dtgen.harness import refuse
from dtgen.launch import RankContext, RankFailure, exit_process, run_on_ranks
from dtgen.registry import ModelSpec
from dtgen.serve.server import ServeOptions, ServerStopped, serve
from models import registry


def add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
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
                        "models that batch (HunyuanImage-3; default: 4 on a GPU, 1 on the CPU, where a batch saves "
                        "no time)")


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
    if not spec.batches:
        if args.max_batch is not None and args.max_batch > 1:
            return (f"--max-batch {args.max_batch}: {spec.title}'s server runs one request at a time (its denoise "
                    "steps are not batched across requests yet); use --max-batch 1")
        args.max_batch = 1
    return None


def _max_batch(args) -> int:
    import torch
    return args.max_batch if args.max_batch is not None else 4 if torch.cuda.is_available() else 1


def _options(args) -> ServeOptions:
    return ServeOptions(host=args.host, port=args.port, max_queued=args.max_queued, deadline_s=args.deadline,
                        ping_s=args.ping, end_timeout_s=args.end_timeout,
                        max_upload_bytes=int(args.max_upload_mb * (1 << 20)), max_batch=_max_batch(args),
                        models=tuple((s.makes, s.title) for s in registry.specs()))


def choose_model(argv, only: str | None = None) -> tuple[ModelSpec | None, str | None]:
    """(the model's spec, or None) and (a one-line problem, or None) from --checkpoint / --model."""
    first = argparse.ArgumentParser(add_help=False)
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
        return None, f"{what}; this launcher serves {only} (use examples.serve)"
    return spec, None


def serve_rank(ctx: RankContext, args) -> None:
    adapter = registry.spec(args.model).load("cli").serve_adapter(ctx, args, _max_batch(args))
    serve(ctx.rank, ctx.world_size, adapter, _options(args), heartbeat=ctx.progress)


def main(argv=None, prog: str = "python -m examples.serve", only: str | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    spec, problem = choose_model(argv, only)
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
    if problem is not None:
        return refuse(problem)
    try:
        run_on_ranks(serve_rank, args.world_size, args, stall_s=args.stall_timeout, job_deadline_s=float("inf"),
                     preload=(spec.cli, "dtgen.serve.app"))
    except RankFailure as e:
        print(f"error: the server stops: {e}", file=sys.stderr)
        return 1
    except ServerStopped:  # one process: rank 0 printed why
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())
