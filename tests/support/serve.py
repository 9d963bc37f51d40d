"""Helpers for the server tests over real HTTP on 127.0.0.1 (HunyuanImage-3, Wan, Qwen-Image):
start a server module on a free port and wait for /ready, call it, wait for a job, and read
the UI's DOM from headless Chromium.

The servers need fastapi and uvicorn: without them, importing this module skips the test
module that imports it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, method: str, path: str, body=None, timeout: float = 120.0,
         content_type: str = "application/json") -> tuple[int, dict | str, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, raw, headers = answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as e:
        status, raw, headers = e.code, e.read(), dict(e.headers)
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text), headers
    except json.JSONDecodeError:
        return status, text, headers


@contextlib.contextmanager
def running_server(log: Path, *flags: str, ready_within_s: float = 180, module: str = "examples.hunyuan_serve",
                   faults: str | None = None, port: int | None = None):
    """`module` (a server: "examples.serve", or a command and its words, "dtgen serve") with
    `flags` on `port` (default: a free one), until /ready; yields (base, proc). `faults`:
    failures forced on its ranks (tests/support/faults.py), e.g. "1:ar:2"."""
    port = port or _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run = ["-m", *module.split()] if faults is None else ["-m", "tests.support.faults", faults, *module.split()]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *run, "--port", str(port), *flags],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_within_s
        while True:
            assert proc.poll() is None, f"the server exited early:\n{log.read_text()[-3000:]}"
            try:
                if call(base, "GET", "/ready", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"not ready after {ready_within_s} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
        yield base, proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already (a test may end it)
            os.killpg(proc.pid, signal.SIGTERM)  # the spawned ranks are in its process group
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def alive_in_group(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group `pgid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after its ')'
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_done(base: str, job_id: str, timeout_s: float = 120.0) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        _, job, _ = call(base, "GET", f"/v1/jobs/{job_id}")
        if job["status"] not in ("queued", "running"):
            return job
        assert time.monotonic() < end, job
        time.sleep(0.1)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium_dom(url: str, profile: Path) -> str:
    """The page at `url` once headless Chromium has nothing left to do. Virtual time runs
    ahead while the page only waits on its poll timer, and stops once nothing is pending:
    the budget is a bound, not a wait."""
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                           "--virtual-time-budget=3600000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=180).stdout


def progress_log(dom: str) -> list[str]:
    log = dom[dom.find('<ol id="log">'):]
    return re.findall(r"<li>([^<]*)</li>", log[:log.find("</ol>")])


def assert_page_saw_phases_in_order(dom: str, order: list[str]) -> None:
    """The page's progress log names only the job's phases, in the job's order. A short tiny
    job may pass a whole phase between two of the page's 200 ms polls, so which phases it
    saw is timing; their order is not (a long job elsewhere in the test shows denoise)."""
    log = progress_log(dom)
    seen = [line.split(", ")[1].split()[0] for line in log if ", " in line]
    assert seen and all(p in order for p in seen), log
    assert [order.index(p) for p in seen] == sorted(order.index(p) for p in seen), log


needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (CI installs it: .ci/run)")
