"""Running a server on every rank: HTTP and the engine on rank 0, the job loop elsewhere."""
from __future__ import annotations

import datetime
import errno
import socket
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist

from dtgen.launch import RankStopped

from .engine import Engine, RankLink, ServeAdapter
from .jobs import JobBoard

# A rank waiting for work sits in a broadcast on the control group. Rank 0 pings it every
# second while idle, so this only bounds how long a wait can last if rank 0 stops pinging
# (it is gone): then the worker ends with a timeout error instead of waiting forever.
CONTROL_TIMEOUT_S = 3600.0


class ServerStopped(RankStopped):
    """The server could not go on (a rank gone, or ranks that left a job out of step); rank 0
    has printed why, in one line."""


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queued: int = 16             # jobs waiting; more get 429
    deadline_s: float | None = None  # per job, from submission; past it: 504 and cancelled
    ping_s: float = 1.0              # idle rank 0 checks the other ranks this often
    end_timeout_s: float = 10.0      # how long every rank has to leave a job once one left it
    max_upload_bytes: int = 32 << 20  # a request body (an edit's image) larger than this: 413
    max_batch: int = 1               # waiting jobs of one batch key run together, up to this many
    max_loras: int = 8               # LoRA adapters resident at once (the least recently used unheld one is evicted)
    # (what it makes, its title) of every model the launcher knows (its registry's; dtgen knows
    # none): a route of the other kind is refused naming the models that serve it.
    models: tuple[tuple[str, str], ...] = ()


def address_problem(host: str, port: int) -> str | None:
    """Whether the server could listen on host:port, as one line, or None: asked before any
    weight is loaded, so that a port in use costs a second, not a model load and a traceback.
    The socket is bound the way uvicorn binds it (SO_REUSEADDR, so a port with connections
    in TIME_WAIT is free) and released: a program taking the port between this check and
    the server's start is still caught there, later."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"--port {port}: the address {host}:{port} is in use; stop what holds it or pick another port"
            return f"--host {host} --port {port}: cannot listen there ({e.strerror or e})"
    return None


def log_line(text: str) -> None:
    """The server's log: one timestamped line on stderr (requests, job ends)."""
    # one write: the engine's and the event loop's lines never run into each other
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
    sys.stderr.flush()


def control_link(rank: int, world_size: int) -> RankLink:
    """The control group (gloo, long timeout), made on every rank; None group on one rank."""
    if world_size == 1:
        return RankLink(0, 1, None)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    # The job-end check talks through the job's store (torchrun's, or the spawned ranks'),
    # which works whatever collective a rank is stuck in.
    return RankLink(rank, world_size, group, dist.distributed_c10d._get_default_store())


def serve(rank: int, world_size: int, adapter: ServeAdapter, options: ServeOptions, heartbeat=None,
          peers=None) -> None:
    """Serve until stopped (rank 0: Ctrl-C / SIGTERM). Raises `ServerStopped` with the
    reason when the server cannot go on (rank 0; a worker told so by rank 0), so that the
    launcher ends every rank, including one stuck in a collective. `heartbeat(where)`: a
    stall watch's progress report (`RankContext.progress`); `peers`: the other ranks'
    processes, watched (`RankContext.peers`, spawned ranks): on rank 0 a peer's death ends
    every request and the server at once, with one line naming the rank."""
    link = control_link(rank, world_size)
    if rank != 0:
        if peers is not None:   # rank 0 answers the requests; here nothing is left to do
            peers.when_gone(peers.exit)
        why = Engine(link, adapter, heartbeat=heartbeat, end_timeout_s=options.end_timeout_s).serve_worker()
        if why is not None:
            raise ServerStopped(why)
        return

    import uvicorn

    from .app import create_app
    from .metrics import Metrics

    board = JobBoard(options.max_queued)
    metrics = Metrics(board)
    engine = Engine(link, adapter, board, ping_s=options.ping_s, metrics=metrics, heartbeat=heartbeat,
                    end_timeout_s=options.end_timeout_s, log=log_line, max_batch=options.max_batch,
                    peer_gone=None if peers is None else peers.gone)
    app = create_app(engine, board, metrics, deadline_s=options.deadline_s,
                     max_upload_bytes=options.max_upload_bytes, log=log_line, models=options.models,
                     max_loras=options.max_loras)
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                                           lifespan="off", access_log=False))

    def on_broken(why: str) -> None:
        sys.stderr.write(f"error: the server stops: {why}\n")
        sys.stderr.flush()
        server.should_exit = True

    engine.start(on_broken)
    if peers is not None:
        peers.when_gone(engine.lost)
    print(f"dtgen: serving {adapter.name} on http://{options.host}:{options.port} ({world_size} rank(s)); "
          f"/ready answers 200 once every rank has warmed up", flush=True)
    server.run()
    engine.stop()
    if engine.broken:
        raise ServerStopped(engine.broken.splitlines()[0])
