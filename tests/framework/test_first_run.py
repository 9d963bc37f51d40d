"""A first run prints only what it means to: spawned CPU ranks re-import no module with a
warning, and the tiny default says that its output is noise and where a checkpoint goes."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args, cwd, pythonpath, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_program_that_preloads_its_own_module_starts_its_ranks_without_a_warning(tmp_path):
    """Each rank runs the program's module again as __mp_main__; preloaded under its own name
    in the fork server too, runpy warned once a rank that it was already in sys.modules."""
    (tmp_path / "prog").mkdir()
    (tmp_path / "prog" / "__init__.py").write_text("")
    (tmp_path / "prog" / "main.py").write_text(
        "from dtgen.launch import RankPool\n\n"
        "def rank_of(ctx):\n    return ctx.rank\n\n"
        "if __name__ == '__main__':\n"
        "    with RankPool(2, preload=('prog.main',)) as pool:\n"
        "        print(pool.run(rank_of))\n")
    run = _run(["-m", "prog.main"], tmp_path, [ROOT, tmp_path])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[0, 1]"
    assert "RuntimeWarning" not in run.stderr and "found in sys.modules" not in run.stderr, run.stderr


def test_the_tiny_default_on_spawned_ranks_says_what_it_is_and_nothing_else(tmp_path):
    run = _run(["-m", "examples.qwen_t2i", "--world-size", "2", "--steps", "2", "--output",
                str(tmp_path / "q.png")], ROOT, [ROOT], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    notes = [line for line in run.stdout.splitlines() if "tiny default" in line]
    assert len(notes) == 1 and "noise" in notes[0] and "--checkpoint DIR" in notes[0], run.stdout
    assert "Warning" not in run.stderr and "leaked" not in run.stderr, run.stderr[-3000:]


def test_a_run_that_settled_its_heap_exits_without_leak_reports(tmp_path):
    """`settle_heap` freezes what loading made (gc.freeze); frozen objects are never freed at
    shutdown, so triton's nanobind bindings (imported with the models) reported hundreds of
    "leaked" instances, types and functions at every CLI exit until the heap was unfrozen at exit."""
    run = _run(["-c", "import models.wan.cli\nfrom dtgen.host import settle_heap\nsettle_heap()"], tmp_path, [ROOT])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "leaked" not in run.stderr, run.stderr[-3000:]
