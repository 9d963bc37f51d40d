"""One rank's failure ends every rank, with its message; a stalled rank says where it is.

Under torchrun each rank is its own process. Without help, an exception on one rank
leaves the others blocked in their next collective until its timeout (minutes), and an
NCCL teardown that waits on peers can block forever. `RankWatch` gives every rank a
daemon thread that talks to the others through torchrun's store, never through the
data-plane communicators:

- `fail()` (the failing rank): prints its traceback with a `[rank r]` prefix, publishes
  one line under `FAILURE_KEY` (the first failure wins), waits a moment for the others to
  say they saw it (`SEEN_KEY`: torchrun stops the other ranks as soon as one exits, which
  would cut their message short), aborts the communicators and exits with status 1. It
  never calls a teardown that waits on peers.
- The thread on every other rank polls that key (every `poll_s`), prints
  `[rank r] stopping: rank f failed: ...`, aborts and exits 1: the whole job ends within
  seconds. A rank that dies without a word is torchrun's to report: its agent names the
  rank and stops the others.
- Stalls: if no progress is reported (`progress()`, called by the pipeline every step
  and token) for `stall_s` seconds, the thread prints where this rank was and every
  thread's Python stack; after `2 * stall_s` it fails the job like an exception would.
  While any rank compiles (dynamo's start/end callbacks, counted under `COMPILING_KEY`)
  the clock stands still: a cold compile may take minutes, and its peers wait for it in
  their next collective.
- `finish()`: every rank checks in under `DONE_KEY` and waits until all have, watching
  for failures, before the process group is destroyed: a clean end never blocks on a
  peer that is gone.

Spawned ranks (one host, dtgen.launch.RankPool) also watch each other's processes
(`PeerWatch`): a rank that dies without a word, even by SIGKILL, is one line on every other
rank at once (a server's rank 0 answers its requests with it), and no rank stays blocked in
a collective on it.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import traceback

import torch.distributed as dist

FAILURE_KEY = "dtgen/failure"
SEEN_KEY = "dtgen/failure-seen"
DONE_KEY = "dtgen/done"
COMPILING_KEY = "dtgen/compiling"


def say(rank: int, text: str) -> None:
    """Print to stderr, every line prefixed with the rank, and flush."""
    lines = text.rstrip("\n").splitlines() or [""]
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    sys.stderr.flush()


def abort_and_exit(code: int, abort_timeout_s: float = 5.0) -> None:
    """Abort every communicator (NCCL ops blocked on a lost peer return), then exit at once.

    The abort runs on a helper thread with a deadline: the exit happens even if it hangs.
    """
    def _abort():
        try:
            if dist.is_initialized():
                dist.distributed_c10d._abort_process_group()
        except Exception:
            pass

    t = threading.Thread(target=_abort, daemon=True)
    t.start()
    t.join(abort_timeout_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stacks() -> str:
    """Every thread's Python stack, as one text (printed in one write, so that two ranks'
    dumps do not interleave line by line)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _summary_line(text: str) -> str:
    """A traceback's last line: the exception and its message."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"


class RankWatch:
    def __init__(self, store: dist.Store, rank: int, world_size: int, stall_s: float = 300.0,
                 poll_s: float = 0.5):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stall_s, self.poll_s = stall_s, poll_s
        self._last = time.monotonic()
        self._where = "start-up"
        self._compiling = 0        # compiles running on this rank (main thread's callbacks)
        self._published = 0        # of which the store knows
        self._stall_reported = False
        self._failing = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()  # the store client is shared by both threads
        self._callbacks = self._register_compile_callbacks()
        self._thread = threading.Thread(target=self._run, name="dtgen-rank-watch", daemon=True)
        self._thread.start()

    # ---- called by the rank's main thread ------------------------------------------
    def progress(self, where: str) -> None:
        with self._lock:
            self._last, self._where, self._stall_reported = time.monotonic(), where, False

    def fail(self, traceback_text: str) -> None:
        """This rank failed: report, tell the others, abort, exit 1. Does not return.

        If another rank failed first, this error is most likely its consequence (a collective
        that lost its peer): one line then, naming the first failure, not a second traceback."""
        self._failing = True  # the watch thread must not announce this rank's own failure
        mine = f"rank {self.rank} failed: {_summary_line(traceback_text)}"
        try:
            with self._store_lock:
                first = self.store.compare_set(FAILURE_KEY, "", mine).decode()
        except Exception:
            first = mine
        if first != mine:
            say(self.rank, f"stopping: {first} (here: {_summary_line(traceback_text)})")
            self._saw_failure()
        else:
            say(self.rank, traceback_text)
            self._wait_until_seen(timeout_s=4 * self.poll_s + 1.0)
        abort_and_exit(1)

    def _saw_failure(self) -> None:
        try:
            with self._store_lock:
                self.store.add(SEEN_KEY, 1)
        except Exception:
            pass

    def _wait_until_seen(self, timeout_s: float) -> None:
        """Until every other rank has printed the failure (their watch threads poll every
        `poll_s`, whatever their main thread is blocked in), or `timeout_s`."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                with self._store_lock:
                    if self.store.add(SEEN_KEY, 0) >= self.world_size - 1:
                        return
            except Exception:
                return  # the store is gone: nobody is left to wait for
            time.sleep(0.05)

    def finish(self) -> None:
        """Check in as done and wait for every rank (or a failure) before teardown."""
        with self._store_lock:
            self.store.add(DONE_KEY, 1)
        while True:
            with self._store_lock:
                done = self.store.add(DONE_KEY, 0)
            if done >= self.world_size:
                break
            self._check_failure()
            time.sleep(0.1)
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._unregister_compile_callbacks()

    # ---- the watch thread --------------------------------------------------------------
    def _check_failure(self) -> None:
        try:
            with self._store_lock:
                failed = self.store.check([FAILURE_KEY])
                message = self.store.get(FAILURE_KEY).decode() if failed else None
        except Exception as e:  # the store is torchrun's agent: gone means the job is over
            say(self.rank, f"stopping: lost the job's store ({type(e).__name__}: {e})")
            abort_and_exit(1)
            return
        if message and not self._failing:
            say(self.rank, f"stopping: {message}")
            self._saw_failure()
            abort_and_exit(1)

    def _anyone_compiling(self) -> bool:
        with self._lock:
            change, self._published = self._compiling - self._published, self._compiling
        with self._store_lock:
            return self.store.add(COMPILING_KEY, change) > 0

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._check_failure()
            try:
                compiling = self._anyone_compiling()
            except Exception:
                continue  # _check_failure handles a lost store
            with self._lock:
                now = time.monotonic()
                if compiling:
                    self._last = now
                idle, where = now - self._last, self._where
                report = idle > self.stall_s and not self._stall_reported
                if report:
                    self._stall_reported = True
            if report:
                say(self.rank, f"no progress for {idle:.0f} s (last: {where}); Python stacks follow\n" + _stacks())
            if idle > 2 * self.stall_s:
                self.fail(f"StallError: no progress for {idle:.0f} s (last: {where}); giving up")

    # ---- compile callbacks: a cold compile is not a stall ------------------------------
    def _register_compile_callbacks(self):
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:
            return None

        def start(*_):
            with self._lock:
                self._compiling += 1

        def end(*_):
            with self._lock:
                self._compiling = max(0, self._compiling - 1)
                self._last = time.monotonic()
                self._stall_reported = False

        callback_handler.register_start_callback(start)
        callback_handler.register_end_callback(end)
        return callback_handler, start, end

    def _unregister_compile_callbacks(self) -> None:
        if self._callbacks is None:
            return
        handler, start, end = self._callbacks
        self._callbacks = None
        for remove, cb in ((handler.remove_start_callback, start), (handler.remove_end_callback, end)):
            try:
                remove(cb)
            except ValueError:
                pass


