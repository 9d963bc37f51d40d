"""The table of a folder of the CLI's reports on several GPUs (markdown, for docs/performance.md).

    python -m bench.gpu2_table outputs/bench [--json bench/results/....json]   # after bash bench/run_gpu.sh e2e

One row per example report (`*.json` written with --report): AR decode ms/token, DiT ms
per step (the mean over all steps, and the first, whole-sequence step), the share of
each phase's wall time that only NCCL kernels ran (and of it, waiting for the other
rank) from the profiled run, the phase switch, peak memory per rank, cold compile.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _share(regions: list[dict], names: tuple[str, ...]) -> str:
    rows = [r for r in regions if r["region"] in names]
    wall = sum(r["wall_ms"] for r in rows)
    if not wall:
        return "-"
    comm = sum(r["communication_ms"] for r in rows) / wall
    waiting = [r.get("waiting_ms") for r in rows]
    text = f"{100 * comm:.1f}%"
    if all(w is not None for w in waiting):
        text += f" ({100 * sum(waiting) / wall:.1f}% waiting)"
    return text


def row(name: str, r: dict) -> dict:
    t, c, s = r["timings_ms"], r.get("compile") or {}, r["phase_switch"]
    regions = (r.get("profile") or {}).get("regions", {})
    return {
        "run": name, "plan": r["plan"], "checkpoint": r["checkpoint"],
        "ar_decode_ms_per_token": round(t["ar_decode_per_token"], 3),
        "dit_ms_per_step": round(t["denoise_step"], 2), "dit_first_step_ms": round(t["denoise_first_step"], 2),
        "ar_prefill_ms": round(t["ar_prefill"], 2), "vae_decode_ms": round(t["vae_decode"], 1),
        "nccl_share_ar_decode": _share(regions.get("ar", []), ("ar_decode",)),
        "nccl_share_denoise": _share(regions.get("denoise", []), ("denoise_step", "denoise_first_step")),
        "phase_switch_ms": round(s["ms"], 3), "phase_switch_agree_ms": round(s.get("agree_ms", 0.0), 3),
        "phase_switch_allocated_bytes": s["allocated_bytes_delta"],
        "weights_copied": s["weights_copied"],
        "weights_gb_per_rank": [round(b / 1e9, 1) for b in r["storage_bytes_per_rank"]],
        "peak_gb_per_rank": [round(b / 1e9, 1) for b in r["peak_memory_bytes_per_rank"] if b is not None],
        "gc_max_pause_ms": max((g["max_ms"] for g in r.get("gc_pauses_per_rank") or []), default=None),
        "cold_compile_s": c.get("compile_s"), "graphs": c.get("graphs"),
        "recompiles_after_warmup": c.get("recompiles_after_warmup"),
        "decode_cuda_graph": c.get("decode_cuda_graph"), "warmup_s": round((r.get("warmup_ms") or 0) / 1e3, 1),
    }


COLUMNS = [("run", "run"), ("ar_decode_ms_per_token", "AR ms/token"), ("dit_ms_per_step", "DiT ms/step"),
           ("dit_first_step_ms", "first step ms"), ("nccl_share_ar_decode", "NCCL share, AR decode"),
           ("nccl_share_denoise", "NCCL share, denoise"), ("phase_switch_ms", "switch ms"),
           ("phase_switch_agree_ms", "of it, agreement ms"),
           ("phase_switch_allocated_bytes", "switch bytes"), ("weights_gb_per_rank", "weights GB/rank"),
           ("peak_gb_per_rank", "peak GB/rank"),
           ("gc_max_pause_ms", "longest GC pause ms"), ("cold_compile_s", "cold compile s")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu2_table")
    p.add_argument("folder")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    rows = []
    for path in sorted(Path(args.folder).glob("*.json")):
        report = json.loads(path.read_text())
        if "timings_ms" in report and "phase_switch" in report:
            rows.append(row(path.stem, report))
    print("| " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        print("| " + " | ".join(", ".join(map(str, v)) if isinstance(v := r[k], list) else str(v)
                                for k, _ in COLUMNS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
