"""Imported by the CPU ranks' fork server as a preload module (dtgen.launch), and only there:
the fork server leaves the moment its launcher dies, however it died.

Without this it leaves when it reads EOF on multiprocessing's "alive" pipe, then tears its
interpreter down, torch included: on a loaded 2-core machine that outlasted the 5 s in which
every process of a killed job must be gone. A thread waits on a pidfd of its parent (the
launcher) and ends the process with `os._exit`. The ranks it forks do not inherit the thread."""
from __future__ import annotations

import os
import select
import threading


def _leave_with_parent() -> None:
    parent = os.getppid()
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):   # no pidfds (not Linux) or the parent is gone already
        if parent == 1:
            os._exit(0)
        return
    select.select([fd], [], [])
    os._exit(0)


threading.Thread(target=_leave_with_parent, name="dtgen-forkserver-watch", daemon=True).start()
