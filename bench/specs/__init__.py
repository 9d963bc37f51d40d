"""docs/performance.md and README.md's headline table, as data (rendered by `python -m bench.report`).

`PAGE`: per model and machine, a section of tables (hunyuan.py, wan.py, qwen.py, hopper.py), each row the latest
measurement of one figure; `NOT_MEASURED`: what the page has no figure for; `HEADLINE`: README.md's
table (headline.py); `RUNS`: every JSON they read and the command that reproduces it (runs.py). See
bench/report.py for the cell kinds.
"""
from bench.specs import hopper, hunyuan, qwen, wan
from bench.specs.headline import HEADLINE
from bench.specs.runs import RUNS

PAGE = [*hunyuan.SECTIONS, *wan.SECTIONS, *qwen.SECTIONS, *hopper.SECTIONS]
TABLES = [table for section in PAGE for table in section.tables] + [HEADLINE]

NOT_MEASURED = [
    "4 x H200 (any model): no run; HunyuanImage-3.0's 2 x H200 figures predate FP8 experts.",
    "Trained weights: every figure runs random weights at the released shapes (timings do not depend on "
    "the values; the golden tests check the outputs).",
    "vLLM-Omni: not run here, and bench/results/ records no published figure of it.",
    "A peer for HunyuanImage-3.0: diffusers has no pipeline of it to run side by side.",
    "Wan end to end (text encoder, the whole 40-block 14B, the video VAE) and Qwen-Image end to end (text "
    "encoder, VAE): only their DiTs are timed.",
    "The server under load on a GPU: only the tiny model on a CPU.",
    "Wan and Qwen-Image on more than one GPU.",
    "LoRA on a GPU: an unmerged rank-64 adapter's cost on the DiT step of Wan at 14B width and of HunyuanImage-3.0 "
    "with FP8 weights, and loading a rank-64 14B adapter (`python -m bench run-all lora`: its steps are not run yet).",
]

__all__ = ["HEADLINE", "NOT_MEASURED", "PAGE", "RUNS", "TABLES"]