def how_it_ended(exitcode: int | None) -> str:
    """A process's end in words: 'killed by SIGKILL', 'exit code 1'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


# The exit status of a rank that ended because a peer died: its launcher names the peer, not it.
PEER_DIED_EXIT = 75


class PeerWatch:
    """Ranks of one host (spawned ranks) watch each other's processes: a thread waits on a
    pidfd per peer, which turns readable the moment that process exits, however it died.

    A peer's death is one line, `rank r died (killed by SIGKILL)`. Handlers registered with
    `when_gone` (a server's rank 0: answer every request with it; its other ranks: `exit`)
    run once, on the watch thread. Whatever they do, a rank still running `exit_after_s`
    later exits (`PEER_DIED_EXIT`): its launcher normally stops it sooner, but nothing may
    stay blocked in a collective on a peer that is gone. Without pidfds (not Linux) the
    thread polls every `poll_s`."""

    def __init__(self, rank: int, pids: dict[int, int], exit_after_s: float = 8.0, poll_s: float = 0.2):
        self.rank, self.pids = rank, {r: p for r, p in pids.items() if r != rank}
        self.exit_after_s, self.poll_s = exit_after_s, poll_s
        self._line: str | None = None
        self._gone = threading.Event()
        self._handlers: list = []
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="dtgen-peer-watch", daemon=True).start()

    def when_gone(self, fn) -> None:
        """Call fn(line) once a peer has died (at once if one has)."""
        with self._lock:
            self._handlers.append(fn)
            line = self._line
        if line is not None:
            fn(line)

    def gone(self, wait_s: float = 0.0) -> str | None:
        """The line of the peer that died, waiting up to `wait_s` for one (a collective's
        transport error may come a moment before the kernel marks its process as exited)."""
        self._gone.wait(wait_s)
        return self._line

    def _wait_for_death(self) -> int:
        """The rank of the first peer to exit."""
        fds = {}
        for r, pid in self.pids.items():
            try:
                fds[os.pidfd_open(pid)] = r
            except ProcessLookupError:
                return r
            except (AttributeError, OSError):
                fds = {}
                break
        if len(fds) == len(self.pids):
            ready, _, _ = select.select(list(fds), [], [])
            return fds[ready[0]]
        while True:
            for r, pid in self.pids.items():
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return r
                except PermissionError:
                    pass
            time.sleep(self.poll_s)

    def _run(self) -> None:
        if not self.pids:
            return
        rank = self._wait_for_death()
        code = _exit_code(self.pids[rank])
        line = f"rank {rank} died" + ("" if code is None else f" ({how_it_ended(code)})")
        with self._lock:
            self._line = line
            handlers = list(self._handlers)
        self._gone.set()
        for fn in handlers:
            try:
                fn(line)
            except Exception:
                pass
        time.sleep(self.exit_after_s)
        self.exit()

    @staticmethod
    def exit(*_) -> None:
        """End this rank now, as one whose peer died (`PEER_DIED_EXIT`)."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PEER_DIED_EXIT)


def _exit_code(pid: int, wait_s: float = 0.2) -> int | None:
    """How process `pid` ended, as multiprocessing writes it (-signal, or the exit status),
    read from its /proc entry while its parent has not reaped it (a zombie keeps its exit
    status there); None when that is gone too."""
    end = time.monotonic() + wait_s
    while True:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        if fields[0] in ("Z", "X"):
            status = int(fields[49])  # exit_code: the wait status
            return -(status & 0x7F) if status & 0x7F else status >> 8
        if time.monotonic() > end:
            return None
        time.sleep(0.01)
