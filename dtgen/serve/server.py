"""Running a server on every rank: HTTP and the engine on rank 0, the job loop elsewhere."""
from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass

import torch.distributed as dist

from .engine import Engine, RankLink, ServeAdapter
from .jobs import JobBoard

# A rank waiting for work sits in a broadcast on the control group. Rank 0 pings it every
# second while idle, so this only bounds how long a wait can last if rank 0 stops pinging
# (it is gone): then the worker ends with a timeout error instead of waiting forever.
CONTROL_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queued: int = 16             # jobs waiting; more get 429
    deadline_s: float | None = None  # per job, from submission; past it: 504 and cancelled
    ping_s: float = 1.0              # idle rank 0 checks the other ranks this often


def control_link(rank: int, world_size: int) -> RankLink:
    """The control group (gloo, long timeout), made on every rank; None group on one rank."""
    if world_size == 1:
        return RankLink(0, 1, None)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    # The job-end check talks through the job's store (torchrun's, or the spawned ranks'),
    # which works whatever collective a rank is stuck in.
    return RankLink(rank, world_size, group, dist.distributed_c10d._get_default_store())


def serve(rank: int, world_size: int, adapter: ServeAdapter, options: ServeOptions,
          heartbeat=None) -> str | None:
    """Serve until stopped (rank 0: Ctrl-C / SIGTERM, or a rank gone). Returns why the
    server stopped when it could not go on (rank 0), else None. `heartbeat(where)`: a stall
    watch's progress report (`RankContext.progress`)."""
    link = control_link(rank, world_size)
    if rank != 0:
        Engine(link, adapter, heartbeat=heartbeat).serve_worker()
        return None

    import uvicorn

    from .app import Metrics, create_app

    board = JobBoard(options.max_queued)
    metrics = Metrics(board)
    engine = Engine(link, adapter, board, ping_s=options.ping_s, metrics=metrics, heartbeat=heartbeat)
    app = create_app(engine, board, metrics, deadline_s=options.deadline_s)
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                                           lifespan="off"))

    def on_broken(why: str) -> None:
        print(f"error: the server stops: {why}", file=sys.stderr, flush=True)
        server.should_exit = True

    engine.start(on_broken)
    print(f"dtgen: serving on http://{options.host}:{options.port} ({world_size} rank(s)); "
          f"/ready answers 200 once every rank has warmed up", flush=True)
    server.run()
    engine.stop()
    return engine.broken
