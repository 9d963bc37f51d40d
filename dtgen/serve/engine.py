"""The engine: one thread on rank 0 runs jobs on every rank, in lockstep.

- Rank 0's engine thread takes a job from the `JobBoard` and broadcasts it to the other
  ranks over `RankLink`, a gloo group of its own: with a long timeout, so a rank waiting
  for work never trips a collective timeout, and apart from the data plane (NCCL on GPU).
  While idle, rank 0 sends a ping every `ping_s`: a rank that is gone shows at once
  (gloo fails the send) rather than at the next request.
- At every step (each AR token, each denoise step) every rank agrees on one flag, the
  largest of what each rank brings: go on, stop (rank 0: the job was cancelled, or its
  deadline passed), or failed (this rank raised in the step's hook). So a cancel stops
  every rank after the same step, and an error at a step boundary fails the job on all.
- A rank can also raise INSIDE a step (out of memory, a bug, a bad shape), between two of
  the model's collectives; its peers then wait in the next one, which nothing can release
  short of destroying the communicators. So every job ends with a check, through the
  job's store (torchrun's, or the spawned ranks' TCP store), never a collective: each rank
  posts how it left the job and how many collectives it issued on each process group
  (`group_sequence_numbers`). Rank 0 waits up to `end_timeout_s` for every rank's post;
  if all came and every group's members issued the same number of collectives, the ranks
  are in step: the job answers (the first rank's error, if any, by its message; 503 for
  out of memory) and the server goes on. Otherwise some rank is stuck in a collective its
  peers will never issue: the job fails with the error, and the server ends with it
  (`broken`), at once when rank 0 can see it is the one stuck (its own count for a group
  passed the failed rank's), else after `end_timeout_s`. Nothing tries to rebuild the
  model's groups: an aborted NCCL communicator cannot be reused, and every phase's groups
  and compiled graphs hold them; a supervisor restarting the server is the honest repair.
- The model plugs in as a `ServeAdapter`: it parses a request's fields (rank 0) and runs
  one request on a rank with a progress hook. An adapter that can batch (`BatchingAdapter`:
  `batch_key`, `generate_batch`) lets the engine take up to `max_batch` waiting jobs with
  one key at once; then every step boundary agrees on one flag PER REQUEST (one all-reduce of
  a vector), so a cancel, a deadline or an error at a boundary ends that request alone, on
  every rank after the same step, and the others go on. An error inside a shared step ends
  every request of the batch (as it ends a single job).
- Between two jobs the engine thread also runs LoRA commands (`between_jobs`: load or unload an
  adapter, dtgen/serve/loras.py): rank 0 sends one to every rank, each runs it and every
  rank's outcome is gathered on the control group, so it takes effect on all ranks or none.

Process groups are passed in; nothing here reads a global group inside a step.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from dtgen.host import trim_heap

from .errors import Cancelled
from .jobs import CANCELLED, FAILED, RANK_GONE, SUCCEEDED, Job, JobBoard
from .loras import run_lora_command

GO, STOP, FAIL = 0, 1, 2

# A lost control channel where no peer watch names the dead rank (under torchrun its agent does).
LINK_LOST = f"{RANK_GONE}: the control channel to the other ranks broke"

# How a rank left a job (its post at the job's end).
OK, STOPPED, PEER, OOM, ERROR = "ok", "cancelled", "peer", "out_of_memory", "error"


class ServeAdapter(Protocol):
    """What a model gives the server."""

    kind: str  # what its jobs make: "image" or "video"

    def parse(self, fields: dict) -> Any:
        """A validated request from JSON fields (rank 0); `RequestError` names a bad field."""

    def phases(self, request: Any) -> tuple[str, ...]:
        """The phases a request goes through, in order (the overall percent of progress)."""

    def generate(self, request: Any, progress: "StepProgress") -> Any:
        """Run one request on this rank; the result on rank 0 (JSON-ready), anything elsewhere.
        `progress(phase, done, total)` after every step, on every rank (the ranks agree
        there); `progress.show(phase, done, total)` only reports (rank 0), no agreement."""

    def warm_up(self, progress) -> None:
        """Compile and run what requests will need, before /ready."""

    def free_caches(self) -> None:
        """After an out-of-memory error: drop what can be rebuilt."""

    def on_step(self, phase: str, done: int, total: int) -> None:
        """Called at every step on every rank, before the ranks agree to go on: an exception
        here fails the job on every rank at that step (and the server goes on)."""


class BatchingAdapter(ServeAdapter, Protocol):
    """A `ServeAdapter` whose requests can share steps as rows of one batch."""

    def batch_key(self, request: Any) -> Any:
        """Requests with equal keys (not None) may run as one batch (rank 0, at submission)."""

    def generate_batch(self, requests: list[Any], progress: "BatchStepProgress") -> list[Any]:
        """Run the requests together on this rank: one entry per request, its result (rank 0:
        JSON-ready; anything elsewhere) or the exception it left the batch with.
        `progress(phase, done, total, members)` at every step boundary of `members` (batch
        indices), on every rank: returns the requests that leave the batch there, each with
        its exception (dtgen/batching.py); `progress.show(phase, done, total, members)` only
        reports (rank 0)."""


def can_batch(adapter: Any) -> bool:
    return callable(getattr(adapter, "generate_batch", None)) and callable(getattr(adapter, "batch_key", None))


class PeerFailed(RuntimeError):
    """Another rank failed this job's step; this rank stops at the same step."""


