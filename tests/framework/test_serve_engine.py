"""dtgen.serve without a model: the job board, the engine's lockstep over gloo ranks,
cancellation at a step, one rank's failure, out of memory, a rank that dies."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dtgen.launch import RankFailure, run_on_ranks
from dtgen.serve.engine import Engine, RankLink
from dtgen.requests import RequestError
from dtgen.serve.jobs import CANCELLED, FAILED, RUNNING, SUCCEEDED, JobBoard, QueueFull
from dtgen.serve.server import control_link


class StepAdapter:
    """A request is {"steps": n, "fail": (rank, step) or None, "oom": bool, "inside": [(rank,
    step, what), ...]}; each step sleeps `step_s` and, on several ranks, runs two collectives
    on `model_group` (the model's data plane); "inside" raises `what` ("error" or "oom")
    between them: inside the step. Records the last step every request reached here."""

    kind = "image"

    def __init__(self, rank: int, step_s: float = 0.02, model_group=None):
        self.rank, self.step_s, self.model_group = rank, step_s, model_group
        self.reached: list[int] = []
        self.freed = 0
        self._fail = None

    def parse(self, fields: dict):
        if "steps" not in fields:
            raise RequestError("steps", "is required")
        return fields

    def phases(self, request):
        return ("denoise",)

    def generate(self, request, progress):
        self._fail = request.get("fail")
        inside = {(r, s): what for r, s, what in request.get("inside", [])}
        self.reached.append(0)
        for step in range(1, request["steps"] + 1):
            time.sleep(self.step_s)
            if self.model_group is not None:
                dist.all_reduce(torch.ones(4), group=self.model_group)
            what = inside.get((self.rank, step))
            if what == "oom" or (request.get("oom") and step == 2):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            if what == "error":
                raise RuntimeError(f"injected inside step {step} on rank {self.rank}")
            if self.model_group is not None:
                dist.all_reduce(torch.ones(4), group=self.model_group)
            self.reached[-1] = step
            progress("denoise", step, request["steps"])
        return {"rank": self.rank, "steps": request["steps"]} if self.rank == 0 else None

    def warm_up(self, progress):
        pass

    def free_caches(self):
        self.freed += 1

    def on_step(self, phase, done, total):
        if self._fail is not None and tuple(self._fail) == (self.rank, done):
            raise RuntimeError(f"injected on rank {self.rank} at step {done}")


def test_board_is_a_bounded_fifo_and_a_cancelled_queued_job_frees_its_slot_at_once():
    finished = []
    board = JobBoard(max_queued=2, on_finish=finished.append)
    a, b = board.submit("a"), board.submit("b", deadline_s=0.0)
    time.sleep(0.01)
    assert board.depth() == 1 and b.state == CANCELLED and b.http_status == 504  # expired: gone at once
    c = board.submit("c")
    with pytest.raises(QueueFull, match="2 jobs are waiting"):
        board.submit("d")
    board.cancel(c, "cancelled by DELETE")      # queued: it leaves the queue now, not when the engine comes
    assert c.state == CANCELLED and c.finished.is_set() and board.depth() == 1
    c2 = board.submit("c2")                     # its slot is free
    taken = board.next(timeout_s=0.1)
    assert taken is a and a.state == RUNNING and board.depth() == 1
    board.cancel(a, "by DELETE")                # running: the engine stops it at its next step
    assert a.state == RUNNING and a.stop_reason() == ("by DELETE", 499)
    assert board.finish(a, CANCELLED, "by DELETE", 499) and not board.finish(a, FAILED, "twice")
    assert a.state == CANCELLED, "a job ends once"
    d = board.submit("d")
    assert board.close() == [c2, d] and d.state == CANCELLED and d.http_status == 503
    with pytest.raises(QueueFull, match="shutting down"):
        board.submit("e")
    assert [j.id for j in finished] == [b.id, c.id, a.id, c2.id, d.id]


def test_a_job_calls_its_waiters_when_it_ends_and_at_once_when_it_had():
    board = JobBoard(4)
    job = board.submit("a")
    calls = []
    job.when_finished(lambda: calls.append("first"))

    def closed_loop():
        raise RuntimeError("Event loop is closed")   # a server shutting down: ignored
    job.when_finished(closed_loop)
    assert calls == []
    board.next(timeout_s=0.1)
    assert board.finish(job, SUCCEEDED) and calls == ["first"]
    job.when_finished(lambda: calls.append("late"))        # registered after the end: called at once
    assert calls == ["first", "late"]


def _run_jobs(engine: Engine, board: JobBoard, jobs: list[dict], cancel_at: dict[int, int] | None = None,
              deadline_s: float | None = None):
    """Submit the jobs one after another (cancelling job i once it reaches step cancel_at[i]);
    wait for each."""
    out = []
    for i, request in enumerate(jobs):
        job = board.submit(request, deadline_s)
        while cancel_at and i in cancel_at and not job.finished.is_set():
            if job.done >= cancel_at[i]:
                board.cancel(job, "cancelled by DELETE")
                break
            time.sleep(0.002)
        assert job.finished.wait(30), f"job {i} did not finish"
        out.append(job)
    return out


def test_engine_in_one_process_cancels_fails_and_goes_on():
    adapter = StepAdapter(0)
    board = JobBoard(4)
    engine = Engine(RankLink(0, 1, None), adapter, board, ping_s=0.05)
    engine.start()
    assert engine.ready.wait(5)
    ok, cancelled, failed, oom, plain, after = _run_jobs(
        engine, board, [{"steps": 3}, {"steps": 50}, {"steps": 5, "fail": (0, 2)}, {"steps": 5, "oom": True},
                        {"steps": 3}, {"steps": 4}], cancel_at={1: 3})
    engine.stop()
    assert ok.state == SUCCEEDED and ok.result == {"rank": 0, "steps": 3}
    assert cancelled.state == CANCELLED and cancelled.error == "cancelled by DELETE"
    assert 3 <= adapter.reached[1] < 50
    assert failed.state == FAILED and "injected on rank 0 at step 2" in failed.error and failed.http_status == 500
    assert oom.state == FAILED and oom.http_status == 503 and "out of memory" in oom.error and adapter.freed == 1
    assert plain.state == SUCCEEDED and after.state == SUCCEEDED and after.result["steps"] == 4
    assert engine.broken is None


def test_engine_deadline_answers_504():
    adapter = StepAdapter(0, step_s=0.05)
    board = JobBoard(2)
    engine = Engine(RankLink(0, 1, None), adapter, board, ping_s=0.05)
    engine.start()
    (job,) = _run_jobs(engine, board, [{"steps": 100}], deadline_s=0.3)
    engine.stop()
    assert job.state == CANCELLED and job.http_status == 504 and job.error == "deadline passed"
    assert adapter.reached[0] < 100


def _lockstep_job(ctx, out_dir):
    """Rank 0 runs jobs through the engine; every rank writes which step each request reached."""
    link = control_link(ctx.rank, ctx.world_size)
    adapter = StepAdapter(ctx.rank, model_group=dist.group.WORLD)
    if ctx.rank == 0:
        board = JobBoard(4)
        engine = Engine(link, adapter, board, ping_s=0.05)
        engine.start()
        assert engine.ready.wait(30)
        time.sleep(0.2)  # a few idle pings
        jobs = _run_jobs(engine, board, [
            {"steps": 4}, {"steps": 60}, {"steps": 6, "fail": (1, 3)},
            # every rank raises at the same point inside step 2: in step, so the job fails alone
            {"steps": 5, "inside": [(0, 2, "error"), (1, 2, "error")]},
            {"steps": 5, "inside": [(0, 3, "oom"), (1, 3, "oom")]},
            {"steps": 5}], cancel_at={1: 4})
        engine.stop()
        states = [(j.state, j.error, j.result, j.http_status) for j in jobs]
        broken = engine.broken
    else:
        assert Engine(link, adapter).serve_worker() is None
        states = broken = None
    with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"reached": adapter.reached, "states": states, "freed": adapter.freed, "broken": broken}, f)
    return ctx.rank


def test_ranks_stop_at_the_same_step_and_a_failed_job_leaves_the_server_serving(tmp_path):
    assert run_on_ranks(_lockstep_job, 2, str(tmp_path), timeout_s=60) == [0, 1]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["reached"] == r1["reached"], "every rank stops after the same step"
    assert r0["reached"][0] == 4 and 4 <= r0["reached"][1] < 60 and r0["reached"][5] == 5
    assert r0["reached"][2] == 3  # rank 1 raised in step 3's hook: every rank stopped there
    assert r0["reached"][3:5] == [1, 2]
    states = r0["states"]
    assert [s[0] for s in states] == [SUCCEEDED, CANCELLED, FAILED, FAILED, FAILED, SUCCEEDED]
    # the failing rank's own message, not "another rank failed"
    assert states[2][1] == "rank 1: RuntimeError: injected on rank 1 at step 3 (after denoise step 3)", states[2]
    assert states[3][1].startswith("rank 0: RuntimeError: injected inside step 2 on rank 0") and states[3][3] == 500
    assert "out of memory" in states[4][1] and states[4][3] == 503 and r0["freed"] == r1["freed"] == 1
    assert states[5][2] == {"rank": 0, "steps": 5} and r0["broken"] is None


def _inside_a_step_job(ctx, out_path, failing_rank, what):
    """One rank raises inside step 2, between two model collectives; its peer waits in the
    second. Rank 0 writes what the job answered, when, and why the server stopped."""
    link = control_link(ctx.rank, ctx.world_size)
    adapter = StepAdapter(ctx.rank, model_group=dist.group.WORLD)
    request = {"steps": 5, "inside": [(failing_rank, 2, what)]}
    if ctx.rank != 0:
        return Engine(link, adapter).serve_worker()
    stopped = threading.Event()
    board = JobBoard(4)
    engine = Engine(link, adapter, board, ping_s=0.05, end_timeout_s=2.0)
    engine.start(on_broken=lambda why: stopped.set())
    assert engine.ready.wait(30)
    t0 = time.monotonic()
    job = board.submit(request)
    answered = job.finished.wait(30)
    answered_s = time.monotonic() - t0
    ended = stopped.wait(30)
    with open(out_path, "w") as f:
        json.dump({"answered": answered, "answered_s": answered_s, "ended": ended, "stopped_s": time.monotonic() - t0,
                   "id": job.id, "state": job.state, "error": job.error, "status": job.http_status,
                   "why": engine.broken,
                   "ready": engine.ready.is_set(), "refused": _refused(board)}, f)
    # rank 0's engine thread (or its peer) is stuck in the collective: end this rank as a server ends
    raise SystemExit("the server stops")


def _refused(board):
    try:
        board.submit({"steps": 1})
        return False
    except QueueFull:
        return True


@pytest.mark.parametrize("failing_rank, what", [(1, "error"), (0, "oom")])
def test_a_rank_that_raises_inside_a_step_fails_the_job_and_ends_the_server_with_its_message(
        tmp_path, failing_rank, what):
    """Rank 1 raising between two collectives of a step must not leave rank 0 blocked in the
    second one, its job "running" forever: the job fails with rank 1's message
    at once (rank 0 sees it waits in a collective rank 1 left); rank 0's own out of memory
    inside a step answers 503 at once and ends the server after the end timeout (2 s here),
    since rank 1 never leaves the collective. Either way the server ends with the message."""
    out = tmp_path / "rank0.json"
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="the server stops"):
        run_on_ranks(_inside_a_step_job, 2, str(out), failing_rank, what, timeout_s=60)
    assert time.monotonic() - t0 < 45, "no hang"
    r = json.loads(out.read_text())
    assert r["answered"] and r["ended"] and not r["ready"] and r["refused"], r
    assert r["state"] == FAILED and r["answered_s"] < 5 and r["stopped_s"] < 30, r
    if what == "error":
        assert r["error"].startswith("rank 1: RuntimeError: injected inside step 2 on rank 1"), r
        assert r["status"] == 500 and "rank 0 waits in a collective of group" in r["why"], r
    else:
        assert r["error"].startswith("rank 0: out of memory") and r["status"] == 503, r
        assert f"rank(s) [1] did not leave {r['id']} within 2 s" in r["why"], r
    assert r["why"].startswith(r["error"]), "the server ends with the job's message"


def _dying_worker_job(ctx, out_path):
    link = control_link(ctx.rank, ctx.world_size)
    if ctx.rank == 0:
        broken = threading.Event()
        engine = Engine(link, StepAdapter(0), JobBoard(2), ping_s=0.05)
        engine.start(on_broken=lambda why: broken.set())
        assert engine.ready.wait(30)
        t0 = time.monotonic()
        noticed = broken.wait(20)
        with open(out_path, "w") as f:
            json.dump({"noticed": noticed, "why": engine.broken, "ready": engine.ready.is_set(),
                       "seconds": time.monotonic() - t0}, f)
        return "rank 0 done"
    pings = []

    def heartbeat(where):
        pings.append(where)
        if where == "ping" and len(pings) > 5:
            os.kill(os.getpid(), signal.SIGKILL)  # a worker that dies without a word

    Engine(link, StepAdapter(ctx.rank), heartbeat=heartbeat).serve_worker()


def test_a_dead_worker_rank_stops_the_server_with_a_message(tmp_path):
    out = tmp_path / "rank0.json"
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died"):
        run_on_ranks(_dying_worker_job, 2, str(out), timeout_s=60)
    assert time.monotonic() - t0 < 40, "no hang"
    report = json.loads(out.read_text())  # rank 0 notices well within the pool's grace period (3 s)
    assert report["noticed"] and not report["ready"] and "a rank is gone" in report["why"], report
    assert report["seconds"] < 5


# ---- batches: one agreed flag per request -------------------------------------------------------
class BatchStepAdapter(StepAdapter):
    """StepAdapter whose requests (same "key") run as one batch: every step is one boundary
    for all active requests; a request's "fail": (rank, step) raises in that rank's step hook
    for that request only. Records the last step each request of each batch reached."""

    name = "steps"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[list[int]] = []
        self._batch = None

    def batch_key(self, request):
        return request.get("key", "k")

    def generate_batch(self, requests, progress):
        active, out = list(range(len(requests))), [None] * len(requests)
        reached = [0] * len(requests)
        self.batches.append(reached)
        steps = max(r["steps"] for r in requests)
        for step in range(1, steps + 1):
            time.sleep(self.step_s)
            if self.model_group is not None:
                dist.all_reduce(torch.ones(4), group=self.model_group)
            self._batch = (requests, iter(list(active)))
            for m, why in progress("denoise", step, steps, list(active)).items():
                out[m] = why
                active.remove(m)
            for m in active:
                reached[m] = step
        self._batch = None
        for m in active:
            out[m] = {"rank": self.rank, "steps": steps, "batch": len(requests)} if self.rank == 0 else None
        return out

    def on_step(self, phase, done, total):
        if self._batch is None:
            return super().on_step(phase, done, total)
        requests, order = self._batch
        m = next(order)   # members come to the hook in batch order
        fail = requests[m].get("fail")
        if fail is not None and tuple(fail) == (self.rank, done):
            raise RuntimeError(f"injected on rank {self.rank} at step {done} for request {m}")


def _batch_job(ctx, out_dir):
    """Rank 0 queues three same-key jobs and one of another key before the engine starts: the
    three run as one batch (request 1 fails on rank 1 at step 3, request 2 is cancelled once
    it reaches step 4), the other alone after them."""
    link = control_link(ctx.rank, ctx.world_size)
    adapter = BatchStepAdapter(ctx.rank, step_s=0.05, model_group=dist.group.WORLD)
    if ctx.rank == 0:
        board = JobBoard(8)
        jobs = [board.submit(r, batch_key=adapter.batch_key(r)) for r in
                [{"steps": 8}, {"steps": 8, "fail": (1, 3)}, {"steps": 8}, {"steps": 3, "key": "other"}]]
        engine = Engine(link, adapter, board, ping_s=0.05, max_batch=4)
        engine.start()
        while not jobs[2].finished.is_set():
            if jobs[2].done >= 4:
                board.cancel(jobs[2], "cancelled by DELETE")
            time.sleep(0.002)
        assert all(j.finished.wait(30) for j in jobs)
        engine.stop()
        states = [(j.state, j.error, j.result, j.http_status, j.batch_size) for j in jobs]
    else:
        assert Engine(link, adapter).serve_worker() is None
        states = None
    with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"batches": adapter.batches, "reached": adapter.reached, "states": states}, f)
    return ctx.rank


def test_a_batch_agrees_per_request_so_one_leaves_and_the_others_go_on(tmp_path):
    assert run_on_ranks(_batch_job, 2, str(tmp_path), timeout_s=60) == [0, 1]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["batches"] == r1["batches"], "every rank drops the same request at the same step"
    (reached,) = r0["batches"]
    assert reached[0] == 8 and reached[1] == 2 and 4 <= reached[2] < 8, reached
    assert r0["reached"] == r1["reached"] == [3], "the other key's job ran alone, after the batch"
    ok, failed, cancelled, other = r0["states"]
    assert ok[0] == SUCCEEDED and ok[2] == {"rank": 0, "steps": 8, "batch": 3} and ok[4] == 3
    assert failed[0] == FAILED and failed[3] == 500 and failed[1] == (
        "rank 1: RuntimeError: injected on rank 1 at step 3 for request 1 (after denoise step 3)"), failed
    assert cancelled[0] == CANCELLED and cancelled[1] == "cancelled by DELETE" and cancelled[3] == 499
    assert other[0] == SUCCEEDED and other[4] == 1


def test_max_batch_needs_an_adapter_that_batches():
    with pytest.raises(ValueError, match=r"^--max-batch 2: .* runs one request at a time"):
        Engine(RankLink(0, 1, None), StepAdapter(0), JobBoard(2), max_batch=2)
    with pytest.raises(ValueError, match=r"^--max-batch must be an integer >= 1, got 0"):
        Engine(RankLink(0, 1, None), BatchStepAdapter(0), JobBoard(2), max_batch=0)
