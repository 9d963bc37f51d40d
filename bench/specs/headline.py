"""README.md's headline table: per model, one H200 and where measured more; the peer on the same GPU; the floor."""
from __future__ import annotations

from bench.report_cells import Join, Row, Runs, Table, Value
from bench.specs.hunyuan import requests, summary
from bench.specs.qwen import regions
from bench.specs.runs import DECODE, DISTIL, QWEN_FP8, STEP_CACHE, T2I, TP2_32, WAN_STEP
from bench.specs.wan import forward_floor, both

HEADLINE = Table("headline", "", ["model", "GPUs", "figure", "dtgen", "peer, same GPU", "floor"], [
    Row(["HunyuanImage-3.0", "1 x H200", "T2I 1024x1024, 10 steps, FP8",
         requests([T2I], "timings_ms.total", "{:.0f}"), "-", "-"]),
    Row(["HunyuanImage-3.0", "1 x H200", "T2I 1024x1024, 50 steps, Taylor cache, FP8 experts",
         summary(STEP_CACHE, "t2i_taylor", "total_ms"), "-", "-"]),
    Row(["HunyuanImage-3.0", "1 x H200", "T2I 1024x1024, Instruct-Distil, 8 steps, FP8 experts",
         summary(DISTIL, "distil", "total_ms"), "-", "-"]),
    Row(["HunyuanImage-3.0", "1 x H200", "AR decode a token, FP8",
         Runs([(DECODE, "impls.triton.step_ms.runs")], "{:.2f}", " ms", what="repeats"), "-",
         Value("impls.triton.floor_ms", "{:.2f} ms (bytes)", DECODE)]),
    Row(["HunyuanImage-3.0", "2 x H200", "T2I 1024x1024, 10 steps, bf16, `tp2`",
         Runs([(TP2_32, "timings_ms.total")], "{:.0f}", " ms"), "-", "-"]),
    Row(["Wan2.1 1.3B", "1 x H200", "DiT forward, 81 x 480x832, bf16", both("1.3B", "dtgen", "bf16", "ms"),
         Join([both("1.3B", "diffusers", "bf16", "ms")], prefix="diffusers "), forward_floor(WAN_STEP)]),
    Row(["Qwen-Image", "1 x H200", "MMDiT forward, 1024x1024, bf16", regions("dtgen.ms"),
         Join([regions("diffusers.ms")], prefix="diffusers "), Value("floor_ms", "{:.1f} ms (FLOPs)", QWEN_FP8)]),
])

__all__ = ["HEADLINE"]
