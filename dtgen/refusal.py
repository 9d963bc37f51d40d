"""`DeviceRefusal`: an option the device cannot run, refused in one line naming the flag.

Raised on each rank where the option meets the device (FP8 on a GPU without e4m3 units, a library
kernel on a chip it was not built for): the launcher never touches the GPU, so the check runs on
the ranks, before any weight is read, and every rank raises the same line. `one_line` tells the
launcher (dtgen.launch) and the one-process run (dtgen.harness) to print it once, with no traceback.
"""
from __future__ import annotations


class DeviceRefusal(RuntimeError):
    one_line = True
