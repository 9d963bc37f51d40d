"""Per-phase profiling: where each step's device time goes, a trace per phase, a chart.

    profiler = PhaseProfiler("outputs/profile", rank=0, group=control_group)
    with profiler.phase("ar"):
        with profiler.region("ar_decode", units=len(tokens)):   # a synchronised stretch of steps
            ...
    summary = profiler.write(timings_ms, compile_report)

The pipeline marks regions that begin and end on a device synchronisation (the prefill,
the decode loop, each denoise step), so every kernel a region launched also ran inside
it. For each region, from the device kernels alone (no host-side rows such as
`record_param_comms`, whose time is the kernels' own):

- compute: time some non-communication kernel was running;
- communication: time only NCCL kernels were running (communication hidden under compute
  counts as compute);
- of which waiting: the part of each NCCL kernel spent waiting for a slower rank. A
  collective ends at the same moment on every rank, so the rank that arrived last waited
  least: for the i-th NCCL kernel of a region, waiting = its duration here minus the
  shortest duration of the same kernel on any rank (ranks compare their lists at
  `write()` over `group`; without it, or if the lists differ, waiting is not split out);
- idle: the rest of the region's wall time (host work, launch gaps, synchronisation).

Every figure is given per unit (token or step) as well as in total. Traces are Chrome
JSON (https://ui.perfetto.dev). On a CPU-only run there are no device kernels: the table
then ranks CPU operators by self time, labelled as such.
"""
from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

# (timing key, label, unit) for the text table: each pipeline supplies its own.
TableRows = tuple[tuple[str, str, str], ...]

REGION_PREFIX = "dtgen.region:"


class NullProfiler:
    """Stands in when profiling is off."""

    def phase(self, name: str, together: bool = True):
        return nullcontext()

    def region(self, name: str, units: int = 1):
        return nullcontext()