class LinkBroken(RuntimeError):
    """A rank is gone: the server cannot go on."""


def group_sequence_numbers() -> dict[str, int]:
    """Collectives issued so far on each process group this rank belongs to, by group name
    (names are given in creation order, the same on every rank)."""
    c10d = dist.distributed_c10d
    out = {}
    for group in list(c10d._world.pg_map):
        try:
            out[c10d._get_process_group_name(group)] = int(group._get_sequence_number_for_group())
        except (RuntimeError, AttributeError, KeyError):  # a backend without the counter
            continue
    return out


@dataclass
class RankLink:
    """The control channel between rank 0 and the others (None group: one process).
    `store`: the job's key-value store (the job-end check); None on one process."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    store: Any = None

    def send(self, command: dict) -> None:
        """Rank 0: every other rank receives `command`."""
        if self.group is not None:
            try:
                dist.broadcast_object_list([command], src=0, group=self.group)
            except Exception as e:  # a rank that is gone: gloo fails the send
                raise LinkBroken(f"{RANK_GONE} ({type(e).__name__}: {_first_line(e)})") from None

    def receive(self) -> dict:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, mine: Any) -> list[Any]:
        """Every rank's `mine`, by rank (a command run between jobs: each rank's outcome)."""
        if self.group is None:
            return [mine]
        everyone: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, mine, group=self.group)
        except Exception as e:
            raise LinkBroken(f"a rank is gone ({type(e).__name__}: {_first_line(e)})") from None
        return everyone

    def agree(self, flag: int) -> int:
        """The largest flag any rank brings (GO < STOP < FAIL)."""
        return self.agree_each([flag])[0]

    def agree_each(self, flags: list[int]) -> list[int]:
        """Per position, the largest flag any rank brings: one flag per request of a batch,
        in one all-reduce."""
        if self.group is None:
            return list(flags)
        t = torch.tensor(flags, dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as e:
            raise LinkBroken(f"{RANK_GONE} ({type(e).__name__}: {_first_line(e)})") from None
        return [int(v) for v in t.tolist()]

    # ---- the job-end check, through the store -------------------------------------------
    def post(self, job_no: int, outcome: dict) -> None:
        self.store.set(f"dtgen/serve/{job_no}/rank{self.rank}", json.dumps(outcome))

    def posted(self, job_no: int, rank: int) -> dict | None:
        key = f"dtgen/serve/{job_no}/rank{rank}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def set_verdict(self, job_no: int, verdict: str) -> None:
        self.store.set(f"dtgen/serve/{job_no}/verdict", verdict)

    def verdict(self, job_no: int) -> str | None:
        key = f"dtgen/serve/{job_no}/verdict"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def forget(self, job_no: int) -> None:
        """Drop a job's keys (rank 0, once every rank has read its verdict)."""
        for name in [f"rank{r}" for r in range(self.world_size)] + ["verdict"]:
            try:
                self.store.delete_key(f"dtgen/serve/{job_no}/{name}")
            except Exception:
                pass


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


