"""Per-phase profiling: a timing table, a Chrome trace per phase, top kernels, a PNG chart.

    profiler = PhaseProfiler("outputs/profile", rank=0)
    with profiler.phase("ar"):
        ...                      # any code; one torch.profiler trace per phase
    profiler.write(timings_ms, compile_report)

Traces are Chrome-trace JSON (open them in https://ui.perfetto.dev). Kernels are ranked by
device time on GPU and by self CPU time on CPU.
"""
from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

TABLE_ROWS = (("ar_prefill", "AR prefill", "ms"), ("ar_decode_per_token", "AR decode", "ms/token"),
              ("phase_switch", "phase switch", "ms"), ("denoise_step", "denoise", "ms/step"),
              ("vae_decode", "VAE decode", "ms"), ("total", "total", "ms"))


class NullProfiler:
    """Stands in when profiling is off."""

    def phase(self, name: str):
        return nullcontext()


class PhaseProfiler:
    def __init__(self, out_dir: str | Path, rank: int = 0, top: int = 12):
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.top = top
        self.kernels: dict[str, list[tuple[str, float]]] = {}
        self.traces: dict[str, str] = {}

    @contextmanager
    def phase(self, name: str):
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities, record_shapes=False) as prof:
            yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"trace_{name}_rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        self.traces[name] = str(path)
        self.kernels[name] = _top_kernels(prof, self.top)

    def write(self, timings_ms: dict[str, float], compile_report: dict | None = None) -> dict:
        """Table (text), summary JSON and chart PNG into out_dir; returns the summary."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        summary = {"timings_ms": timings_ms, "traces": self.traces, "top_kernels": self.kernels,
                   "compile": compile_report}
        (self.out_dir / f"profile_rank{self.rank}.json").write_text(json.dumps(summary, indent=2))
        (self.out_dir / f"profile_rank{self.rank}.txt").write_text(format_table(timings_ms, compile_report))
        write_chart(self.out_dir / f"profile_rank{self.rank}.png", timings_ms, self.kernels)
        return summary


def _top_kernels(prof, top: int) -> list[tuple[str, float]]:
    use_device = torch.cuda.is_available()
    rows = []
    for evt in prof.key_averages():
        if use_device:
            ms = getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0)) / 1e3
        else:
            ms = evt.self_cpu_time_total / 1e3
        if ms > 0:
            rows.append((evt.key, round(ms, 4)))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def format_table(timings_ms: dict[str, float], compile_report: dict | None = None) -> str:
    lines = [f"{'stage':<14} {'time':>12}"]
    for key, label, unit in TABLE_ROWS:
        if key in timings_ms:
            lines.append(f"{label:<14} {timings_ms[key]:>10.2f} {unit}")
    if compile_report:
        lines.append(f"compile: {compile_report.get('graphs')} graphs, {compile_report.get('graph_breaks')} breaks, "
                     f"{compile_report.get('recompiles_after_warmup')} recompiles after warm-up")
        for reason, n in (compile_report.get("break_reasons") or {}).items():
            lines.append(f"  break x{n}: {reason}")
    return "\n".join(lines) + "\n"


def write_chart(path: Path, timings_ms: dict[str, float], kernels: dict[str, list[tuple[str, float]]]) -> None:
    """Horizontal bars: per-stage times, then each phase's top kernels (Pillow only)."""
    from PIL import Image, ImageDraw

    sections = [("per-stage time (ms)", [(label, timings_ms[k]) for k, label, _ in TABLE_ROWS if k in timings_ms])]
    for phase, rows in kernels.items():
        sections.append((f"{phase}: top kernels (ms)", [(name[:48], ms) for name, ms in rows[:8]]))
    row_h, width, label_w = 18, 900, 380
    height = sum(28 + row_h * max(len(rows), 1) for _, rows in sections) + 10
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    y = 6
    for title, rows in sections:
        draw.text((6, y), title, fill="black")
        y += 22
        peak = max((v for _, v in rows), default=1.0) or 1.0
        for label, value in rows:
            bar = int((width - label_w - 90) * value / peak)
            draw.text((6, y + 3), label, fill="black")
            draw.rectangle([label_w, y + 3, label_w + max(bar, 1), y + row_h - 2], fill=(70, 120, 190))
            draw.text((label_w + bar + 6, y + 3), f"{value:.2f}", fill="black")
            y += row_h
        y += 6
    img.save(path)
