"""docs/performance.md against bench/results/: every table is what `python -m bench.report`
renders from the committed JSON, and every results path the docs name exists."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import Sources, check, lookup, render_doc, render_table
from bench.report_cells import Calc, ReportError, Row, RunInfo, Runs, Table, Text, Value, Verdict

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_committed_doc_is_what_the_report_renders():
    assert check() is None, check()


def test_every_results_path_in_the_docs_exists():
    """Paths as bench/results/X, and results-relative ones (`h200-.../file`) in backticks."""
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for path in re.findall(r"bench/results/([A-Za-z0-9_.+*/-]+)", text):
            path = path.rstrip(".,)")
            if not list(RESULTS.glob(path)) and not list(RESULTS.glob(path + "*")):
                missing.append(f"{doc.name}: bench/results/{path}")
        for path in re.findall(r"`((?:h200|cpu|compile-cpu)[A-Za-z0-9_.+*/-]*-\d{4}-\d{2}-\d{2}[A-Za-z0-9_.+*/-]*)`",
                               text):
            if not list(RESULTS.glob(path)):
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing


def test_no_doc_cites_a_branch_that_is_not_main():
    for doc in DOCS:
        assert not re.search(r"\bwip/[A-Za-z0-9_-]+", doc.read_text()), doc.name


def test_check_names_the_tables_that_differ(tmp_path):
    doc = tmp_path / "performance.md"
    text = (ROOT / "docs" / "performance.md").read_text()
    doc.write_text(text.replace("| Wan2.1 1.3B (12 heads), per step | 30 |", "| Wan2.1 1.3B (12 heads), per step | 31 |"))
    problem = check(doc)
    assert problem is not None and "wan-dit" in problem and "\n" not in problem


DATA = {"rows": [{"variant": "a", "tokens": 1, "us": 3.0, "tiles": {"block_r": 64}},
                 {"variant": "a", "tokens": 2, "us": 5.0, "tiles": {"block_r": 128}}],
        "top": [["_gate_up_kernel", 12.0, 4], ["_down_kernel", 6.0, 4]]}


def test_paths_select_by_fields_nested_fields_and_name_prefix():
    assert lookup(DATA, "rows[variant=a,tokens=2].us") == 5.0
    assert lookup(DATA, "rows[tiles/block_r=64].us") == 3.0
    assert lookup(DATA, "top[^_down][1]") == 6.0
    assert lookup(DATA, "rows[1].tiles.block_r") == 128
    with pytest.raises(ReportError, match=r"\[variant=a\] matches 2 elements"):
        lookup(DATA, "rows[variant=a].us", "x.json")
    with pytest.raises(ReportError, match="no key 'nope'"):
        lookup(DATA, "nope.us", "x.json")


def test_paths_take_keys_and_selector_values_that_hold_a_dot():
    data = {"shapes": {"1.3B": {"heads": 12}}, "rows": [{"model": "1.3B", "ms": 5.0}, {"model": "14B", "ms": 7.0}]}
    assert lookup(data, 'shapes["1.3B"].heads') == 12
    assert lookup(data, "rows[model=1.3B].ms") == 5.0
    with pytest.raises(ReportError, match="no key '1.3' under 'shapes'"):
        lookup(data, 'shapes["1.3"].heads', "x.json")


def _sources(tmp_path, runs=None):
    import json
    (tmp_path / "run").mkdir()
    for i, us in enumerate((31.0, 30.8, 29.9)):
        (tmp_path / "run" / f"r{i}.json").write_text(json.dumps({"torch": "2.11", "us": us}))
    return Sources(runs if runs is not None else {f"run/r{i}.json": RunInfo("make it") for i in range(3)}, tmp_path)


def test_runs_give_median_and_range_and_the_verdict_reads_the_median(tmp_path):
    src = _sources(tmp_path)
    runs = Runs([(f"run/r{i}.json", "us") for i in range(3)], "{:.1f}", " us")
    assert runs.render(src, None) == "30.8 us (median of 3 runs; 29.9-31.0)"
    assert Verdict(runs, 30.0).render(src, None) == "**missed**"       # one run of three meets it
    assert Verdict(runs, 30.8).render(src, None) == "met"
    assert Calc(lambda a, b: a - b, [Value("us", file="run/r0.json"), Value("us", file="run/r2.json")],
                "{:.1f}").render(src, None) == "1.1"
    table = render_table(Table("t", ["what", "us"], [Row(["x", runs])]), src)
    assert "`run/r0.json`, `run/r1.json`, `run/r2.json`" in table and "`make it` (run; torch 2.11)" in table


def test_a_file_without_its_command_or_a_missing_marker_is_refused(tmp_path):
    src = _sources(tmp_path, runs={})
    with pytest.raises(ReportError, match="no command recorded for it"):
        Value("us", file="run/r0.json").render(src, None)
    tables = [Table("t", ["what"], [Row([Text("x")])])]
    with pytest.raises(ReportError, match="does not mark: \\['t'\\]"):
        render_doc("no markers here\n", tables, src)
    with pytest.raises(ReportError, match="marks table 'u'"):
        render_doc("<!-- table:u -->\n<!-- /table:u -->\n", tables, src)


def test_check_command_line_passes_on_the_committed_doc():
    run = subprocess.run([sys.executable, "-m", "bench.report", "--check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_specs_are_one_module_a_suite_and_import_without_the_renderer():
    """bench/specs/<suite>.py for each suite of `python -m bench`; the specs need the cells
    (bench/report_cells.py), never bench/report.py, which imports them."""
    code = ("import sys, bench.specs; from bench.suites import SUITES; "
            "assert 'bench.report' not in sys.modules, 'bench.specs imported bench.report'; "
            "mods = {m.__name__.rsplit('.', 1)[1].replace('_', '-') for m in bench.specs.SUITES}; "
            "assert mods == {s.name for s in SUITES}, mods; "
            "assert sum(len(m.TABLES) for m in bench.specs.SUITES) == len(bench.specs.TABLES) > 0")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_a_file_whose_command_a_runner_step_runs_names_that_step(tmp_path):
    from bench.runner import rerun_index
    runs = {"run/r0.json": RunInfo("python -m bench.bench_moe --out /tmp/m.json"),
            "run/r1.json": RunInfo("python -m bench.bench_moe --part decode"),
            "run/r2.json": RunInfo("bash a_script.sh 'unclosed")}
    src = _sources(tmp_path, runs)
    src.reruns = rerun_index()
    assert src.describe("run/r0.json").endswith("; rerun: `python -m bench run-all kernels:moe`)")
    assert "rerun" not in src.describe("run/r1.json") and "rerun" not in src.describe("run/r2.json")
