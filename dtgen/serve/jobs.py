"""Jobs: a bounded queue of requests, their states, progress and results.

Thread-safe: the HTTP event loop submits, reads and cancels; the engine thread takes the
next job and reports on it. Nothing here knows about ranks or HTTP.

A queued job that is cancelled (or whose deadline passes) leaves the queue at once: its
slot is free for the next submission, and it answers "cancelled" from then on.
"""
from __future__ import annotations

import collections
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
FINISHED = (SUCCEEDED, FAILED, CANCELLED)
RANK_GONE = "a rank is gone"   # how the error of every job a dead rank ended begins


class QueueFull(Exception):
    """The queue holds its limit of waiting jobs: answer 429."""


@dataclass
class Job:
    id: str
    request: Any
    deadline: float | None                 # time.monotonic() by which it must finish, or None
    kind: str = "image"                    # what it makes: "image" or "video" (the routes that show it)
    phases: tuple[str, ...] = ()           # the phases it goes through, in order (for the overall percent)
    created: float = field(default_factory=time.monotonic)
    state: str = QUEUED
    phase: str = ""
    done: int = 0
    total: int = 0
    started: float | None = None
    ended: float | None = None
    result: Any = None
    error: str | None = None
    http_status: int = 200                 # what a failed or cancelled job answers
    cancel_reason: str | None = None       # set by cancel(); the engine stops the ranks at the next step
    cancel_status: int = 499               # the HTTP status a cancelled job answers (504: deadline)
    batch_key: Any = None                  # jobs with equal keys (not None) may run as one batch
    batch_size: int = 1                    # how many jobs ran together with this one (itself included)
    output: Any = None                     # how the HTTP side encodes the answer's image (the engine never reads it)
    finished: threading.Event = field(default_factory=threading.Event)
    _on_finished: list = field(default_factory=list, repr=False)

    def when_finished(self, fn: Callable[[], None]) -> None:
        """Call fn() (from the thread that ends the job) once it has finished; at once if it
        already has. The caller checks `finished` after registering: the board sets it before
        calling these, so no end is missed between the two."""
        self._on_finished.append(fn)
        if self.finished.is_set():
            fn()

    def cancel(self, reason: str, http_status: int = 499) -> None:
        """Ask a running job to stop at its next step on every rank (queued jobs: use
        `JobBoard.cancel`, which also frees the slot). The first reason wins."""
        if self.cancel_reason is None:
            self.cancel_reason, self.cancel_status = reason, http_status

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now or time.monotonic()) > self.deadline

    def stop_reason(self) -> tuple[str, int] | None:
        """Why the job must stop now, with its HTTP status, or None."""
        if self.cancel_reason is not None:
            return self.cancel_reason, self.cancel_status
        if self.expired():
            return "deadline passed", 504
        return None

    def percent(self) -> int:
        """0-100 over every phase (each counts the same), 100 only once it succeeded."""
        if self.state == SUCCEEDED:
            return 100
        if self.phase not in self.phases:
            return 0
        within = self.done / self.total if self.total else 0.0
        return min(99, int(100 * (self.phases.index(self.phase) + within) / len(self.phases)))

    def as_dict(self) -> dict:
        out = {"id": self.id, "kind": self.kind, "status": self.state, "phase": self.phase,
               "progress": {"done": self.done, "total": self.total, "percent": self.percent()}}
        if self.state != QUEUED:
            out["batch_size"] = self.batch_size   # jobs that ran together with this one
        if self.error is not None:
            out["error"] = self.error
        if self.state in FINISHED and self.started is not None:
            out["seconds"] = round((self.ended or time.monotonic()) - self.started, 3)
        return out


