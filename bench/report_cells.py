"""The cells, rows, tables and sections of docs/performance.md's specs (bench/specs/), and what
made a file.

A cell renders itself from `src` (bench.report.Sources: `src.get(file, path)` is the value at
`path` in a JSON under bench/results/); bench/report.py has the kinds of path and how the page
is rendered.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # only for the annotations: bench.report imports this module
    from bench.report import Sources


class ReportError(ValueError):
    """A spec that cannot be rendered (a missing file, path or command): one line."""


# ---- where a figure comes from -----------------------------------------------------------
@dataclass(frozen=True)
class RunInfo:
    """What made one JSON file: the command that reproduces it (`python -m bench SUITE PART ...`),
    and where the JSON does not say them, the GPU and the software (torch, triton)."""

    command: str
    gpu: str | None = None
    software: str | None = None


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
    """One figure measured in several runs (files or paths; a path to a list gives one run an
    element): "median (median of N runs; min-max)", or "value (1 run)"."""

    refs: list[tuple[str, str]]
    fmt: str = "{:.1f}"
    unit: str = ""
    scale: float = 1.0    # applied to every stored number (bytes -> GB: 1e-9)
    what: str = "runs"    # what one number is: "runs", "requests", "calls"

    def numbers(self, src, file):
        out = []
        for f, p in self.refs:
            value = src.get(f, p)
            out += [float(v) * self.scale for v in (value if isinstance(value, list) else [value])]
        return out

    def render(self, src, file):
        values = self.numbers(src, file)
        if len(values) == 1:
            return f"{self.fmt.format(values[0])}{self.unit} (1 {self.what.rstrip('s')})"
        low, high = self.fmt.format(min(values)), self.fmt.format(max(values))
        spread = f"{low}-{high}" if low != high else "the same in each"
        median = self.fmt.format(statistics.median(values))
        return f"{median}{self.unit} (median of {len(values)} {self.what}; {spread})"

    def files(self, file):
        return [f for f, _ in self.refs]


@dataclass
class Calc(Cell):
    """fn(*each input's median) -> a number (a ratio, a floor from a stored count)."""

    fn: Callable
    inputs: list[Cell]
    fmt: str = "{:.1f}"

    def numbers(self, src, file):
        return [float(self.fn(*(statistics.median(c.numbers(src, file)) for c in self.inputs)))]

    def render(self, src, file):
        return self.fmt.format(self.numbers(src, file)[0])

    def files(self, file):
        return [f for c in self.inputs for f in c.files(file)]


@dataclass
class Verdict(Cell):
    """"<label>: met" when the median of `cell`'s numbers meets the target, else "<label>: **missed**"."""

    cell: Cell
    target: float
    op: str = "<="
    label: str = ""

    def render(self, src, file):
        value = statistics.median(self.cell.numbers(src, file))
        ok = {"<=": value <= self.target, ">=": value >= self.target}[self.op]
        return (f"{self.label}: " if self.label else "") + ("met" if ok else "**missed**")

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
        parts = [cell_of(c).render(src, file) for c in self.cells]
        seps = self.sep if isinstance(self.sep, list) else [self.sep] * (len(parts) - 1)
        if len(seps) != len(parts) - 1:
            raise ReportError(f"Join: {len(seps)} separators for {len(parts)} cells")
        out = parts[0] + "".join(s + p for s, p in zip(seps, parts[1:])) if parts else ""
        return self.prefix + out + self.suffix

    def files(self, file):
        return [f for c in self.cells for f in cell_of(c).files(file)]


# ---- tables and the page ------------------------------------------------------------------
@dataclass
class Row:
    cells: list[Cell | str]
    file: str | None = None   # the default file of the row's Values


@dataclass
class Table:
    id: str
    title: str                # its heading on the page
    columns: list[str]
    rows: list[Row]
    note: str = ""            # one paragraph under the table, before its sources


@dataclass
class Section:
    """One model on one kind of machine: a heading and its tables."""

    title: str
    tables: list[Table]


def cell_of(c) -> Cell:
    return Text(c) if isinstance(c, str) else c