class StepProgress:
    """The progress hook a request runs with on one rank: calling it is a step boundary
    (every rank agrees there to go on, stop or fail); `show` only reports (rank 0)."""

    def __init__(self, link: RankLink, job: Job | None, on_step: Callable[[str, int, int], None],
                 on_show: Callable[[str, int, int], None] | None = None):
        self.link, self.job, self.on_step, self.on_show = link, job, on_step, on_show
        self.at = ("", 0, 0)     # the last boundary every rank passed

    def __call__(self, phase: str, done: int, total: int) -> None:
        flag, own = GO, None
        try:
            self.on_step(phase, done, total)
        except Exception as e:  # this rank's error, at a step boundary: tell the others first
            own, flag = e, FAIL
        stop = self.job.stop_reason() if self.job is not None else None
        if flag == GO and stop is not None:
            flag = STOP
        agreed = self.link.agree(flag)
        self.at = (phase, done, total)
        if own is not None:
            raise own
        if agreed == FAIL:
            raise PeerFailed(f"another rank failed at {phase} step {done}")
        if agreed == STOP:
            raise Cancelled(stop[0] if stop else "cancelled")

    def show(self, phase: str, done: int, total: int) -> None:
        if self.on_show is not None:
            self.on_show(phase, done, total)


class BatchStepProgress:
    """The progress hook of a batch of requests on one rank (`BatchingAdapter.generate_batch`):
    calling it is a step boundary of `members`, where every rank agrees on one flag per
    request still in the batch (go, stop, failed) and the requests that must leave are
    returned with their exceptions: `Cancelled` (rank 0's cancel or deadline), this rank's
    own error in the step's hook, or `PeerFailed` (another rank's). `show` only reports."""

    def __init__(self, link: RankLink, jobs: list[Job] | None, size: int,
                 on_step: Callable[[int, str, int, int], None],
                 on_show: Callable[[int, str, int, int], None] | None = None):
        self.link, self.jobs, self.size, self.on_step, self.on_show = link, jobs, size, on_step, on_show
        self.active = list(range(size))
        self.at: dict[int, tuple[str, int, int]] = {}   # each request's last boundary every rank passed

    def __call__(self, phase: str, done: int, total: int, members: list[int]) -> dict[int, BaseException]:
        flags, own, stops = [GO] * self.size, {}, {}
        for m in members:
            try:
                self.on_step(m, phase, done, total)
            except Exception as e:  # this rank's error, at a step boundary: tell the others first
                own[m], flags[m] = e, FAIL
        for m in self.active:
            stop = self.jobs[m].stop_reason() if self.jobs is not None else None
            if flags[m] == GO and stop is not None:
                flags[m], stops[m] = STOP, stop
        agreed = self.link.agree_each(flags)
        for m in members:
            self.at[m] = (phase, done, total)
        left: dict[int, BaseException] = {}
        for m in self.active:
            if m in own:
                left[m] = own[m]
            elif agreed[m] == FAIL:
                left[m] = PeerFailed(f"another rank failed at {phase} step {done}")
            elif agreed[m] == STOP:
                left[m] = Cancelled(stops[m][0] if m in stops else "cancelled")
        self.active = [m for m in self.active if m not in left]
        return left

    def show(self, phase: str, done: int, total: int, members: list[int]) -> None:
        if self.on_show is not None:
            for m in members:
                self.on_show(m, phase, done, total)


def _left_with(e: BaseException, where: tuple[str, int, int] | None) -> dict:
    """How a request that left a batch ended, as a rank posts it."""
    if isinstance(e, Cancelled):
        return {"kind": STOPPED, "message": e.reason}
    if isinstance(e, PeerFailed):
        return {"kind": PEER, "message": str(e)}
    at = f" (after {where[0]} step {where[1]})" if where and where[0] else ""
    return {"kind": OOM if isinstance(e, torch.OutOfMemoryError) else ERROR,
            "message": f"{type(e).__name__}: {_first_line(e)}{at}",
            "traceback": "".join(traceback.format_exception(e))}