def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class RegionStats:
    """One region's device time, split (microseconds); `nccl` lists its NCCL kernel durations."""

    name: str
    units: int
    wall_us: float
    compute_us: float = 0.0
    comm_us: float = 0.0
    wait_us: float | None = None
    nccl: list[float] = field(default_factory=list)

    @property
    def idle_us(self) -> float:
        return max(self.wall_us - self.compute_us - self.comm_us, 0.0)

    def as_dict(self) -> dict:
        per = max(self.units, 1)
        d = {"units": self.units, "wall_ms": self.wall_us / 1e3, "compute_ms": self.compute_us / 1e3,
             "communication_ms": self.comm_us / 1e3, "idle_ms": self.idle_us / 1e3,
             "nccl_kernels": len(self.nccl)}
        if self.wait_us is not None:
            d["waiting_ms"] = self.wait_us / 1e3
        d["per_unit_ms"] = {k: round(v / per, 4) for k, v in d.items() if k.endswith("_ms")}
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def region_stats(events, regions: list[tuple[str, int]]) -> list[RegionStats]:
    """Split the device kernels of a profile among the marked regions (see the module docstring)."""
    device_kind = torch.autograd.DeviceType.CUDA
    ranges = sorted(((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type != device_kind and e.name.startswith(REGION_PREFIX)))
    kernels = [e for e in events if e.device_type == device_kind and not getattr(e, "is_user_annotation", False)
               and not e.name.startswith(REGION_PREFIX)]
    out = []
    for (name, units), (start, end) in zip(regions, ranges):
        mine = [(k.time_range.start, k.time_range.end, k.name) for k in kernels if start <= k.time_range.start < end]
        compute = [(a, b) for a, b, n in mine if not is_comm_kernel(n)]
        comm = sorted((a, b) for a, b, n in mine if is_comm_kernel(n))
        busy = _union_us(compute)
        stats = RegionStats(name, units, end - start, compute_us=busy,
                            comm_us=_union_us(compute + comm) - busy, nccl=[b - a for a, b in comm])
        out.append(stats)
    return out


def split_waiting(per_rank: list[list[RegionStats]]) -> None:
    """Fill `wait_us` of every rank's regions from all ranks' NCCL kernel durations."""
    for regions in zip(*per_rank):
        lists = [r.nccl for r in regions]
        if len({len(x) for x in lists}) != 1:
            continue  # the ranks' kernel lists differ: no reliable matching
        shortest = [min(ds) for ds in zip(*lists)]
        for r in regions:
            waited = sum(d - s for d, s in zip(r.nccl, shortest))
            r.wait_us = min(waited, r.comm_us)  # only the exposed part can have been waiting


def top_device_kernels(events, top: int) -> list[tuple[str, float, int]]:
    """(kernel name, total ms, launches), device kernels only; CPU ops by self time on a CPU run."""
    device_kind = torch.autograd.DeviceType.CUDA
    totals: dict[str, list[float]] = {}
    kernels = [e for e in events if e.device_type == device_kind and not getattr(e, "is_user_annotation", False)
               and not e.name.startswith(REGION_PREFIX)]
    if kernels:
        for k in kernels:
            acc = totals.setdefault(k.name, [0.0, 0])
            acc[0] += (k.time_range.end - k.time_range.start) / 1e3
            acc[1] += 1
    else:
        for e in events:
            if e.name.startswith(REGION_PREFIX):
                continue
            acc = totals.setdefault(e.name, [0.0, 0])
            acc[0] += e.self_cpu_time_total / 1e3
            acc[1] += 1
    rows = [(name, round(ms, 4), n) for name, (ms, n) in totals.items() if ms > 0]
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


class PhaseProfiler:
    def __init__(self, out_dir: str | Path, rank: int = 0, top: int = 12, group: dist.ProcessGroup | None = None,
                 table_rows: TableRows | None = None):
        """`group`: a (gloo) group over all ranks, to compare NCCL kernel durations at `write()`.
        `table_rows`: the caller's timing keys for the text table (key, label, unit); default:
        every number in the timings, in their order, in ms."""
        self.table_rows = table_rows
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.top = top
        self.group = group
        self.kernels: dict[str, list[tuple[str, float, int]]] = {}
        self.kernel_source = "device kernels" if torch.cuda.is_available() else "CPU operators (self time)"
        self.traces: dict[str, str] = {}
        self.regions: dict[str, list[RegionStats]] = {}
        self._pending: list[tuple[str, int]] = []

    @contextmanager
    def phase(self, name: str, together: bool = True):
        """`together`: every rank of `group` runs this phase (False: some ranks skip it)."""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._pending = []
        if together and self.group is not None and dist.get_world_size(self.group) > 1:
            # Writing the last phase's trace takes each rank a different time (seconds at full
            # depth); start together, or the next phase's first collective counts that as
            # waiting for the other rank.
            dist.barrier(group=self.group)
        with profile(activities=activities, record_shapes=False) as prof:
            yield
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"trace_{name}_rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        self.traces[name] = str(path)
        events = prof.events()
        self.kernels[name] = top_device_kernels(events, self.top)
        self.regions[name] = region_stats(events, self._pending)

    @contextmanager
    def region(self, name: str, units: int = 1):
        """A stretch that begins and ends on a device sync; `units`: its tokens or steps."""
        entry = [name, units]
        self._pending.append(entry)
        with record_function(REGION_PREFIX + name):
            yield entry  # the caller may set entry[1] once it knows the count

    def summary_rows(self) -> dict[str, list[dict]]:
        """Per phase: one row per region kind (units summed), each split per unit."""
        out = {}
        for phase, regions in self.regions.items():
            merged: dict[str, RegionStats] = {}
            for r in regions:
                m = merged.setdefault(r.name, RegionStats(r.name, 0, 0.0, wait_us=0.0 if r.wait_us is not None else None))
                m.units += r.units
                m.wall_us += r.wall_us
                m.compute_us += r.compute_us
                m.comm_us += r.comm_us
                m.nccl += r.nccl
                if m.wait_us is not None:
                    m.wait_us = m.wait_us + r.wait_us if r.wait_us is not None else None
            out[phase] = [{"region": name, **m.as_dict()} for name, m in merged.items()]
        return out

    def write(self, timings_ms: dict[str, float], compile_report: dict | None = None) -> dict:
        """Table (text), summary JSON and chart PNG into out_dir; returns the summary.

        With a `group`, every rank must call this (the NCCL kernel lists are exchanged)."""
        if self.group is not None and dist.get_world_size(self.group) > 1:
            mine = {p: [r.nccl for r in rs] for p, rs in self.regions.items()}
            everyone: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, mine, group=self.group)
            for phase, regions in self.regions.items():
                others = [[RegionStats("", 0, 0.0, nccl=n) for n in e.get(phase, [])] for e in everyone]
                if all(len(o) == len(regions) for o in others):
                    split_waiting([regions if i == self.rank else o for i, o in enumerate(others)])
        self.out_dir.mkdir(parents=True, exist_ok=True)
        summary = {"timings_ms": timings_ms, "traces": self.traces, "regions": self.summary_rows(),
                   "top_kernels": {p: [list(k) for k in ks] for p, ks in self.kernels.items()},
                   "kernel_source": self.kernel_source, "compile": compile_report}
        (self.out_dir / f"profile_rank{self.rank}.json").write_text(json.dumps(summary, indent=2))
        (self.out_dir / f"profile_rank{self.rank}.txt").write_text(
            format_table(timings_ms, compile_report, summary, self.table_rows))
        write_chart(self.out_dir / f"profile_rank{self.rank}.png", summary)
        return summary


