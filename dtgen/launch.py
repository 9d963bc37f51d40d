"""Running a function on N ranks: under torchrun, or spawned here as gloo ranks on the CPU.

Multi-node and multi-GPU runs go through `torchrun` (its environment names the rank and
world size; NCCL on GPU). For CPU work and tests, `RankPool` spawns N processes itself,
each with one intra-op thread and a gloo process group with a timeout, and keeps them
alive so several jobs can share one start-up. A job is a picklable function
`fn(ctx, *args)`; every rank's return value comes back.

Failures end the whole job quickly, with the failing rank's story, under both launchers:
- torchrun: `dtgen.watchdog.RankWatch` prints the traceback with a `[rank r]` prefix,
  tells the other ranks through torchrun's store, aborts the communicators and exits 1;
  the others print which rank failed and exit 1 too. Nothing waits in a teardown on a
  peer that is gone (measured on 2 x H200: an exception followed by
  `destroy_process_group()` blocked forever on NCCL).
- spawned ranks: the first failure (an exception, or a rank that died) is raised here as
  `RankFailure`; ranks still running a few seconds later are stopped, not waited for.
  A spawned rank also ends when its launcher is gone, even killed with SIGKILL
  (`_die_with_launcher`), so no orphan keeps serving on the launcher's port.
"""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import queue
import select
import socket
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .watchdog import PEER_DIED_EXIT, PeerWatch, RankWatch, abort_and_exit, how_it_ended, say


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    watch: RankWatch | None = None   # under torchrun: progress reports and failure propagation
    peers: PeerWatch | None = None   # spawned ranks: the other ranks' processes, watched

    def progress(self, where: str) -> None:
        """Tell the stall watch this rank made progress (a step, a token)."""
        if self.watch is not None:
            self.watch.progress(where)


class RankFailure(RuntimeError):
    """One or more ranks failed; the message holds each failing rank's traceback. `line`: the
    whole story in one line where there is one (a rank that died, an error every rank raised
    alike), else None; `told`: a rank printed it already (it ended with `RankStopped`)."""

    def __init__(self, message: str, line: str | None = None, told: bool = False):
        super().__init__(message)
        self.line, self.told = line, told

    def report(self) -> str | None:
        """What a command prints after 'error: ': the one line, the whole message, or None
        (a rank told it already)."""
        return None if self.told else self.line or str(self)


