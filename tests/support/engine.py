"""A server in this process for tests (one rank): a model's adapter behind the real engine,
job board and HTTP routes (`dtgen.serve.app`, uvicorn on a free port in a thread), with the
engine held back until the test lets it go, so that requests sent one after the other wait
together and run as one batch (no timing decides it: the jobs are queued when it opens).

Needs fastapi and uvicorn: `serving` skips the test that calls it without them.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from dtgen.serve.jobs import JobBoard


class HeldBoard(JobBoard):
    """A job board that hands the engine nothing until `release()`."""

    def __init__(self, max_queued: int):
        super().__init__(max_queued)
        self.open = threading.Event()
        self._taking = False   # the engine is inside next_batch, past the gate

    def release(self) -> None:
        self.open.set()

    def hold(self) -> None:
        """Hand the engine nothing again until the next `release()` (once this returns, no job
        is taken: an engine already past the gate has left next_batch)."""
        self.open.clear()
        while self._taking:
            time.sleep(0.005)

    def next_batch(self, timeout_s: float, max_jobs: int):
        if not self.open.wait(timeout_s):
            return []
        self._taking = True
        try:
            if not self.open.is_set():   # held meanwhile
                return []
            return super().next_batch(timeout_s, max_jobs)
        finally:
            self._taking = False

    def wait_queued(self, count: int, timeout_s: float = 60.0) -> None:
        """Until `count` jobs wait (requests sent from other threads have been queued)."""
        end = time.monotonic() + timeout_s
        while self.depth() < count:
            assert time.monotonic() < end, f"{self.depth()} jobs queued, expected {count}"
            time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(adapter, max_batch: int, **app_options):
    """`adapter` served on 127.0.0.1 (engine ready, no warm-up of its own); yields (base URL,
    the held board). The engine starts taking jobs at `board.release()`. `app_options`:
    `create_app`'s (`max_loras`)."""
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from dtgen.serve.app import Metrics, create_app
    from dtgen.serve.engine import Engine, RankLink

    board = HeldBoard(8)
    metrics = Metrics(board)
    engine = Engine(RankLink(0, 1, None), adapter, board, ping_s=0.05, metrics=metrics, max_batch=max_batch)
    port = _free_port()
    app = create_app(engine, board, metrics, **app_options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    engine.start()
    thread.start()
    try:
        assert engine.ready.wait(60), engine.broken
        end = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < end, "the HTTP server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", board
    finally:
        board.release()
        server.should_exit = True
        thread.join(15)
        engine.stop()