def format_table(timings_ms: dict[str, float], compile_report: dict | None = None, summary: dict | None = None,
                 rows: TableRows | None = None) -> str:
    if rows is None:
        rows = tuple((k, k, "ms") for k, v in timings_ms.items() if isinstance(v, (int, float)))
    width = max([14] + [len(label) for _, label, _ in rows])
    lines = [f"{'stage':<{width}} {'time':>12}"]
    for key, label, unit in rows:
        if key in timings_ms:
            lines.append(f"{label:<{width}} {timings_ms[key]:>10.2f} {unit}")
    if compile_report:
        lines.append(f"compile: {compile_report.get('graphs')} graphs, {compile_report.get('graph_breaks')} breaks, "
                     f"{compile_report.get('recompiles_after_warmup')} recompiles after warm-up")
        for reason, n in (compile_report.get("break_reasons") or {}).items():
            lines.append(f"  break x{n}: {reason}")
    if summary:
        lines.append("")
        lines.append(f"{'region':<22}{'units':>6}  per unit (ms): {'wall':>8}{'compute':>9}{'comm':>8}"
                     f"{'(waiting)':>10}{'idle':>8}")
        for phase, rows in summary["regions"].items():
            for r in rows:
                u = r["per_unit_ms"]
                wait = f"{u['waiting_ms']:>10.3f}" if "waiting_ms" in u else f"{'-':>10}"
                lines.append(f"{phase + '/' + r['region']:<22}{r['units']:>6}  {'':>15}{u['wall_ms']:>8.3f}"
                             f"{u['compute_ms']:>9.3f}{u['communication_ms']:>8.3f}{wait}{u['idle_ms']:>8.3f}")
        for phase, ks in summary["top_kernels"].items():
            lines.append(f"\n{phase}: top {summary['kernel_source']} (ms total, count)")
            lines += [f"  {ms:>10.3f} {n:>6}  {name[:100]}" for name, ms, n in ks]
    return "\n".join(lines) + "\n"


_COLOURS = {"compute_ms": (70, 120, 190), "communication_ms": (220, 140, 40), "waiting_ms": (200, 60, 60),
            "idle_ms": (190, 190, 190)}


def write_chart(path: Path, summary: dict) -> None:
    """Per phase, on its own scale: each region's time per unit as a stacked bar (compute,
    communication, waiting, idle), then the phase's top kernels. Pillow only."""
    from PIL import Image, ImageDraw

    row_h, width, label_w = 18, 980, 300
    sections = []
    for phase, rows in summary["regions"].items():
        sections.append((f"{phase}: per unit (ms): compute | communication | waiting | idle", "stack",
                         [(f"{r['region']} (x{r['units']})", r["per_unit_ms"]) for r in rows]))
        kernels = summary["top_kernels"].get(phase, [])
        sections.append((f"{phase}: top {summary['kernel_source']} (ms, whole phase)", "bar",
                         [(name[:44], ms) for name, ms, _ in kernels[:8]]))
    height = sum(30 + row_h * max(len(rows), 1) for _, _, rows in sections) + 10
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    y = 6
    span = width - label_w - 110
    for title, kind, rows in sections:
        draw.text((6, y), title, fill="black")
        y += 22
        if kind == "stack":
            peak = max((u["wall_ms"] for _, u in rows), default=1.0) or 1.0
            for label, u in rows:
                draw.text((6, y + 3), label, fill="black")
                x = label_w
                comm = u.get("communication_ms", 0.0)
                wait = min(u.get("waiting_ms", 0.0), comm)
                for key, value in (("compute_ms", u["compute_ms"]), ("communication_ms", comm - wait),
                                   ("waiting_ms", wait), ("idle_ms", u["idle_ms"])):
                    w = int(span * value / peak)
                    if w > 0:
                        draw.rectangle([x, y + 3, x + w, y + row_h - 2], fill=_COLOURS[key])
                        x += w
                draw.text((x + 6, y + 3), f"{u['wall_ms']:.2f}", fill="black")
                y += row_h
        else:
            peak = max((v for _, v in rows), default=1.0) or 1.0
            for label, value in rows:
                bar = int(span * value / peak)
                draw.text((6, y + 3), label, fill="black")
                draw.rectangle([label_w, y + 3, label_w + max(bar, 1), y + row_h - 2], fill=(70, 120, 190))
                draw.text((label_w + bar + 6, y + 3), f"{value:.2f}", fill="black")
                y += row_h
        y += 8
    img.save(path)