def run_jobs_on_rank(link: RankLink, adapter: ServeAdapter, requests: list[Any], jobs: list[Job] | None,
                     on_step: Callable[[int, str, int, int], None],
                     on_show: Callable[[int, str, int, int], None] | None = None) -> tuple[dict, list[Any]]:
    """One engine run on this rank: a single request (`run_job_on_rank`) or a batch of them
    (`BatchingAdapter.generate_batch`). Returns (how this rank left the run, one result per
    request): the run's own kind (its "seqs" for the job-end check) and, in "members", how
    each request ended. Never raises but for `LinkBroken`."""
    if len(requests) == 1:
        outcome, result = run_job_on_rank(link, adapter, requests[0], jobs[0] if jobs else None,
                                          lambda *a: on_step(0, *a),
                                          None if on_show is None else lambda *a: on_show(0, *a))
        outcome["members"] = [{k: v for k, v in outcome.items() if k in ("kind", "message")}]
        return outcome, [result]
    progress = BatchStepProgress(link, jobs, len(requests), on_step, on_show)
    results: list[Any] = [None] * len(requests)
    try:
        results = list(adapter.generate_batch(requests, progress))
        outcome = {"kind": OK}
    except LinkBroken:
        raise
    except torch.OutOfMemoryError as e:
        adapter.free_caches()
        outcome = {"kind": OOM, "message": f"out of memory: {_first_line(e)}"}
    except Exception as e:   # inside a shared step: every request of the batch ends with it
        outcome = {"kind": ERROR, "message": f"{type(e).__name__}: {_first_line(e)}",
                   "traceback": traceback.format_exc()}
    members = []
    for m, result in enumerate(results):
        if outcome["kind"] != OK:
            members.append({"kind": outcome["kind"], "message": outcome["message"]})
        elif isinstance(result, BaseException):
            members.append(_left_with(result, progress.at.get(m)))
            results[m] = None
        else:
            members.append({"kind": OK})
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:   # as in run_job_on_rank: queued collectives done before the post
            torch.cuda.synchronize()
        except Exception as e:
            outcome = {"kind": ERROR, "message": f"the device failed: {type(e).__name__}: {_first_line(e)}",
                       "fatal": True, "traceback": traceback.format_exc()}
            members = [{"kind": ERROR, "message": outcome["message"]} for _ in requests]
    outcome["members"] = members
    if link.group is not None:
        outcome["seqs"] = group_sequence_numbers()
    return outcome, results


