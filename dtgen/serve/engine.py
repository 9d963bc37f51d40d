"""The engine: one thread on rank 0 runs jobs on every rank, in lockstep.

- Rank 0's engine thread takes a job from the `JobBoard` and broadcasts it to the other
  ranks over `RankLink`, a gloo group of its own: with a long timeout, so a rank waiting
  for work never trips a collective timeout, and apart from the data plane (NCCL on GPU).
  While idle, rank 0 sends a ping every `ping_s`: a rank that is gone shows at once
  (gloo fails the send) rather than at the next request.
- At every step (each AR token, each denoise step) every rank agrees on one flag, the
  largest of what each rank brings: go on, stop (rank 0: the job was cancelled, or its
  deadline passed), or failed (this rank raised in the step's host code). So a cancel
  stops every rank after the same step, and one rank's error fails the job on all of them.
- The model plugs in as a `ServeAdapter`: it parses a request's fields (rank 0) and runs
  one request on a rank with a progress hook.

Process groups are passed in; nothing here reads a global group inside a step.
"""
from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from .errors import Cancelled
from .jobs import CANCELLED, FAILED, SUCCEEDED, Job, JobBoard

GO, STOP, FAIL = 0, 1, 2

Progress = Callable[[str, int, int], None]


class ServeAdapter(Protocol):
    """What a model gives the server."""

    def parse(self, fields: dict) -> Any:
        """A validated request from JSON fields (rank 0); `RequestError` names a bad field."""

    def generate(self, request: Any, progress: Progress) -> Any:
        """Run one request on this rank; the result on rank 0 (JSON-ready), anything elsewhere.
        `progress(phase, done, total)` after every step, on every rank."""

    def warm_up(self, progress: Progress) -> None:
        """Compile and run what requests will need, before /ready."""

    def free_caches(self) -> None:
        """After an out-of-memory error: drop what can be rebuilt."""

    def on_step(self, phase: str, done: int, total: int) -> None:
        """Called at every step on every rank, before the ranks agree to go on: an exception
        here fails the job on every rank at that step (and the server goes on)."""


class PeerFailed(RuntimeError):
    """Another rank failed this job's step; this rank stops at the same step."""


class LinkBroken(RuntimeError):
    """A rank is gone: the server cannot go on."""


@dataclass
class RankLink:
    """The control channel between rank 0 and the others (None group: one process)."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None

    def send(self, command: dict) -> None:
        """Rank 0: every other rank receives `command`."""
        if self.group is not None:
            try:
                dist.broadcast_object_list([command], src=0, group=self.group)
            except Exception as e:  # a rank that is gone: gloo fails the send
                raise LinkBroken(f"a rank is gone ({type(e).__name__}: {_first_line(e)})") from None

    def receive(self) -> dict:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree(self, flag: int) -> int:
        """The largest flag any rank brings (GO < STOP < FAIL)."""
        if self.group is None:
            return flag
        t = torch.tensor([flag], dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as e:
            raise LinkBroken(f"a rank is gone ({type(e).__name__}: {_first_line(e)})") from None
        return int(t.item())


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def run_job_on_rank(link: RankLink, adapter: ServeAdapter, request: Any, job: Job | None,
                    on_progress: Callable[[str, int, int], None] | None = None) -> Any:
    """One request on this rank, stopping with every other rank. `job` (rank 0) says when to
    stop; raises `Cancelled`, `PeerFailed` or this rank's own error."""
    own_error: list[BaseException] = []

    def progress(phase: str, done: int, total: int) -> None:
        flag = GO
        try:
            if on_progress is not None:
                on_progress(phase, done, total)
        except Exception as e:  # this rank's error, at a step boundary: tell the others first
            own_error.append(e)
            flag = FAIL
        stop = job.stop_reason() if job is not None else None
        if flag == GO and stop is not None:
            flag = STOP
        agreed = link.agree(flag)
        if own_error:
            raise own_error[0]
        if agreed == FAIL:
            raise PeerFailed(f"another rank failed at {phase} step {done}")
        if agreed == STOP:
            raise Cancelled(stop[0] if stop else "cancelled")

    return adapter.generate(request, progress)


