"""Serve HunyuanImage-3.0 text-to-image over HTTP (OpenAI-style images route, jobs, UI).

    python -m examples.hunyuan_serve --port 8000                          # tiny default, one process
    python -m examples.hunyuan_serve --world-size 2 --plan tp2 --port 8000  # 2 gloo ranks spawned here
    torchrun --nproc-per-node 2 -m examples.hunyuan_serve --world-size 2 --plan tp2 \\
        --checkpoint /path/to/HunyuanImage-3 --compile --warmup-shapes 256:1024x1024 --port 8000

    curl -s localhost:8000/ready
    curl -s localhost:8000/v1/images/generations -H 'Content-Type: application/json' \\
        -d '{"prompt": "a red fox in snow", "size": "256x256", "num_inference_steps": 8}' \\
        | python -c 'import base64, json, sys; open("fox.png", "wb").write(base64.b64decode(json.load(sys.stdin)["data"][0]["b64_json"]))'

Every model, plan and compile flag of `examples.hunyuan_t2i` applies; its request flags
(--steps, --seed, --guidance, --image-size, --max-new-tokens, sampling) are the defaults of
fields a request leaves out. Rank 0 answers HTTP; every rank warms up first (/ready says
when), then runs each job in lockstep with the others. The generic server is `dtgen.serve`;
this file only plugs the pipeline in.
"""
from __future__ import annotations

import argparse
import sys

from dtgen.harness import refuse
from dtgen.launch import RankContext, RankFailure, exit_process, run_on_ranks
from dtgen.serve.server import ServeOptions, serve
from examples.hunyuan_t2i import RANK_PRELOAD, _request, _warmup_shapes, build_parser, build_pipeline, finish_args, prepare
from models.hunyuan_image3.serving import HunyuanServeAdapter


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser("python -m examples.hunyuan_serve", __doc__.split("\n")[0])
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-queued", type=int, default=16, help="jobs waiting; more are answered 429")
    g.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="a job not done this long after it was submitted is cancelled and answered 504")
    g.add_argument("--ping", type=float, default=1.0, metavar="SECONDS",
                   help="while idle, rank 0 checks the other ranks this often")
    return finish_args(p.parse_args(argv))


def _server_problem(args) -> str | None:
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    if args.max_queued < 1:
        return f"--max-queued must be >= 1, got {args.max_queued}"
    if args.deadline is not None and args.deadline <= 0:
        return f"--deadline must be > 0 seconds, got {args.deadline}"
    if args.ping <= 0:
        return f"--ping must be > 0 seconds, got {args.ping}"
    return None


def serve_rank(ctx: RankContext, args: argparse.Namespace) -> str | None:
    pipe, loaded, _, _ = build_pipeline(ctx, args)
    inject = None
    if args.inject_failure:
        rank, phase, step = args.inject_failure.split(":")[:3]
        inject = (int(rank), phase, int(step))
    adapter = HunyuanServeAdapter(
        pipe, ctx.rank, _request(args), warmup=args.warmup is not False, inject_failure=inject,
        warmup_shapes=_warmup_shapes(args.warmup_shapes, loaded.model.cfg.image_base_size))
    options = ServeOptions(host=args.host, port=args.port, max_queued=args.max_queued, deadline_s=args.deadline,
                           ping_s=args.ping)
    return serve(ctx.rank, ctx.world_size, adapter, options, heartbeat=ctx.progress)


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = _server_problem(args)
    if problem is None:
        problem, _ = prepare(args)
    if problem is not None:
        return refuse(problem)
    try:
        results = run_on_ranks(serve_rank, args.world_size, args, stall_s=args.stall_timeout,
                               job_deadline_s=float("inf"), preload=RANK_PRELOAD + ("dtgen.serve.app",))
    except RankFailure as e:
        print(f"error: the server stops: {e}", file=sys.stderr)
        return 1
    broken = next((r for r in results if r), None)
    return 1 if broken else 0


if __name__ == "__main__":
    exit_process(main())