class JobBoard:
    """A bounded FIFO of queued jobs plus every job's record (finished ones: the last
    `keep_finished`). `next()` hands the engine the oldest job that still wants running."""

    def __init__(self, max_queued: int, keep_finished: int = 256, on_finish=None):
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self._lock = threading.Condition()
        self._woken = False   # `wake()`: the waiting next_batch returns at once
        self._queue: collections.deque[Job] = collections.deque()
        self._jobs: dict[str, Job] = {}
        self._finished: collections.deque[str] = collections.deque()
        self._keep = keep_finished
        self.closed = False
        self.on_finish = on_finish      # called with each job as it finishes (metrics, the log)

    def submit(self, request: Any, deadline_s: float | None = None, kind: str = "image",
               phases: tuple[str, ...] = (), batch_key: Any = None, output: Any = None) -> Job:
        with self._lock:
            if self.closed:
                raise QueueFull("the server is shutting down")
            self._drop_expired_locked()
            if len(self._queue) >= self.max_queued:
                raise QueueFull(f"{len(self._queue)} jobs are waiting (the limit is {self.max_queued})")
            # random, not a counter: a restarted server never hands out an id a client still polls
            job = Job(f"job-{uuid.uuid4().hex}", request,
                      None if deadline_s is None else time.monotonic() + deadline_s, kind, tuple(phases),
                      batch_key=batch_key, output=output)
            self._queue.append(job)
            self._jobs[job.id] = job
            self._lock.notify()
            return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def queued(self) -> list[Job]:
        """The jobs waiting now, oldest first."""
        with self._lock:
            self._drop_expired_locked()
            return list(self._queue)

    def depth(self) -> int:
        with self._lock:
            self._drop_expired_locked()
            return len(self._queue)

    def cancel(self, job: Job, reason: str, http_status: int = 499) -> Job:
        """A queued job leaves the queue now (cancelled, its slot free); a running one stops
        at its next step on every rank; a finished one stays as it is."""
        with self._lock:
            if job.state == QUEUED and job in self._queue:
                self._queue.remove(job)
                job.cancel(reason, http_status)
                self._finish_locked(job, CANCELLED, reason, http_status)
            elif job.state == RUNNING:
                job.cancel(reason, http_status)
            return job

    def next(self, timeout_s: float) -> Job | None:
        """The oldest queued job, now RUNNING, or None after `timeout_s`."""
        jobs = self.next_batch(timeout_s, 1)
        return jobs[0] if jobs else None

    def next_batch(self, timeout_s: float, max_jobs: int) -> list[Job]:
        """The oldest queued job and, up to `max_jobs` in all, the queued jobs after it with
        its `batch_key` (not None), oldest first: all RUNNING now. Empty after `timeout_s`.
        Only jobs already waiting join: nothing waits for a batch to fill."""
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        end = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._drop_expired_locked()
                if self._queue:
                    batch = [self._queue.popleft()]
                    key = batch[0].batch_key
                    if key is not None:
                        for job in [j for j in self._queue if j.batch_key == key][:max_jobs - 1]:
                            self._queue.remove(job)
                            batch.append(job)
                    now = time.monotonic()
                    for job in batch:
                        job.state, job.started, job.batch_size = RUNNING, now, len(batch)
                    return batch
                left = end - time.monotonic()
                if left <= 0 or self.closed or self._woken:
                    self._woken = False
                    return []
                self._lock.wait(left)

    def finish(self, job: Job, state: str, error: str | None = None, http_status: int = 200,
               result: Any = None) -> bool:
        """Record how a job ended; False (and nothing changes) if it had ended already."""
        with self._lock:
            if job.state in FINISHED:
                return False
            job.result = result
            self._finish_locked(job, state, error, http_status)
            return True

    def _drop_expired_locked(self) -> None:
        now = time.monotonic()
        for job in [j for j in self._queue if j.expired(now)]:
            self._queue.remove(job)
            self._finish_locked(job, CANCELLED, "deadline passed", 504)

    def _finish_locked(self, job: Job, state: str, error: str | None, http_status: int) -> None:
        job.state, job.error, job.http_status, job.ended = state, error, http_status, time.monotonic()
        if self.on_finish is not None:
            self.on_finish(job)
        job.finished.set()
        for fn in job._on_finished:
            try:
                fn()
            except RuntimeError:   # its event loop has closed (a server shutting down): nobody waits
                pass
        self._finished.append(job.id)
        while len(self._finished) > self._keep:
            self._jobs.pop(self._finished.popleft(), None)

    def wake(self) -> None:
        """End the engine's wait in `next_batch` now (nothing queued: it returns empty), so that
        other work for the engine thread (a LoRA load) does not wait out the poll."""
        with self._lock:
            self._woken = True
            self._lock.notify_all()

    def close(self, reason: str = "the server is shutting down", http_status: int = 503) -> list[Job]:
        """Refuse new jobs; cancel and return the queued ones, answering `reason`."""
        with self._lock:
            self.closed = True
            queued = list(self._queue)
            self._queue.clear()
            for job in queued:
                self._finish_locked(job, CANCELLED, reason, http_status)
            self._lock.notify_all()
            return queued