class Engine:
    """Rank 0's job runner (a thread) and the worker ranks' loop."""

    def __init__(self, link: RankLink, adapter: ServeAdapter, board: JobBoard | None = None,
                 ping_s: float = 1.0, metrics: Any = None, heartbeat: Callable[[str], None] | None = None):
        """`heartbeat(where)`: called at every ping, step and command (a stall watch that
        must not take an idle server for a hung one)."""
        self.link, self.adapter, self.board = link, adapter, board
        self.heartbeat = heartbeat or (lambda where: None)
        self.ping_s = ping_s
        self.metrics = metrics
        self.ready = threading.Event()
        self.broken: str | None = None       # why the server cannot go on
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._current: Job | None = None
        # The current CUDA device is per thread: the engine thread takes the one this rank set.
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    # ---- rank 0 ------------------------------------------------------------------------
    def start(self, on_broken: Callable[[str], None] | None = None) -> None:
        """Warm up every rank, then run jobs on a thread of its own until `stop()`."""
        self._thread = threading.Thread(target=self._main, args=(on_broken,), name="dtgen-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new jobs, cancel the queued ones and the running one (every rank stops at
        its next step), tell the other ranks to exit."""
        if self.board is not None:
            self.board.close()
        current = self._current
        if current is not None:
            current.cancel("the server is shutting down", 503)
        self.stopped.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _main(self, on_broken) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        try:
            self.link.send({"op": "warm_up"})
            self.adapter.warm_up(lambda phase, done, total: None)
            self.ready.set()
            last = time.monotonic()
            while not self.stopped.is_set():
                job = self.board.next(timeout_s=min(self.ping_s, 0.2))
                if job is None:
                    if time.monotonic() - last >= self.ping_s:
                        self.link.send({"op": "ping"})
                        self.heartbeat("idle")
                        last = time.monotonic()
                    continue
                self._current = job
                self._run(job)
                self._current = None
                last = time.monotonic()
            self.link.send({"op": "exit"})
        except LinkBroken as e:
            self._break(str(e), on_broken)
        except BaseException:
            self._break("the engine failed:\n" + traceback.format_exc(), on_broken)

    def _break(self, why: str, on_broken) -> None:
        self.broken = why
        self.ready.clear()
        if self.board is not None:
            self.board.close()
        if on_broken is not None:
            on_broken(why)

    def _run(self, job: Job) -> None:
        m = self.metrics
        if m is not None:
            m.started(job)

        def on_progress(phase: str, done: int, total: int) -> None:
            job.phase, job.done, job.total = phase, done, total
            self.heartbeat(f"{job.id} {phase} {done}/{total}")
            self.adapter.on_step(phase, done, total)

        try:
            self.link.send({"op": "run", "request": job.request})
            result = run_job_on_rank(self.link, self.adapter, job.request, job, on_progress)
            self.board.finish(job, SUCCEEDED, result=result)
        except Cancelled as e:
            stop = job.stop_reason()
            self.board.finish(job, CANCELLED, error=e.reason, http_status=stop[1] if stop else 499)
        except LinkBroken:
            self.board.finish(job, FAILED, error="a rank is gone; the server stops", http_status=503)
            raise
        except torch.OutOfMemoryError as e:
            self.adapter.free_caches()
            self.board.finish(job, FAILED, error=f"out of memory: {_first_line(e)}", http_status=503)
        except PeerFailed as e:
            self.board.finish(job, FAILED, error=str(e), http_status=500)
        except Exception as e:
            self.board.finish(job, FAILED, error=f"{type(e).__name__}: {_first_line(e)}", http_status=500)

    # ---- the other ranks ---------------------------------------------------------------
    def _worker_step(self, phase: str, done: int, total: int) -> None:
        self.heartbeat(f"{phase} {done}/{total}")
        self.adapter.on_step(phase, done, total)

    def serve_worker(self) -> None:
        """Run what rank 0 sends until it says exit (ranks 1..N-1)."""
        while True:
            command = self.link.receive()
            op = command["op"]
            self.heartbeat(op)
            if op == "exit":
                return
            if op == "warm_up":
                self.adapter.warm_up(lambda phase, done, total: None)
            elif op == "run":
                try:
                    run_job_on_rank(self.link, self.adapter, command["request"], None, self._worker_step)
                except (Cancelled, PeerFailed):
                    pass
                except torch.OutOfMemoryError:
                    self.adapter.free_caches()
                except Exception:
                    # Rank 0 reports the job's failure; this rank goes on serving.
                    traceback.print_exc()
