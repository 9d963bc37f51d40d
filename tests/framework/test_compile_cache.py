"""The on-disk compile cache under $DTGEN_CACHE: a second process loads what the first
compiled, and a damaged cache is set aside and rebuilt, never trusted."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One compiled step through dtgen's StepCompiler, in a fresh process; prints the cache counters.
PROGRAM = """
import torch
from torch._dynamo.utils import counters
from dtgen.compile import CompileOptions, StepCompiler

def step(x):
    return torch.sin(x) * 2 + x.cos()

compiler = StepCompiler(CompileOptions(enabled=True))
out = compiler.wrap(step)(torch.linspace(0, 1, 8))
assert torch.allclose(out, step(torch.linspace(0, 1, 8)))
print("RESULT", compiler.cache_dir, int(counters["inductor"]["fxgraph_cache_hit"]),
      int(counters["inductor"]["fxgraph_cache_miss"]), len(compiler.quarantined))
"""


def _compile_in_a_new_process(cache: Path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(DTGEN_CACHE=str(cache), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(l for l in run.stdout.splitlines() if l.startswith("RESULT"))
    folder, hits, misses, quarantined = line.split()[1:]
    return Path(folder), int(hits), int(misses), int(quarantined), run.stderr


def test_a_damaged_cache_is_set_aside_and_a_later_process_loads_the_rebuilt_one(tmp_path):
    """After a first process compiled, its cache's files are damaged: a second process sets the
    folder aside (never trusts it) and compiles again; a third loads the second one's graphs from
    the rebuilt cache (a cold cache, then a warm one, each in its own process)."""
    folder, hits, misses, _, _ = _compile_in_a_new_process(tmp_path)
    assert folder == tmp_path / "compile" and (folder / "fxgraph").is_dir()
    assert (hits, misses) == (0, 1)
    generated = [p for p in folder.rglob("*.py")] + [p for p in folder.rglob("*.so")]
    assert generated
    for p in generated:                 # what a valid cache record points to, now garbage
        p.write_text("garbage(")
    _, hits, misses, quarantined, err = _compile_in_a_new_process(tmp_path)
    assert quarantined == 1 and "the compile cache failed to load" in err
    assert len(list(tmp_path.glob("compile.damaged-*"))) == 1
    _, hits, misses, quarantined, _ = _compile_in_a_new_process(tmp_path)
    assert (hits, misses, quarantined) == (1, 0, 0)


def test_an_unusable_cache_folder_falls_back_to_inductors_default(tmp_path, monkeypatch, capsys):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from dtgen.caches import use_compile_cache

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("DTGEN_CACHE", str(blocker))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)   # restored after the test
    assert use_compile_cache() == Path(default_cache_dir())
    assert "cannot be created" in capsys.readouterr().err


def test_triton_builds_go_to_one_folder_from_the_start(tmp_path, monkeypatch):
    """dtgen's own kernels and inductor's share one Triton folder under the compile cache,
    set before the first launch, so a warm process finds the builds of a cold one."""
    from dtgen.caches import use_compile_cache

    monkeypatch.setenv("DTGEN_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)   # both restored after the test
    monkeypatch.setenv("TRITON_CACHE_DIR", "")                       # empty: not chosen
    folder = use_compile_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))   # the user's choice stays
    use_compile_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
