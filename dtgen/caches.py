"""dtgen's cache folder, and the compile cache that lives in it.

    $DTGEN_CACHE (default ~/.cache/dtgen)
        compile/     inductor's FX graph cache, AOTAutograd's cache, generated kernels
                     (TORCHINDUCTOR_CACHE_DIR, unless that is set)
        compile/triton/  every Triton build: inductor's kernels and dtgen's own, with their
                     launchers (TRITON_CACHE_DIR, unless that is set)
        ...          models keep their own files here too (the tiny default's checkpoint)

With the compile cache on disk, a second process that compiles the same graphs loads
them instead (the report counts `fxgraph_cache_hit`). Entries are keyed by torch's own
hashes of the graph, the inputs' properties, the torch version and the device, so an
entry from another version or machine is never looked up. A damaged entry is handled
in two ways. A cache record that fails to load is skipped by torch itself and rebuilt.
A generated file that a valid record points to and that fails to import, however, ends
the compile. `StepCompiler` then moves the whole folder aside (`quarantine_compile_cache`)
and compiles again from nothing, never trusting the rest of it.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"


def cache_root() -> Path:
    return Path(os.environ.get("DTGEN_CACHE", Path.home() / ".cache" / "dtgen"))


def write_folder_once(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """`target`, written by `write(folder)` on first use: into a temporary folder beside it,
    renamed into place, so an interrupted run leaves nothing half-written and concurrent
    first uses agree. `marker`: a file that exists once the folder is complete."""
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / marker).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _inductor_default() -> Path:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(os.path.abspath(default_cache_dir()))


def compile_cache_dir() -> Path:
    """Where compiled artefacts go: $TORCHINDUCTOR_CACHE_DIR if the user set it, else
    $DTGEN_CACHE/compile."""
    chosen = os.environ.get(INDUCTOR_ENV)
    # inductor writes its default (a folder under /tmp) into the variable once it has
    # looked: that one is not the user's choice
    if chosen and Path(os.path.abspath(chosen)) != _inductor_default():
        return Path(chosen)
    return cache_root() / "compile"


def use_compile_cache() -> Path:
    """Point inductor (and so Triton's builds) at the compile cache folder and turn on the
    on-disk FX graph and AOTAutograd caches. Call before the first compile."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    folder = compile_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # not worth failing a run over: compile where inductor would have by itself
        fallback = _inductor_default()
        print(f"warning: compile cache {folder} cannot be created ({e.strerror or e}); using {fallback}",
              file=sys.stderr)
        folder = fallback
        folder.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_ENV] = str(folder)
    # One fixed folder for Triton. Left alone, inductor points TRITON_CACHE_DIR at the compile
    # folder only once it compiles or loads a graph: a cold process then builds dtgen's own
    # kernels into ~/.triton, and a warm one (which loads graphs first) looks for them in the
    # compile folder and builds them again (measured on an H200: 9 launchers, 2.3 s).
    if not os.environ.get(TRITON_ENV):
        os.environ[TRITON_ENV] = str(folder / "triton")
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return folder


def mentions_compile_cache(error: BaseException) -> bool:
    """Whether an exception (or one in its chain) names a file of the compile cache."""
    folder = str(compile_cache_dir().resolve())
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if folder in str(error) or any(folder in str(a) for a in getattr(error, "args", ())):
            return True
        error = error.__cause__ or error.__context__
    return False


def quarantine_compile_cache() -> Path | None:
    """Move the compile cache folder aside (kept for a post-mortem, never read again) so that
    the next compile starts from an empty one; returns where it went (None: already gone,
    e.g. another rank moved it first)."""
    folder = compile_cache_dir()
    target = folder.with_name(f"{folder.name}.damaged-{int(time.time())}-{os.getpid()}")
    try:
        folder.rename(target)
    except FileNotFoundError:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return target