class RankStopped(RuntimeError):
    """A rank's job ended for a reason it has already printed as one line (a server that
    cannot go on): the launcher reports it with no traceback and prints nothing more."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init_from_torchrun(timeout_s: float = 600.0) -> RankContext:
    """Join the process group torchrun describes (NCCL on GPU, gloo otherwise).

    `timeout_s` bounds every data-plane collective: it must cover the compile-time skew
    between ranks (one rank may compile a graph while its peer already waits in the
    graph's first collective). Control-plane agreement has its own, shorter timeout
    (`Topology`).
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local >= count:
            raise RuntimeError(f"rank {rank} is local rank {local}, but this machine shows {count} GPU(s): "
                               f"start at most {count} ranks per node (torchrun --nproc-per-node)")
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return RankContext(rank, world, local, device, backend)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_POLL_S = 0.5  # how often a rank without a pidfd checks that its launcher is alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _watch_launcher(launcher_pid: int) -> None:
    """Exit this rank once the launcher has exited. A pidfd turns readable when the process
    exits, even while its parent has not reaped it yet (a zombie still answers kill(pid, 0));
    without one, poll."""
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        select.select([pidfd], [], [])
    else:
        while _alive(launcher_pid):
            time.sleep(LAUNCHER_POLL_S)
    os._exit(1)


def _die_with_launcher(launcher_pid: int) -> None:
    """End this rank when the launcher dies, even by SIGKILL, so that no orphan rank keeps
    serving. On Linux the kernel sends SIGKILL when the rank's parent exits
    (PR_SET_PDEATHSIG); the parent may be gone already, so check right after asking. Under
    spawn the parent is the launcher. Under the fork server it is that server, which outlives
    the launcher as long as its children hold its liveness pipe, so a thread also watches
    the launcher itself (as it does wherever prctl is missing)."""
    parent = os.getppid()
    try:
        armed = sys.platform.startswith("linux") and \
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent or not _alive(launcher_pid):
        os._exit(1)
    if not (armed and parent == launcher_pid):
        threading.Thread(target=_watch_launcher, args=(launcher_pid,), name="launcher-watch", daemon=True).start()


def _worker(rank: int, world: int, port: int, timeout_s: float, tasks, results, environ: dict,
            launcher_pid: int) -> None:
    _die_with_launcher(launcher_pid)
    # A forked rank has the fork server's environment, from when it started: take the
    # caller's, as a spawned process would (tests and callers set cache folders in it).
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)  # measured: 2 threads per rank on 2 cores made a step 5x slower
    ctx = RankContext(rank, world, rank, torch.device("cpu"), "gloo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        ctx = dataclasses.replace(ctx, peers=PeerWatch(rank, _rank_pids(rank, world)))
    except Exception:
        results.put((rank, False, traceback.format_exc(), None))
        return
    results.put((rank, True, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(ctx, *args), None))
        except Exception as e:
            # an error whose message says it all (`one_line`: a checkpoint or plan that cannot be
            # used, raised on every rank alike) is printed once, without a traceback
            told = isinstance(e, RankStopped)
            brief = ("told" if told else "line", str(e).strip().splitlines()[0]) \
                if told or getattr(e, "one_line", False) else None
            results.put((rank, False, traceback.format_exc(), brief))
        except BaseException:  # report everything, including collective timeouts
            results.put((rank, False, traceback.format_exc(), None))
    dist.destroy_process_group()


def _rank_pids(rank: int, world: int) -> dict[int, int]:
    """Every rank's process id, swapped through the group's store (spawned ranks share a host)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"dtgen/pid/{rank}", str(os.getpid()))
    return {r: int(store.get(f"dtgen/pid/{r}")) for r in range(world)}


# Modules every rank process imports before it forks (see `_rank_context`); a program or a
# pytest run (tests/conftest.py) adds its model code here before its first pool.
# `dtgen.forkserver_watch` ends the fork server with its launcher.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "dtgen.launch", "dtgen.forkserver_watch"]


def _rank_context(preload: tuple[str, ...]):
    """Processes for CPU ranks: forked from a server process that has imported torch and
    `preload` (the caller's model code) once. A fresh interpreter per rank spent ~2-3 s of CPU
    importing them: an 8-rank tiny-model run on 2 cores took 22.4 s, 10.6 s this way. The
    server runs no torch op, so its children start clean, as spawned ones would. The first
    pool of a process starts the server: its preload list is the one that counts."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Each rank runs the program's own module again, as __mp_main__ (multiprocessing's start
    # preparation); preloaded under its name as well, it would be imported twice and runpy
    # would warn once a rank that it "found it in sys.modules".
    main_module = getattr(sys.modules["__main__"].__spec__, "name", None)
    ctx.set_forkserver_preload([m for m in (*FORKSERVER_PRELOAD, *preload) if m != main_module])
    return ctx


STOPPED_AFTER = "was stopped after another rank failed"


class RankPool:
    """N spawned gloo ranks that run jobs until closed. Use as a context manager."""

    def __init__(self, world_size: int, timeout_s: float = 120.0, start_timeout_s: float = 180.0,
                 preload: tuple[str, ...] = ()):
        """`preload`: modules the ranks' jobs import (see `_rank_context`)."""
        self.world_size = world_size
        self.timeout_s = timeout_s
        spawn = _rank_context(preload)
        self._results = spawn.Queue()
        self._tasks = [spawn.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [spawn.Process(target=_worker, args=(r, world_size, port, timeout_s, self._tasks[r],
                                                          self._results, dict(os.environ), os.getpid()),
                                    daemon=True)
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self.broken = False
        self._collect("start-up", start_timeout_s)

    def run(self, fn: Callable[..., Any], *args, deadline_s: float | None = None) -> list[Any]:
        """fn(ctx, *args) on every rank; the list of their results, by rank. `deadline_s`: how
        long the job may take (default: the collective timeout + 30 s; a server: inf)."""
        if self.broken:
            raise RankFailure("this pool's ranks failed earlier; start a new RankPool")
        for q in self._tasks:
            q.put((fn, args))
        return self._collect(getattr(fn, "__name__", "job"), deadline_s or self.timeout_s + 30)

    def _collect(self, what: str, deadline_s: float, grace_s: float = 3.0) -> list[Any]:
        """Every rank's result; on the first failure, wait `grace_s` for the others' stories,
        then stop the ranks still running (they are most likely blocked on the failed one)."""
        got: dict[int, tuple[bool, Any, tuple | None]] = {}
        died: list[int] = []    # ranks whose process ended without a word, in the order seen
        end = time.monotonic() + deadline_s
        while len(got) < self.world_size:
            try:
                rank, ok, payload, brief = self._results.get(timeout=0.2)
                got[rank] = (ok, payload, brief)
                if not ok:
                    end = min(end, time.monotonic() + grace_s)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            for r in dead:
                # Results a rank queued just before exiting may still be in flight.
                time.sleep(0.5)
                try:
                    while True:
                        rank, ok, payload, brief = self._results.get_nowait()
                        got[rank] = (ok, payload, brief)
                except queue.Empty:
                    pass
                if r not in got:
                    code = self._procs[r].exitcode
                    if code == PEER_DIED_EXIT:   # it saw another rank die: that one is the story
                        got[r] = (False, f"rank {r} {STOPPED_AFTER}", None)
                    else:
                        got[r] = (False, f"rank {r} died ({how_it_ended(code)})", None)
                        died.append(r)
                    end = min(end, time.monotonic() + grace_s)
            if time.monotonic() > end:
                failed_first = any(not ok for ok, *_ in got.values())
                for r in range(self.world_size):
                    got.setdefault(r, (False, f"rank {r} {STOPPED_AFTER}" if failed_first
                                       else f"rank {r} did not finish {what} within {deadline_s:.0f} s", None))
        failures = {r: (msg, brief) for r, (ok, msg, brief) in sorted(got.items()) if not ok}
        if failures:
            self.broken = True
            self.close()
            raise RankFailure(f"{what} failed on ranks {sorted(failures)}:\n" + "\n".join(
                f"--- rank {r} ---\n{msg}" for r, (msg, _) in failures.items()), *_one_line(failures, died))
        return [got[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (ValueError, OSError):
                    pass
        # A healthy rank exits at once; one blocked in a collective on a failed peer never
        # would: stop it rather than wait.
        for p in self._procs:
            p.join(timeout=0.5 if self.broken else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_line(failures: dict[int, tuple[str, tuple | None]], died: list[int]) -> tuple[str | None, bool]:
    """(a failure of spawned ranks in one line, or None where a traceback tells it; whether a
    rank printed that line already): the first rank that died, else the one line every
    failing rank gave alike (ranks stopped after another's failure aside). A rank that ended
    with `RankStopped` printed its own line."""
    told = any(brief is not None and brief[0] == "told" for _, brief in failures.values())
    if died:
        return failures[died[0]][0], told
    lines = {brief[1] for _, brief in failures.values() if brief is not None}
    others = [msg for msg, brief in failures.values() if brief is None and STOPPED_AFTER not in msg]
    if len(lines) == 1 and not others:
        return lines.pop(), told
    return None, False


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 600.0,
                 stall_s: float = 300.0, job_deadline_s: float | None = None,
                 preload: tuple[str, ...] = ()) -> list[Any]:
    """fn(ctx, *args) on every rank: under torchrun this process's rank only; else spawned gloo ranks.

    With world size 1 and no torchrun, fn runs here without any process group.
    `job_deadline_s`: spawned ranks only, how long fn may run (a server: inf); `preload`:
    modules their processes import before forking (`RankPool`). Under
    torchrun `ctx.watch` (a `RankWatch`) takes progress reports; a failure on any rank
    ends every rank with status 1 and never returns here.
    """
    if under_torchrun():
        try:
            ctx = init_from_torchrun(timeout_s)
        except Exception:
            say(int(os.environ.get("RANK", -1)), traceback.format_exc())
            abort_and_exit(1)
        if ctx.world_size != world_size:
            say(ctx.rank, f"error: --world-size {world_size} but torchrun started {ctx.world_size} ranks")
            abort_and_exit(2)
        watch = RankWatch(dist.distributed_c10d._get_default_store(), ctx.rank, ctx.world_size, stall_s=stall_s)
        ctx = dataclasses.replace(ctx, watch=watch)
        try:
            result = fn(ctx, *args)
        except BaseException:
            watch.fail(traceback.format_exc())
        watch.finish()  # every rank is done
        # No destroy_process_group(): measured on 2 x H200, it blocked forever once compiled
        # steps had captured NCCL collectives in CUDA graphs. The process ends through
        # `exit_process`, which skips every teardown; the OS releases the communicators.
        return [result]
    if world_size == 1:
        device = torch.device("cpu")
        return [fn(RankContext(0, 1, 0, device, "none"), *args)]
    with RankPool(world_size, timeout_s=timeout_s, preload=preload) as pool:
        return pool.run(fn, *args, deadline_s=job_deadline_s)


def exit_process(code: int) -> None:
    """End a program that may have run under torchrun: flush and leave at once.

    Under torchrun the communicators are still up (see `run_on_ranks`); interpreter
    shutdown would destroy them, which can block on NCCL, so `os._exit` skips it. Elsewhere
    this is `sys.exit(code)` after success and `os._exit(code)` after a failure, so that a
    failed job is gone at once (its ranks are stopped; its fork server is stopped here).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if under_torchrun() and dist.is_initialized():
        os._exit(code)
    _end_fork_server()
    if code:   # a failure has said all it had to: tearing torch down took seconds on a loaded machine
        from multiprocessing import util
        util._exit_function()   # multiprocessing's own exit: its queues' named semaphores are released
        os._exit(code)
    sys.exit(code)


def _end_fork_server() -> None:
    """Stop this program's rank fork server now (it holds no state): left to notice that its
    launcher has gone, it would take seconds more to tear its torch import down."""
    from multiprocessing import forkserver
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
