"""docs/performance.md and README.md's headline table against bench/results/: each is what
`python -m bench.report` renders from the committed JSON, and every results path the docs name exists."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.report import README, Sources, check, lookup, render_page, render_readme, render_table
from bench.report_cells import Calc, ReportError, Row, RunInfo, Runs, Section, Table, Text, Value, Verdict

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PAGE_DOC = ROOT / "docs" / "performance.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORK_LOG = re.compile(r"\bsession\b|\b(call|issue|stop) (\d+|N)\b", re.I)


def test_committed_doc_and_headline_are_what_the_report_renders():
    assert check() is None, check()


def test_a_committed_figure_that_differs_from_its_json_fails_the_check(tmp_path):
    """One figure edited by hand in the page, then in the README's table: the check names where."""
    doc, readme = tmp_path / "performance.md", tmp_path / "README.md"
    text = PAGE_DOC.read_text()
    row = re.search(r"^\| AR decode a token, `decode step`[^|]*\| (\d)", text, re.M)
    assert row is not None
    doc.write_text(text[:row.start(1)] + str((int(row.group(1)) + 1) % 10) + text[row.end(1):])
    shutil.copy(README, readme)
    problem = check(doc, readme)
    assert problem is not None and "hunyuan-h200-phases" in problem and "README" not in problem
    assert "\n" not in problem
    shutil.copy(PAGE_DOC, doc)
    text = readme.read_text()
    figure = re.search(r"^\| Qwen-Image \|[^\n]*?\| (\d)", text, re.M)
    readme.write_text(text[:figure.start(1)] + str((int(figure.group(1)) + 1) % 10) + text[figure.end(1):])
    assert "README.md's headline table differs" in check(doc, readme)


def test_a_changed_json_changes_the_rendered_figure(tmp_path):
    """The page reads the JSON itself: a stored number edited (in a copy) is a different page."""
    from bench.specs import NOT_MEASURED, PAGE, RUNS
    from bench.specs.runs import DECODE
    for file in RUNS:
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RESULTS / file, tmp_path / file)
    data = json.loads((tmp_path / DECODE).read_text())
    data["impls"]["triton"]["floor_ms"] = 1.5
    (tmp_path / DECODE).write_text(json.dumps(data))
    page = render_page(PAGE, NOT_MEASURED, Sources(RUNS, tmp_path))
    assert "1.50 ms (bytes)" in page and page != PAGE_DOC.read_text()
    assert check(src=Sources(RUNS, tmp_path)) is not None


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


def test_the_page_is_current_figures_only():
    """At most 400 lines, the headline at most 12, and no work log in the page or in what renders it
    (which stays under 1,500 lines of at most 120 columns)."""
    assert len(PAGE_DOC.read_text().splitlines()) <= 400
    headline = re.search(r"<!-- table:headline -->\n(.*?)<!-- /table:headline -->", README.read_text(), re.S)
    assert headline is not None and len(headline.group(1).splitlines()) <= 12
    sources = [PAGE_DOC, ROOT / "bench" / "report.py", ROOT / "bench" / "report_cells.py",
               *sorted((ROOT / "bench" / "specs").glob("*.py"))]
    logged = [f"{p.name}: {m.group(0)}" for p in sources for m in WORK_LOG.finditer(p.read_text())]
    assert not logged, logged
    code = sources[1:]
    wide = [f"{p.name}:{i}" for p in code for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert not wide, wide
    assert sum(len(p.read_text().splitlines()) for p in code) < 1500   # the renderer and its specs stay small


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
    (tmp_path / "run").mkdir()
    for i, us in enumerate((31.0, 30.8, 29.9)):
        (tmp_path / "run" / f"r{i}.json").write_text(json.dumps({"torch": "2.11", "us": us, "each": [2.0, 4.0, 3.0]}))
    return Sources(runs if runs is not None else {f"run/r{i}.json": RunInfo("make it") for i in range(3)}, tmp_path)


def test_runs_give_median_and_range_and_the_verdict_reads_the_median(tmp_path):
    src = _sources(tmp_path)
    runs = Runs([(f"run/r{i}.json", "us") for i in range(3)], "{:.1f}", " us")
    assert runs.render(src, None) == "30.8 us (median of 3 runs; 29.9-31.0)"
    assert Runs([("run/r0.json", "each")], "{:.0f}", what="requests").render(src, None) == \
        "3 (median of 3 requests; 2-4)"
    assert Runs([("run/r0.json", "us")], "{:.1f}", " us").render(src, None) == "31.0 us (1 run)"
    assert Verdict(runs, 30.0).render(src, None) == "**missed**"       # one run of three meets it
    assert Verdict(runs, 30.8, label="<= 30.8 us").render(src, None) == "<= 30.8 us: met"
    assert Calc(lambda a, b: a - b, [Value("us", file="run/r0.json"), Value("us", file="run/r2.json")],
                "{:.1f}").render(src, None) == "1.1"
    rows = [Row(["x", runs]), Row(["y", Value("us", file="run/r1.json")])]
    table = render_table(Table("t", "T", ["what", "us"], rows), src)
    assert "| x | 30.8 us (median of 3 runs; 29.9-31.0) | [1], [2], [3] |" in table
    assert "| y | 30.8 | [2] |" in table
    assert "2. `run/r1.json`: run, torch 2.11; `make it`" in table


def test_a_file_without_its_command_repeated_ids_or_missing_markers_are_refused(tmp_path):
    src = _sources(tmp_path, runs={})
    with pytest.raises(ReportError, match="no command recorded for it"):
        Value("us", file="run/r0.json").render(src, None)
    table = Table("t", "T", ["what"], [Row([Text("x")])])
    with pytest.raises(ReportError, match="table ids repeat"):
        render_page([Section("S", [table, table])], [], src)
    with pytest.raises(ReportError, match="no `<!-- table:headline -->`"):
        render_readme("no markers here\n", table, src)


def test_check_command_line_passes_on_the_committed_files():
    run = subprocess.run([sys.executable, "-m", "bench.report", "--check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_ledger_is_what_the_page_reads_and_each_command_names_a_suite():
    """Every file of RUNS is read by a table (and the reverse, or the render fails); each command
    is `python -m bench SUITE PART ...` or `python -m bench run-all SUITE:STEP` of bench/suites.py;
    the specs need the cells (bench/report_cells.py), never bench/report.py, which imports them."""
    code = ("import sys, bench.specs; assert 'bench.report' not in sys.modules, 'bench.specs imported bench.report'")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    from bench.specs import RUNS, TABLES
    from bench.suites import SUITES
    read = {f for t in TABLES for row in t.rows for c in row.cells if not isinstance(c, str) for f in c.files(row.file)}
    assert set(RUNS) == read, set(RUNS) ^ read
    suites = {s.name: s for s in SUITES}
    for file, info in RUNS.items():
        words = info.command.split()
        assert words[:3] == ["python", "-m", "bench"], (file, info.command)
        if words[3] == "run-all":
            name, _, step = words[4].partition(":")
            assert step in {st.name for st in suites[name].steps}, (file, info.command)
        else:
            assert words[4] in {p.name for p in suites[words[3]].parts}, (file, info.command)


@pytest.mark.parametrize("folder,gpu", [("h200-2026-12-03", "1 x H200"), ("h200x2-2026-11-30-plans", "2 x H200"),
                                        ("h100-2026-12-05-hopper-profile", "1 x H100"), ("cpu-2026-12-05", "CPU")])
def test_a_results_folder_names_its_machine(folder, gpu):
    from bench.report import _gpu_of
    assert _gpu_of(f"{folder}/run.json") == gpu