def run_job_on_rank(link: RankLink, adapter: ServeAdapter, request: Any, job: Job | None,
                    on_step: Callable[[str, int, int], None], on_show=None) -> tuple[dict, Any]:
    """One request on this rank, stopping with every other rank at step boundaries.
    Returns (how this rank left it, the result): never raises but for `LinkBroken`."""
    progress = StepProgress(link, job, on_step, on_show)
    try:
        result = adapter.generate(request, progress)
        outcome = {"kind": OK}
    except Cancelled as e:
        result, outcome = None, {"kind": STOPPED, "message": e.reason}
    except PeerFailed as e:
        result, outcome = None, {"kind": PEER, "message": str(e)}
    except LinkBroken:
        raise
    except torch.OutOfMemoryError as e:
        adapter.free_caches()
        result, outcome = None, {"kind": OOM, "message": f"out of memory: {_first_line(e)}"}
    except Exception as e:
        phase, done, _ = progress.at
        where = f" (after {phase} step {done})" if phase else ""
        result, outcome = None, {"kind": ERROR, "message": f"{type(e).__name__}: {_first_line(e)}{where}",
                                 "traceback": traceback.format_exc()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # Collectives still queued on the device (a CUDA-graph replay's are not counted
        # below) must be done before this rank says it left in step: if a peer never joins
        # one, this waits, the post never comes, and rank 0 gives up on the ranks.
        try:
            torch.cuda.synchronize()
        except Exception as e:  # the device itself failed: nothing on it can be trusted
            outcome = {"kind": ERROR, "message": f"the device failed: {type(e).__name__}: {_first_line(e)}",
                       "fatal": True, "traceback": traceback.format_exc()}
    if link.group is not None:
        outcome["seqs"] = group_sequence_numbers()
    return outcome, result


def in_step(outcomes: dict[int, dict]) -> tuple[bool, str]:
    """Whether every rank left the job having issued the same collectives on each group it
    shares with others: (True, "") or (False, the first group whose counts differ)."""
    by_group: dict[str, dict[int, int]] = {}
    for rank, outcome in outcomes.items():
        for name, seq in outcome.get("seqs", {}).items():
            by_group.setdefault(name, {})[rank] = seq
    for name, counts in sorted(by_group.items()):
        if len(set(counts.values())) > 1:
            return False, f"group {name}: collectives issued by rank {counts}"
    return True, ""


def job_answer(outcomes: dict[int, dict], world_size: int) -> tuple[str, str | None, int]:
    """(state, error, HTTP status) of a job from every rank's outcome: a rank's own error
    first (its message, with its rank), then a cancel, else success."""
    for rank in sorted(outcomes):
        o = outcomes[rank]
        if o["kind"] in (OOM, ERROR):
            prefix = f"rank {rank}: " if world_size > 1 else ""
            return FAILED, prefix + o["message"], 503 if o["kind"] == OOM else 500
    for rank in sorted(outcomes):
        if outcomes[rank]["kind"] == STOPPED:
            return CANCELLED, outcomes[rank]["message"], 499
    if any(o["kind"] == PEER for o in outcomes.values()):  # a peer failed but posted nothing of its own
        return FAILED, next(o["message"] for o in outcomes.values() if o["kind"] == PEER), 500
    return SUCCEEDED, None, 200


class Engine:
    """Rank 0's job runner (a thread) and the worker ranks' loop."""

    def __init__(self, link: RankLink, adapter: ServeAdapter, board: JobBoard | None = None,
                 ping_s: float = 1.0, metrics: Any = None, heartbeat: Callable[[str], None] | None = None,
                 end_timeout_s: float = 10.0, log: Callable[[str], None] | None = None, max_batch: int = 1,
                 peer_gone: Callable[[float], str | None] | None = None):
        """`heartbeat(where)`: called at every ping, step and command (a stall watch that
        must not take an idle server for a hung one). `end_timeout_s`: how long every rank
        has to leave a job once one left it (see the module's docstring). `log(line)`:
        where a job's end is written (one line per job). `max_batch`: the most waiting jobs
        of one batch key run together (> 1 needs a `BatchingAdapter`). `peer_gone(wait_s)`:
        the line of a rank whose process died, or None (`dtgen.watchdog.PeerWatch.gone`):
        a collective's transport error is then told as that line, never as gloo's text."""
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"--max-batch must be an integer >= 1, got {max_batch!r}")
        if max_batch > 1 and not can_batch(adapter):
            raise ValueError(f"--max-batch {max_batch}: {getattr(adapter, 'name', type(adapter).__name__)}'s server "
                             "runs one request at a time (its adapter has no batched entry); use --max-batch 1")
        self.max_batch = max_batch
        self.link, self.adapter, self.board = link, adapter, board
        self.heartbeat = heartbeat or (lambda where: None)
        self.ping_s = ping_s
        self.metrics = metrics
        self.end_timeout_s = end_timeout_s
        self.log = log or (lambda line: None)
        self.peer_gone = peer_gone
        self.ready = threading.Event()
        self.broken: str | None = None       # why the server cannot go on
        self.stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_broken = None
        self._current: list[Job] = []
        self._job_no = 0
        self._between: queue.Queue = queue.Queue()   # LoRA commands waiting for the end of the running job
        self._lock = threading.Lock()        # the current job's end: the engine thread or the watch
        # The current CUDA device is per thread: the engine thread takes the one this rank set.
        self._cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    # ---- rank 0 ------------------------------------------------------------------------
    def start(self, on_broken: Callable[[str], None] | None = None) -> None:
        """Warm up every rank, then run jobs on a thread of its own until `stop()`."""
        self._on_broken = on_broken
        self._thread = threading.Thread(target=self._main, name="dtgen-engine", daemon=True)
        self._thread.start()
        if self.link.world_size > 1:
            threading.Thread(target=self._watch, name="dtgen-engine-watch", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new jobs, cancel the queued ones and the running one (every rank stops at
        its next step), tell the other ranks to exit. A broken engine's thread may be stuck
        in a collective: it is not waited for."""
        if self.board is not None:
            self.board.close()
        for current in list(self._current):
            current.cancel("the server is shutting down", 503)
        self.stopped.set()
        self._drop_between_jobs("the server is shutting down")
        if self._thread is not None and self.broken is None:
            self._thread.join(timeout_s)

    def between_jobs(self, command: dict) -> Future:
        """Run a LoRA command (dtgen/serve/loras.py) on every rank once no job runs; the future
        holds rank 0's answer. Jobs and commands never overlap: both run on the engine thread."""
        done: Future = Future()
        if self.broken is not None or self.stopped.is_set():
            done.set_exception(LinkBroken(self.broken or "the server is shutting down"))
        else:
            self._between.put((command, done))
            if self.board is not None:
                self.board.wake()
        return done

    def _drop_between_jobs(self, why: str) -> None:
        """The commands still waiting answer `why` (the engine stops)."""
        while not self._between.empty():
            _, done = self._between.get_nowait()
            done.set_exception(LinkBroken(why))

    def _run_between_jobs(self) -> None:
        while not self._between.empty():
            command, done = self._between.get_nowait()
            self.heartbeat(f"loras {command['op']} {command['name']}")   # a long load is no stall
            try:
                self.link.send({"op": "loras", "command": command})
                done.set_result(run_lora_command(self.link, getattr(self.adapter, "loras", None), command))
            except BaseException as e:
                done.set_exception(e)
                raise

    def _main(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        try:
            self.link.send({"op": "warm_up"})
            self.adapter.warm_up(lambda phase, done, total: None)
            self.ready.set()
            last, idle = time.monotonic(), False
            while not self.stopped.is_set() and self.broken is None:
                self._run_between_jobs()
                jobs = self.board.next_batch(min(self.ping_s, 0.2), self.max_batch)
                if not jobs:
                    if not idle:   # the queue ran dry: hand the freed host memory back, once
                        self.link.send({"op": "trim"})
                        trim_heap()
                        idle = True
                    if time.monotonic() - last >= self.ping_s:
                        self.link.send({"op": "ping"})
                        self.heartbeat("idle")
                        last = time.monotonic()
                    continue
                self._run(jobs)
                last, idle = time.monotonic(), False
            if self.broken is None:
                self.link.send({"op": "exit"})
        except LinkBroken as e:   # the transport's own text is no answer for a client
            self.lost(self._peer_line(str(e)) or LINK_LOST)
        except BaseException:
            self._break("the engine failed:\n" + traceback.format_exc())

    def _break(self, why: str) -> None:
        if self.broken is not None:
            return
        self.broken = why
        self.ready.clear()
        self._drop_between_jobs(why.splitlines()[0])
        if self.board is not None:
            self.board.close(why.splitlines()[0], 503)
        if self._on_broken is not None:
            self._on_broken(why)

    def lost(self, line: str) -> None:
        """A rank is gone (`line` names it): every running and waiting job answers 503 with
        it, /ready turns 503, the server ends. Called from the peer watch's thread too."""
        why = line if line.startswith(RANK_GONE) else f"{RANK_GONE}: {line}"
        with self._lock:
            if self.broken is not None or self.stopped.is_set():   # stopping anyway: the peers leave too
                return
            for job in list(self._current):
                self._end(job, FAILED, why, 503)
            self._break(why)

    def _peer_line(self, error: str) -> str | None:
        """The line of a rank whose process died, if one did: waited for a moment when
        `error` reads like a lost connection (it may come before the peer's exit shows)."""
        if self.peer_gone is None:
            return None
        lost_link = "gloo" in error.lower() or "connection" in error.lower() or RANK_GONE in error
        return self.peer_gone(1.0 if lost_link else 0.0)

    def _end(self, job: Job, state: str, error: str | None, status: int, result: Any = None) -> None:
        if self.board.finish(job, state, error=error, http_status=status, result=result):
            took = (job.ended or time.monotonic()) - (job.started or job.created)
            self.log(f"{job.id} {job.kind} {state} in {took:.2f} s" + (f" ({status}): {error}" if error else ""))

    def _run(self, jobs: list[Job]) -> None:
        """One engine run: a job, or a batch of jobs of one key, on every rank."""
        m = self.metrics
        if m is not None:
            for job in jobs:
                m.started(job)
        self._job_no += 1
        job_no = self._job_no
        ids = ", ".join(job.id for job in jobs)

        def on_step(k: int, phase: str, done: int, total: int) -> None:
            job = jobs[k]
            job.phase, job.done, job.total = phase, done, total
            self.heartbeat(f"{job.id} {phase} {done}/{total}")
            self.adapter.on_step(phase, done, total)

        def on_show(k: int, phase: str, done: int, total: int) -> None:
            job = jobs[k]
            job.phase, job.done, job.total = phase, done, total

        self._current = list(jobs)
        try:
            self.link.send({"op": "run", "job": job_no, "requests": [job.request for job in jobs]})
            try:
                mine, results = run_jobs_on_rank(self.link, self.adapter, [job.request for job in jobs], jobs,
                                                 on_step, on_show)
            except LinkBroken as e:
                self.lost(self._peer_line(str(e)) or LINK_LOST)
                return
            if mine["kind"] in (ERROR, OOM) and self.link.world_size > 1:
                gone = self._peer_line(mine["message"])
                if gone is not None:   # the error is the lost peer's, not this job's
                    self.lost(gone)
                    return
            for k, member in enumerate(mine["members"]):
                if member["kind"] == ERROR and "traceback" in member:
                    print(f"[rank 0] {jobs[k].id} failed:\n{member['traceback']}", flush=True)
            if mine["kind"] == ERROR:
                print(f"[rank 0] {ids} failed:\n{mine['traceback']}", flush=True)
            if mine["kind"] in (ERROR, OOM):  # answered now; the check below decides if the server goes on
                for job in jobs:
                    self._end(job, *job_answer({0: mine}, self.link.world_size))
            outcomes = {0: mine}
            if self.link.world_size > 1:
                outcomes = self._collect(job_no, mine)
                if outcomes is None:  # the watch thread ended the job and the server
                    return
            with self._lock:
                if self.broken is not None:
                    return
                errors = []
                for k, job in enumerate(jobs):
                    each = {r: {**o, **o["members"][k]} for r, o in outcomes.items()}
                    state, error, status = job_answer(each, self.link.world_size)
                    if state == CANCELLED:
                        stop = job.stop_reason()
                        status = stop[1] if stop else 499
                    self._end(job, state, error, status, results[k] if state == SUCCEEDED else None)
                    errors.append(error)
                error = next((e for e in errors if e), None)
                fatal = [r for r, o in outcomes.items() if o.get("fatal")]
                missing = sorted(set(range(self.link.world_size)) - set(outcomes))
                fine, why = in_step(outcomes)
                if fatal or missing or not fine:
                    self._give_up(job_no, error or "the ranks left the job out of step",
                                  f"rank {fatal[0]}'s device failed" if fatal else
                                  f"rank(s) {missing} did not leave {ids} within {self.end_timeout_s:g} s, "
                                  "stuck in a collective their peers will not issue" if missing else
                                  f"the ranks left {ids} out of step ({why})")
                    return
                if self.link.world_size > 1:
                    self.link.set_verdict(job_no, "go")
                    if job_no > 1:
                        self.link.forget(job_no - 1)
        finally:
            self._current = []

    def _collect(self, job_no: int, mine: dict) -> dict[int, dict] | None:
        """Every rank's post for this job, waiting up to `end_timeout_s` for the others."""
        self.link.post(job_no, mine)
        outcomes = {0: mine}
        end = time.monotonic() + self.end_timeout_s
        while len(outcomes) < self.link.world_size and time.monotonic() < end and self.broken is None:
            for r in range(1, self.link.world_size):
                if r not in outcomes:
                    got = self.link.posted(job_no, r)
                    if got is not None:
                        outcomes[r] = got
            if len(outcomes) < self.link.world_size:
                time.sleep(0.002)
        return None if self.broken is not None else outcomes

    def _give_up(self, job_no: int, error: str, why: str) -> None:
        """The ranks cannot be brought back in step: tell them, end the server."""
        if self.link.store is not None:
            try:
                self.link.set_verdict(job_no, f"stop: {error}")
            except Exception:
                pass
        self._break(f"{error}; the server stops: {why}")

    def _watch(self) -> None:
        """Rank 0, while a job runs: a rank that failed inside a step, while rank 0's thread
        is stuck in a collective waiting for it, ends the job and the server from here."""
        seen: dict[int, tuple[int, float, dict]] = {}  # rank -> (job, when, its post)
        while not self.stopped.is_set() and self.broken is None:
            time.sleep(0.05)
            jobs, job_no = list(self._current), self._job_no
            if not jobs:
                continue
            try:
                for r in range(1, self.link.world_size):
                    if r in seen and seen[r][0] == job_no:
                        continue
                    got = self.link.posted(job_no, r)
                    if got is not None and got["kind"] in (ERROR, OOM):
                        seen[r] = (job_no, time.monotonic(), got)
            except Exception:
                continue
            for r, (no, when, post) in sorted(seen.items()):
                if no != job_no:
                    continue
                mine = group_sequence_numbers()
                ahead = [name for name, seq in post.get("seqs", {}).items() if mine.get(name, -1) > seq]
                late = time.monotonic() - when > self.end_timeout_s
                if not (ahead or late):
                    continue
                with self._lock:
                    if self._current != jobs or all(j.finished.is_set() for j in jobs) or self.broken is not None:
                        break
                    error = f"rank {r}: {post['message']}"
                    for job in jobs:
                        self._end(job, FAILED, error, 503 if post["kind"] == OOM else 500)
                    self._give_up(no, error, f"rank 0 waits in a collective of group {ahead[0]} that rank {r} left "
                                             "inside a step" if ahead else f"rank 0 did not leave "
                                             f"{', '.join(j.id for j in jobs)} within "
                                             f"{self.end_timeout_s:g} s of rank {r}'s failure")
                break

    # ---- the other ranks ---------------------------------------------------------------
    def _worker_step(self, phase: str, done: int, total: int) -> None:
        self.heartbeat(f"{phase} {done}/{total}")
        self.adapter.on_step(phase, done, total)

    def serve_worker(self) -> str | None:
        """Run what rank 0 sends until it says exit (ranks 1..N-1). Returns None, or why
        rank 0 ended the server after a job the ranks could not leave in step."""
        while True:
            command = self.link.receive()
            op = command["op"]
            self.heartbeat(op)
            if op == "exit":
                return None
            if op == "trim":
                trim_heap()
            elif op == "warm_up":
                self.adapter.warm_up(lambda phase, done, total: None)
            elif op == "loras":
                run_lora_command(self.link, getattr(self.adapter, "loras", None), command["command"])
            elif op == "run":
                job_no = command["job"]
                outcome, _ = run_jobs_on_rank(self.link, self.adapter, command["requests"], None,
                                              lambda k, *step: self._worker_step(*step))
                for member in outcome["members"]:
                    if member["kind"] == ERROR and "traceback" in member:
                        print(f"[rank {self.link.rank}] a request failed:\n{member['traceback']}", flush=True)
                if outcome["kind"] == ERROR:
                    print(f"[rank {self.link.rank}] job failed:\n{outcome['traceback']}", flush=True)
                self.link.post(job_no, outcome)
                if outcome["kind"] not in (ERROR, OOM):
                    continue  # left at the end or at a boundary every rank passed: in step
                # Back to the control group only once rank 0 has seen every rank leave in step:
                # after an error inside a step, rank 0 may still be in another collective there.
                while (verdict := self.link.verdict(job_no)) is None:
                    self.heartbeat(f"waiting for the end of job {job_no}")
                    time.sleep(0.02)
                if verdict != "go":
                    return verdict.removeprefix("stop: ")
