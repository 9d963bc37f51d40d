"""The cells more than one suite's tables build (bench/specs/<suite>.py)."""
from __future__ import annotations

from bench.report_cells import Join, Value, Verdict


def ms(path, file=None, fmt="{:.1f} ms"):
    return Value(path, fmt, file)


def gb(path, file=None):
    return Value(path, "{:.1f} GB", file, scale=1e-9)


def rank0_gb(path, file=None):
    return Value(f"{path}[0]", "{:.1f} GB", file, scale=1e-9)


def goal(label: str, cell, target: float, op: str = "<="):
    """"<label>: met" / "<label>: **missed**", the verdict computed from `cell`'s median."""
    return Join([Verdict(cell, target, op)], prefix=f"{label}: ")


def timed(path: str, fmt: str = "{:.1f}", unit: str = " us", file: str | None = None) -> Join:
    """A stored timing summary ({median, min, max, n}): "median unit (median of n; min-max)"."""
    return Join([Value(f"{path}.median", fmt + unit, file), Value(f"{path}.n", "{}", file),
                 Value(f"{path}.min", fmt, file), Value(f"{path}.max", fmt, file)],
                [" (median of ", "; ", "-"], suffix=")")


def peer(model, mode, who, variant, key):
    return f"rows[model={model},mode={mode},who={who},variant={variant}].{key}"


def fp8_run(shape, run, key):
    return f'shapes["{shape}"].runs["{run}"].{key}'


def lever(run, config, key):
    return f"rows[run={run},config={config}].{key}"
PEAK_TARGET = 92.0   # GB, T2I and TI2I: what a 96 GB card holds


def cell_with_verdict(value: Value, target: float, op: str = "<=", lead: str = ""):
    return Join([value, Verdict(value, target, op)], ": ", prefix=lead)
# the FP8 attention kernel's default tiles (`default-tiles/` runs them as `fp8-kernel`; `sweep/` ran them in its sweep)
ATTENTION_DEFAULT_RUN = "sweep-m64-n128-w4-s3-tma"
