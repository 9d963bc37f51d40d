"""Serve a model over HTTP: the model is the one the checkpoint holds.

    .venv/bin/python -m examples.serve --port 8000                              # tiny HunyuanImage-3, one process
    .venv/bin/python -m examples.serve --model wan --port 8000                  # tiny Wan (video jobs)
    .venv/bin/python -m examples.serve --world-size 2 --plan tp2 --port 8000    # 2 gloo ranks spawned here
    torchrun --nproc-per-node 2 -m examples.serve --world-size 2 --plan tp2 \\
        --checkpoint /path/to/HunyuanImage-3 --compile --warmup-shapes 256:1024x1024 --port 8000
    torchrun --nproc-per-node 2 -m examples.serve --world-size 2 --plan cfg2 \\
        --checkpoint /path/to/Wan2.1-T2V-14B-Diffusers --port 8000

A folder with a config.json is a HunyuanImage-3 checkpoint (images: /v1/images/generations,
/v1/images/edits), one with a model_index.json a diffusers-format Wan (videos: /v1/videos);
`--model` picks the tiny default when there is no --checkpoint (and, with one, must agree).
Every model, plan and compile flag of the model's CLI applies (`--checkpoint DIR --help`
lists them); its request flags are the defaults of fields a request leaves out. Rank 0
answers HTTP; every rank warms up first (/ready says when), then runs each job in lockstep
with the others. The generic server is `dtgen.serve`; this file only plugs a pipeline in.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dtgen.harness import parse_injections, refuse
from dtgen.launch import RankContext, RankFailure, exit_process, run_on_ranks
from dtgen.serve.server import ServeOptions, ServerStopped, serve

MODELS = ("hunyuan-image3", "wan")


def detect_model(checkpoint: str) -> str:
    """The model a checkpoint folder holds; ValueError (one line) when it is neither."""
    folder = Path(checkpoint)
    if (folder / "model_index.json").is_file():
        index = json.loads((folder / "model_index.json").read_text())
        if "Wan" not in str(index.get("_class_name", "")):
            raise ValueError(f"--checkpoint {checkpoint}: a diffusers folder of {index.get('_class_name')!r}; "
                             "the served diffusers model is Wan (WanPipeline)")
        return "wan"
    if (folder / "config.json").is_file():
        return "hunyuan-image3"
    raise ValueError(f"--checkpoint {checkpoint}: neither a HunyuanImage-3 checkpoint (config.json) nor a "
                     "diffusers-format Wan folder (model_index.json)")


def add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--model", choices=MODELS, default=None,
                   help="the tiny default to serve without --checkpoint (default hunyuan-image3); with one, it "
                        "must be the model the checkpoint holds")
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
                        "HunyuanImage-3 only (default: 4 on a GPU, 1 on the CPU, where a batch saves no time)")


def _server_problem(args) -> str | None:
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
    return None


def _max_batch(args) -> int:
    import torch
    return args.max_batch if args.max_batch is not None else 4 if torch.cuda.is_available() else 1


def _options(args) -> ServeOptions:
    return ServeOptions(host=args.host, port=args.port, max_queued=args.max_queued, deadline_s=args.deadline,
                        ping_s=args.ping, end_timeout_s=args.end_timeout,
                        max_upload_bytes=int(args.max_upload_mb * (1 << 20)), max_batch=_max_batch(args))


def _inject(args, phases=("ar", "denoise")):
    return parse_injections(getattr(args, "inject_failure", None), phases)


# ---- HunyuanImage-3 ---------------------------------------------------------------------------
def hunyuan_parser(prog: str) -> argparse.ArgumentParser:
    from examples.hunyuan_t2i import build_parser
    p = build_parser(prog, "Serve HunyuanImage-3.0 (text-to-image, image editing) over HTTP", cli=False)
    add_server_flags(p)
    p.add_argument_group("server").add_argument(
        "--edits", action=argparse.BooleanOptionalAction, default=None,
        help="serve /v1/images/edits: load the vision tower and the VAE encoder (default: when the checkpoint "
             "has them)")
    return p


def hunyuan_prepare(args) -> str | None:
    from examples.hunyuan_t2i import finish_args, prepare
    finish_args(args)
    problem, _ = prepare(args)
    if problem is not None:
        return problem
    config = {} if args.random_weights else json.loads((Path(args.checkpoint) / "config.json").read_text())
    can = all(config.get(k) for k in ("vit", "vit_aligner", "vit_processor")) and \
        not (config.get("vae") or {}).get("only_decoder", True)
    if args.edits and not can:
        return "--edits needs a checkpoint with a vision tower and a VAE encoder; this one has none"
    args.image_editing = can if args.edits is None else args.edits
    return None


def hunyuan_rank(ctx: RankContext, args) -> None:
    from examples.hunyuan_t2i import _request, _warmup_shapes, build_pipeline
    from models.hunyuan_image3.serving import HunyuanServeAdapter
    pipe, loaded, _, _ = build_pipeline(ctx, args)
    adapter = HunyuanServeAdapter(
        pipe, ctx.rank, _request(args), warmup=args.warmup is not False, inject_failure=_inject(args),
        warmup_shapes=_warmup_shapes(args.warmup_shapes, loaded.model.cfg.image_base_size),
        warmup_batch=_max_batch(args))
    serve(ctx.rank, ctx.world_size, adapter, _options(args), heartbeat=ctx.progress)


# ---- Wan --------------------------------------------------------------------------------------
def wan_parser(prog: str) -> argparse.ArgumentParser:
    from examples.wan_t2v import build_parser
    p = build_parser(prog, "Serve Wan text-to-video over HTTP (async video jobs)", cli=False)
    add_server_flags(p)
    p.add_argument_group("server").add_argument(
        "--inject-failure", default=None, metavar="RANK:denoise:STEP[:inside|:oom][,...]",
        help="testing the error path: raise on RANK after STEP of PHASE (denoise) of the first job that gets "
             "there; ':inside' raises inside the next step (from the last block), ':oom' an out-of-memory error")
    return p


def wan_prepare(args) -> str | None:
    from examples.wan_t2v import finish_launch_args, prepare
    if args.max_batch is not None and args.max_batch > 1:
        return (f"--max-batch {args.max_batch}: Wan's server runs one request at a time (its denoise steps are not "
                "batched across requests yet); use --max-batch 1")
    args.max_batch = 1
    finish_launch_args(args, lambda world: "single" if world == 1 else "ulysses2")
    try:
        _inject(args, ("denoise",))
    except ValueError as e:
        return str(e)
    problem, _ = prepare(args)
    return problem


def wan_rank(ctx: RankContext, args) -> None:
    from examples.wan_t2v import _request, build_pipeline
    from models.wan.serving import WanServeAdapter
    pipe = build_pipeline(ctx, args)[0]
    adapter = WanServeAdapter(pipe, ctx.rank, _request(args), fps=args.fps, warmup=args.warmup is not False,
                              inject_failure=_inject(args, ("denoise",)))
    serve(ctx.rank, ctx.world_size, adapter, _options(args), heartbeat=ctx.progress)


LAUNCH = {"hunyuan-image3": (hunyuan_parser, hunyuan_prepare, hunyuan_rank, ("examples.hunyuan_t2i",)),
          "wan": (wan_parser, wan_prepare, wan_rank, ("examples.wan_t2v",))}


def choose_model(argv, only: str | None = None) -> tuple[str | None, str | None]:
    """(the model, or None) and (a one-line problem, or None) from --checkpoint / --model."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--checkpoint")
    first.add_argument("--model", choices=MODELS)
    first.add_argument("--random-weights")
    known, _ = first.parse_known_args(argv)
    try:
        found = detect_model(known.checkpoint) if known.checkpoint and Path(known.checkpoint).is_dir() else None
    except ValueError as e:
        return None, str(e)
    if known.checkpoint and not Path(known.checkpoint).is_dir():
        return None, f"--checkpoint {known.checkpoint}: no such folder"
    model = found or known.model or only or "hunyuan-image3"
    if known.model and found and known.model != found:
        return None, f"--model {known.model}, but --checkpoint {known.checkpoint} holds {found}"
    if known.random_weights and model != "hunyuan-image3":
        return None, "--random-weights is HunyuanImage-3's (a Wan server needs a checkpoint or the tiny default)"
    if only and model != only:
        return None, f"--checkpoint {known.checkpoint} holds {model}; this launcher serves {only} (use examples.serve)"
    return model, None


def main(argv=None, prog: str = "python -m examples.serve", only: str | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    model, problem = choose_model(argv, only)
    if problem is not None:
        return refuse(problem)
    make_parser, prepare, run_rank, preload = LAUNCH[model]
    args = make_parser(prog).parse_args(argv)
    problem = _server_problem(args) or prepare(args)
    if problem is not None:
        return refuse(problem)
    try:
        run_on_ranks(run_rank, args.world_size, args, stall_s=args.stall_timeout, job_deadline_s=float("inf"),
                     preload=preload + ("dtgen.serve.app",))
    except RankFailure as e:
        print(f"error: the server stops: {e}", file=sys.stderr)
        return 1
    except ServerStopped:  # one process: rank 0 printed why
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())
