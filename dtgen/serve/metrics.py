"""The server's Prometheus series (`GET /metrics`), in a registry of their own (one per app)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .jobs import FAILED, RANK_GONE, Job, JobBoard

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    """The server's Prometheus series, in a registry of its own (one per app)."""

    def __init__(self, board: JobBoard):
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge("dtgen_queue_depth", "jobs waiting", registry=r)
        self.queue_depth.set_function(board.depth)
        self.requests = Counter("dtgen_requests", "requests by answer", ["outcome"], registry=r)
        self.jobs = Counter("dtgen_jobs", "finished jobs by state", ["state"], registry=r)
        self.queue_s = Histogram("dtgen_queue_seconds", "waiting before running", buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.e2e_s = Histogram("dtgen_end_to_end_seconds", "submission to the end", buckets=_LATENCY_BUCKETS,
                               registry=r)
        self.phase_s = Histogram("dtgen_phase_seconds", "time per phase of a job", ["phase"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.errors = Counter("dtgen_errors", "failed jobs by kind", ["kind"], registry=r)
        self.batch_size = Histogram("dtgen_job_batch_size", "jobs that ran together with a job (itself included)",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self._also = board.on_finish
        board.on_finish = self.finished

    def started(self, job: Job) -> None:
        self.queue_s.observe(job.started - job.created)
        self.batch_size.observe(job.batch_size)

    def finished(self, job: Job) -> None:
        self.jobs.labels(job.state).inc()
        self.e2e_s.observe(time.monotonic() - job.created)
        if job.state == FAILED:
            kind = "rank_gone" if (job.error or "").startswith(RANK_GONE) else \
                "out_of_memory" if job.http_status == 503 else "job_failed"
            self.errors.labels(kind).inc()
        timings = (job.result or {}).get("timings_ms", {}) if isinstance(job.result, dict) else {}
        for phase, ms in timings.items():
            if isinstance(ms, (int, float)):
                self.phase_s.labels(phase).observe(ms / 1e3)
        if self._also is not None:
            self._also(job)
