"""docs/performance.md's tables, rendered from the JSON in bench/results/.

    python -m bench.report            # rewrite every table of docs/performance.md
    python -m bench.report --check    # exit 1, with a one-line summary, if the committed doc differs

The doc's prose is hand-written; each table sits between two markers,

    <!-- table:ID -->
    ... (generated: never edit by hand) ...
    <!-- /table:ID -->

and is rendered from the spec `ID` in `bench/report_specs.py`. Every cell is read from a
JSON file under bench/results/, every row names its file(s), and under each table a footnote
gives, per file, the command that made it, the date, the GPU and the software. A number can
therefore not drift from its file: the CPU suite (`tests/framework/test_report.py`) fails when the
committed doc is not what this script renders.

Adding a benchmark's figures (no change here):
1. commit its JSON under bench/results/<machine>-<date>-<session>/;
2. in `bench/report_specs.py`, add the file to `RUNS` (the command that made it; the GPU
   and software when the JSON does not say);
3. add a `Table` to `TABLES` (or a `Row` to an existing one): its cells are
   - `Text("...")`: labels, targets (goals, not measurements);
   - `Value("path", "{:.1f} ms")`: one number at a path in the row's file (`Row(file=...)`)
     or in `Value(..., file=...)`. Paths are dotted keys; a list element is picked by index
     (`rows[0]`), by its fields (`decode[variant=decode_triton,tokens=1].us`; nested fields
     as `gate_up[tiles/block_r=128]`; exactly one match), or, in a list of [name, value, ...]
     rows, by the name's start (`top_kernels.ar[^_decode_gate_up][1]`); a dict key that holds a
     dot, quoted in brackets (`shapes["1.3B"].heads`);
   - `Runs([(file, path), ...], fmt)`: a figure measured several times: "median (median of
     N runs; min-max)";
   - `Calc(fn, [Value or Runs...], fmt)`: a number computed from stored values (e.g. a floor
     recomputed with a newer formula, or with `lists=True` the median of per-request
     differences); say so in the table's note;
   - `Verdict(cell, target, "<=")`: "met" only when the cell's median meets the target;
   - `Join([cells], " / ")`: several figures in one cell (one separator, or one per gap);
   a plain string in a row stands for `Text`. A figure with no JSON has no place in a table:
   say in the prose where it comes from (a log, a trace) or leave it out.
4. put `<!-- table:ID -->` / `<!-- /table:ID -->` where it goes in the doc and run
   `python -m bench.report`.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"


class ReportError(ValueError):
    """A spec that cannot be rendered (a missing file, path or command): one line."""


# ---- where a figure comes from -----------------------------------------------------------
@dataclass(frozen=True)
class RunInfo:
    """What made one JSON file: the command (required), and where the JSON does not say
    them, the GPU and the software (torch, triton)."""

    command: str
    gpu: str | None = None
    software: str | None = None


_SEGMENT = re.compile(r"^([^\[\]]+)((?:\[[^\]]*\])*)$")


def _parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


_MISSING = object()


def _field(item: dict, dotted: str):
    for key in dotted.split("/"):
        if not isinstance(item, dict) or key not in item:
            return _MISSING
        item = item[key]
    return item


def _segments(path: str) -> list[str]:
    """`path` split at the dots outside brackets (a selector's value may hold a dot: `[model=1.3B]`)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(path):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "." and depth == 0:
            out.append(path[start:i])
            start = i + 1
    return out + [path[start:]]


def lookup(data, path: str, where: str = ""):
    """The value at `path` in parsed JSON: dotted keys; on dicts `["key"]` (a key that holds a
    dot: `shapes["1.3B"]`); on lists `[i]`, `[field=value,...]` (nested fields as
    `tiles/block_r=128`) or `[^prefix]` (rows whose first item starts so)."""
    node = data
    for segment in _segments(path):
        m = _SEGMENT.match(segment)
        if m is None:
            raise ReportError(f"{where}: bad path segment {segment!r} in {path!r}")
        key, selectors = m.group(1), m.group(2)
        if key != "@":   # "@": the node itself (a list at the top)
            if not isinstance(node, dict) or key not in node:
                raise ReportError(f"{where}: no key {key!r} (path {path!r})")
            node = node[key]
        for selector in re.findall(r"\[([^\]]*)\]", selectors):
            quoted = re.fullmatch(r'"([^"]*)"', selector)
            if quoted:   # a dict key, whatever it holds
                if not isinstance(node, dict) or quoted.group(1) not in node:
                    raise ReportError(f"{where}: no key {quoted.group(1)!r} under {key!r} (path {path!r})")
                node = node[quoted.group(1)]
                continue
            if not isinstance(node, list):
                raise ReportError(f"{where}: {key!r} is not a list (path {path!r})")
            if re.fullmatch(r"-?\d+", selector):
                node = node[int(selector)]
                continue
            if selector.startswith("^"):   # rows [name, value, ...]: the one whose name starts so
                hits = [item for item in node if isinstance(item, list) and item and
                        str(item[0]).startswith(selector[1:])]
            else:
                wanted = dict(part.split("=", 1) for part in selector.split(","))
                hits = [item for item in node if isinstance(item, dict) and
                        all(_field(item, k) == _parse_value(v) for k, v in wanted.items())]
            if len(hits) != 1:
                raise ReportError(f"{where}: [{selector}] matches {len(hits)} elements of {key!r}, not 1 "
                                  f"(path {path!r})")
            node = hits[0]
    return node


class Sources:
    """The JSON files a render reads (parsed once) and the runs that made them."""

    def __init__(self, runs: dict[str, RunInfo], root: Path = RESULTS):
        self.runs, self.root, self._data = runs, root, {}

    def get(self, file: str, path: str):
        if file not in self._data:
            full = self.root / file
            if not full.is_file():
                raise ReportError(f"bench/results/{file}: no such file")
            if file not in self.runs:
                raise ReportError(f"bench/results/{file}: no command recorded for it (add it to RUNS in "
                                  "bench/report_specs.py)")
            self._data[file] = json.loads(full.read_text())
        return lookup(self._data[file], path, f"bench/results/{file}")

    def describe(self, file: str) -> str:
        """`command` (date, GPU, software) of one file."""
        run = self.runs[file]
        data = self._data.get(file, {})
        data = data if isinstance(data, dict) else {}
        date = re.search(r"\d{4}-\d{2}-\d{2}", file)
        gpu = run.gpu or _gpu_of(file, data)
        software = run.software or _software_of(data)
        parts = [p for p in (date.group(0) if date else None, gpu, software) if p]
        return f"`{run.command}` ({'; '.join(parts)})"


def _gpu_of(file: str, data: dict) -> str:
    machine = file.split("/")[0].split("-")[0]
    if machine.startswith("h200x"):
        return f"{machine[5:]} x H200"
    if machine == "h200":
        return "1 x H200"
    return "CPU" if machine in ("cpu", "compile") else machine


def _software_of(data: dict) -> str | None:
    torch_version = data.get("torch")
    if torch_version is None:
        return None
    triton = data.get("triton")
    return f"torch {torch_version}" + (f", triton {triton}" if triton else "")


# ---- cells ------------------------------------------------------------------------------------
def _fmt(value, fmt) -> str:
    if callable(fmt):
        return fmt(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt.format(v) for v in value)
    return fmt.format(value)


class Cell:
    def numbers(self, src: Sources, file: str | None) -> list[float]:
        """The values behind the cell (several for `Runs`)."""
        raise ReportError(f"{type(self).__name__} holds no number")

    def render(self, src: Sources, file: str | None) -> str:
        raise NotImplementedError

    def files(self, file: str | None) -> list[str]:
        return []


@dataclass
class Text(Cell):
    text: str

    def render(self, src, file):
        return self.text


@dataclass
class Value(Cell):
    path: str
    fmt: str | Callable = "{}"
    file: str | None = None
    scale: float = 1.0

    def _file(self, file):
        if (self.file or file) is None:
            raise ReportError(f"Value({self.path!r}): no file (give the row's file or the cell's)")
        return self.file or file

    def raw(self, src, file):
        value = src.get(self._file(file), self.path)
        if self.scale != 1.0:
            value = [v * self.scale for v in value] if isinstance(value, list) else value * self.scale
        return value

    def numbers(self, src, file):
        value = self.raw(src, file)
        return [float(v) for v in value] if isinstance(value, list) else [float(value)]

    def render(self, src, file):
        return _fmt(self.raw(src, file), self.fmt)

    def files(self, file):
        return [self._file(file)]


@dataclass
class Runs(Cell):
    """One figure measured in several runs (files or paths): the median and the range."""

    refs: list[tuple[str, str]]
    fmt: str = "{:.1f}"
    unit: str = ""
    scale: float = 1.0    # applied to every stored number (bytes -> GB: 1e-9)

    def numbers(self, src, file):
        return [float(src.get(f, p)) * self.scale for f, p in self.refs]

    def render(self, src, file):
        values = self.numbers(src, file)
        if len(values) == 1:
            return self.fmt.format(values[0]) + self.unit
        low, high = self.fmt.format(min(values)), self.fmt.format(max(values))
        spread = f"{low}-{high}" if low != high else "the same in each"
        return f"{self.fmt.format(statistics.median(values))}{self.unit} (median of {len(values)} runs; {spread})"

    def files(self, file):
        return [f for f, _ in self.refs]


@dataclass
class Calc(Cell):
    """fn(*the inputs' numbers) -> a number; inputs are Values (their first number) or Runs
    (their median)."""

    fn: Callable
    inputs: list[Cell]
    fmt: str = "{:.1f}"
    lists: bool = False   # pass each input's numbers as a list (per-request values), not their median

    def numbers(self, src, file):
        args = [c.numbers(src, file) if self.lists else statistics.median(c.numbers(src, file))
                for c in self.inputs]
        return [float(self.fn(*args))]

    def render(self, src, file):
        return self.fmt.format(self.numbers(src, file)[0])

    def files(self, file):
        return [f for c in self.inputs for f in c.files(file)]


@dataclass
class Verdict(Cell):
    """"met" when the median of `cell`'s numbers meets the target, else "missed"."""

    cell: Cell
    target: float
    op: str = "<="

    def render(self, src, file):
        value = statistics.median(self.cell.numbers(src, file))
        ok = {"<=": value <= self.target, ">=": value >= self.target}[self.op]
        return "met" if ok else "**missed**"

    def files(self, file):
        return self.cell.files(file)


@dataclass
class Join(Cell):
    """Several cells in one: `sep` between them (one string, or one per gap)."""

    cells: list[Cell]
    sep: str | list[str] = " / "
    prefix: str = ""
    suffix: str = ""

    def render(self, src, file):
        parts = [_cell(c).render(src, file) for c in self.cells]
        seps = self.sep if isinstance(self.sep, list) else [self.sep] * (len(parts) - 1)
        if len(seps) != len(parts) - 1:
            raise ReportError(f"Join: {len(seps)} separators for {len(parts)} cells")
        out = parts[0] + "".join(s + p for s, p in zip(seps, parts[1:])) if parts else ""
        return self.prefix + out + self.suffix

    def files(self, file):
        return [f for c in self.cells for f in _cell(c).files(file)]


# ---- tables ------------------------------------------------------------------------------------
@dataclass
class Row:
    cells: list[Cell | str]
    file: str | None = None   # the default file of the row's Values


@dataclass
class Table:
    id: str
    columns: list[str]
    rows: list[Row]
    note: str = ""            # one paragraph under the table, before the sources
    source_column: bool = True


def _cell(c) -> Cell:
    return Text(c) if isinstance(c, str) else c


def render_table(table: Table, src: Sources) -> str:
    lines = ["<!-- generated by `python -m bench.report` from bench/report_specs.py: edit there, not here -->"]
    header = table.columns + (["source (bench/results/)"] if table.source_column else [])
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    used: list[str] = []
    for i, row in enumerate(table.rows):
        cells = [_cell(c) for c in row.cells]
        if len(cells) != len(table.columns):
            raise ReportError(f"table {table.id!r} row {i}: {len(cells)} cells for {len(table.columns)} columns")
        try:
            text = [c.render(src, row.file) for c in cells]
        except ReportError as e:
            raise ReportError(f"table {table.id!r} row {i}: {e}") from None
        files = list(dict.fromkeys(f for c in cells for f in c.files(row.file)))
        used += [f for f in files if f not in used]
        if table.source_column:
            text.append(", ".join(f"`{f}`" for f in files) or "-")
        lines.append("| " + " | ".join(t.replace("|", "\\|") for t in text) + " |")
    lines.append("")
    if table.note:
        lines += [table.note, ""]
    if used:
        lines.append("Made by: " + "; ".join(f"`{f}`: {src.describe(f)}" for f in used) + ".")
    return "\n".join(lines)


BLOCK = re.compile(r"(<!-- table:([A-Za-z0-9_.-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)


def render_doc(text: str, tables: list[Table], src: Sources) -> str:
    """The doc with every marked table rendered; ReportError for a marker with no spec or a
    spec with no marker."""
    specs = {t.id: t for t in tables}
    if len(specs) != len(tables):
        raise ReportError("table ids repeat in bench/report_specs.py")
    seen = []

    def replace(m):
        if m.group(2) not in specs:
            raise ReportError(f"docs/performance.md marks table {m.group(2)!r}, which bench/report_specs.py "
                              "does not define")
        seen.append(m.group(2))
        return m.group(1) + render_table(specs[m.group(2)], src) + "\n" + m.group(4)

    out = BLOCK.sub(replace, text)
    opened = re.findall(r"<!-- table:([A-Za-z0-9_.-]+) -->", text)
    if len(opened) != len(seen):
        raise ReportError(f"docs/performance.md: table markers without their closing marker: "
                          f"{sorted(set(opened) - set(seen))}")
    missing = [t for t in specs if t not in seen]
    if missing:
        raise ReportError(f"bench/report_specs.py defines tables that docs/performance.md does not mark: {missing}")
    return out


def check(doc: Path = DOC) -> str | None:
    """None when the doc is what the specs render, else a one-line summary of the difference."""
    from bench.report_specs import RUNS, TABLES
    text = doc.read_text()
    rendered = render_doc(text, TABLES, Sources(RUNS))
    if rendered == text:
        return None
    old = {m.group(2): m.group(3) for m in BLOCK.finditer(text)}
    new = {m.group(2): m.group(3) for m in BLOCK.finditer(rendered)}
    changed = [k for k in new if old.get(k) != new[k]]
    lines = sum(1 for a, b in zip(text.splitlines(), rendered.splitlines()) if a != b)
    lines += abs(len(text.splitlines()) - len(rendered.splitlines()))
    name = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    return (f"{name} differs from `python -m bench.report` in {len(changed)} table(s) "
            f"({', '.join(changed[:6])}{', ...' if len(changed) > 6 else ''}; {lines} lines): "
            "run `python -m bench.report` and commit the doc")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 with a one-line summary if it differs")
    p.add_argument("--doc", type=Path, default=DOC)
    args = p.parse_args(argv)
    try:
        if args.check:
            problem = check(args.doc)
            if problem:
                print(problem, file=sys.stderr)
                return 1
            print(f"{args.doc}: every table is what bench/results/ holds")
            return 0
        from bench.report_specs import RUNS, TABLES
        text = args.doc.read_text()
        rendered = render_doc(text, TABLES, Sources(RUNS))
        args.doc.write_text(rendered)
        print(f"wrote {args.doc} ({len(TABLES)} tables)")
        return 0
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
