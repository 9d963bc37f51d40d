"""Shared pytest setup.

Triton kernels run on the CPU under TRITON_INTERPRET=1; the variable must be set before
triton is imported, so it is set here when no GPU is present. GPU-only tests carry the
`gpu` marker and are skipped without CUDA; multi-GPU tests carry `multigpu` and are
skipped with fewer than 2 GPUs.

Under DTGEN_REQUIRE_GOLDEN=1 (CI) a missing golden folder ends the run at collection with
the one-line message of `tests.support.golden.discover_cases`, instead of turning
the official-parity tests into skips. Without it (a clone with no ../shared beside it) they
skip, and the run ends with one line saying where their fixtures go.

Under pytest-xdist every worker computes on one thread: the workers already fill the cores, and
each one's own OpenMP threads on top of them spin against each other (on 2 cores, the Qwen-Image
tests took 30% more CPU time with 2 threads per worker than with 1).
"""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dtgen import launch  # noqa: E402

# Spawned CPU ranks fork from a process that imported the model code once (dtgen.launch).
launch.FORKSERVER_PRELOAD.append("models.hunyuan_image3.cli")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu marker)")
    skip_multi = pytest.mark.skip(reason=f"needs 2 GPUs, this machine shows {gpus} (multigpu marker)")
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and gpus < 1:
            item.add_marker(skip_gpu)


def pytest_sessionstart(session):
    """Under DTGEN_REQUIRE_GOLDEN=1, a missing golden folder ends the run before any test or
    worker starts (with pytest-xdist, a worker that stopped at collection would leave the
    controller with a traceback instead of the line)."""
    from tests.support.golden import (GoldenDataMissing, discover_cases, discover_taylor_cases,
                                      discover_ti2i_cases, golden_required)
    if not golden_required():
        return
    try:
        discover_cases(), discover_ti2i_cases(), discover_taylor_cases()
    except GoldenDataMissing as missing:
        pytest.exit(str(missing), returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_exception_interact(node, call, report):
    """A golden folder that DTGEN_REQUIRE_GOLDEN=1 demands is missing: stop the whole run
    with its one line (the first module to look for it raises; nothing else runs)."""
    from tests.support.golden import GoldenDataMissing
    if report.when == "collect" and call.excinfo is not None and isinstance(call.excinfo.value, GoldenDataMissing):
        pytest.exit(str(call.excinfo.value), returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_terminal_summary(terminalreporter):
    """Say where the golden fixtures go when the parity tests skipped for want of them."""
    from tests.support.golden import missing_fixtures_note
    if terminalreporter.config.option.collectonly:
        return
    note = missing_fixtures_note()
    if note is not None:
        terminalreporter.write_line(note)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The embedded tiny default, written once per pytest run into a private cache folder."""
    from models.hunyuan_image3.tiny import ensure_tiny_checkpoint
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("dtgen-cache"))
