"""A server's processes on loopback, with the tiny Qwen-Image: `kill -9` of a `dtgen serve
--world-size 2` launcher ends both spawned ranks within seconds and frees the port; a port in
use is refused before anything loads."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.serve import ROOT, alive_in_group, port_free, running_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process groups from /proc")


def test_ranks_die_with_a_killed_launcher(tmp_path):
    with running_server(tmp_path / "server.log", "--model", "qwen-image", "--world-size", "2", "--plan", "tp2",
                        module="dtgen serve") as (base, proc):
        port = int(base.rsplit(":", 1)[1])
        ranks = [p for p in alive_in_group(proc.pid) if p != proc.pid]
        assert len(ranks) >= 2, ranks  # the 2 ranks (and the fork server)
        assert not port_free(port)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        end = time.monotonic() + 5
        while (alive_in_group(proc.pid) or not port_free(port)) and time.monotonic() < end:
            time.sleep(0.1)
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in alive_in_group(proc.pid)}
        assert left == {}, f"processes outlived their launcher: {left}"
        assert port_free(port), f"port {port} still taken after the launcher was killed"


def test_a_port_in_use_is_refused_before_loading():
    """`dtgen serve` on a port something else listens on: one line naming the port, exit 2,
    before any rank starts or any weight loads (no 'serving' line, no traceback)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "dtgen", "serve", "--model", "qwen-image", "--world-size", "2",
                               "--plan", "tp2", "--port", str(port)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [f"error: --port {port}: the address 127.0.0.1:{port} is in use; "
                                        "stop what holds it or pick another port"]
