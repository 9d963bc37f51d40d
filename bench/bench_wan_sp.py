"""Wan on 2 GPUs: per-layer attention of every SP kind, and the denoise step's 1 -> 2 GPU scaling.

    torchrun --nproc-per-node 2 -m bench.bench_wan_sp [--model 14B] [--layers 4] [--out F]
    torchrun --nproc-per-node 2 -m bench.bench_wan_sp --tiny --device cpu     # a CPU smoke run (gloo)

One plan over the 2 ranks holds a phase per variant, so everything runs over ONE resident copy
of the DiT's (random) weights through `dtgen.build`, switched by the phase controller:
`single` (each GPU computes the whole step alone: the 1-GPU baseline), `ulysses`,
`ulysses-pipelined`, `ring`, `attn2d` (1 x 2) and `cfg` (one CFG row per GPU).

- attention: one layer's self-attention core (the exchange included) for B = 1 at 480p (32760
  tokens) and 720p (75600), 40 heads x 128 (Wan2.1-14B). Targets: pipelined Ulysses at least
  SGLang's gain over sequential Ulysses (480p -11.4%, 720p -4.5%); attn2d no slower than ring
  at 720p.
- step: the whole denoise step (both CFG rows, `--layers` blocks, compiled one region per
  block) at 480p; efficiency = single / (2 x parallel). Target: >= 90% for Ulysses 2 and CFG 2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dtgen.attention import AttentionMeta
from dtgen.build import ModelAdapter, build
from dtgen.plan import PhasePlan, Plan, Rule

SHAPES = {"480p": (21, 60, 104), "720p": (21, 90, 160)}   # latent frames, height, width (81 frames)
KINDS = ("ulysses", "ulysses-pipelined", "ring", "attn2d")


class DiTOnly(ModelAdapter):
    """The Wan DiT alone (the benchmark needs no text encoder or VAE)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def build_on_meta(self):
        from models.wan.transformer import WanTransformer
        return WanTransformer(self.cfg)

    def attention_heads(self, model):
        from models.wan.transformer import Attention
        n = self.cfg.num_attention_heads
        return {name: (n, n) for name, m in model.named_modules() if isinstance(m, Attention) and hasattr(m, "core")}

    def param_dtype(self, name, dtype):
        from models.wan.transformer import keeps_fp32
        return torch.float32 if keeps_fp32(name) else dtype


def bench_plan() -> Plan:
    phases = {"single": PhasePlan(replicate=("sp",)), "cfg": PhasePlan(cfg=("sp",))}
    phases.update({kind: PhasePlan(sp=("sp",), attention=kind) for kind in KINDS})
    return Plan("wan-bench-2", (("sp", 2),), phases, params={"*": Rule.REPLICATE})


def _time(fn, device, warmup: int, iters: int, group) -> float:
    """Median ms of fn over iters, every rank in step (a barrier before each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            import time
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("1.3B", "14B"), default="14B")
    p.add_argument("--layers", type=int, default=4, help="blocks in the step part")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from bench.bench_wan import dit_config
    from dtgen.launch import init_from_torchrun
    from models.wan.pipeline import dit_step
    from models.wan.transformer import run_block

    ctx = init_from_torchrun()
    device = ctx.device if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = dit_config(args.model, args.layers)
    shapes = SHAPES
    if args.tiny:
        cfg = dit_config(args.model, 2)
        cfg = type(cfg).from_dict({**cfg.raw, "num_attention_heads": 4, "attention_head_dim": 16, "ffn_dim": 64,
                                   "text_dim": 32, "freq_dim": 32})
        shapes = {"tiny": (3, 6, 4)}
    built = build(DiTOnly(cfg), bench_plan(), None, ctx.rank, ctx.world_size, dtype, device)
    dit, controller = built.model, built.controller
    group = controller.topology.control
    heads, hd = cfg.num_attention_heads, cfg.attention_head_dim
    text_dim = cfg.text_dim
    out = {"model": args.model if not args.tiny else "tiny", "device": str(device), "torch": torch.__version__,
           "attention": {}, "step": {}}
    gen = torch.Generator(device=device).manual_seed(0)

    with torch.no_grad():
        # ---- one layer's self-attention core, B = 1 ------------------------------------------
        for name, (f, h, w) in shapes.items():
            tokens = f * (h // 2) * (w // 2)
            row = {"tokens": tokens}
            for phase in ("single", *KINDS):
                rt = controller.activate(phase)
                core = dit.blocks[0].attn1.core
                rows = tokens if phase == "single" else -(-tokens // 2)
                q, k, v = (torch.randn(1, rows, heads, hd, generator=gen, device=device, dtype=dtype) for _ in range(3))
                full = rt.seq.padded_length(tokens)
                meta = AttentionMeta(slots=torch.arange(full, device=device), image_blocks=((0, tokens),),
                                     slot_runs=((0, full),))
                row[phase] = round(_time(lambda: core(q, k, v, meta, None), device, 2, args.iters, group), 3)
            row["pipelined_vs_ulysses"] = round(row["ulysses-pipelined"] / row["ulysses"] - 1, 4)
            row["attn2d_vs_ring"] = round(row["attn2d"] / row["ring"] - 1, 4)
            out["attention"][name] = row
        # ---- the whole step, both CFG rows, compiled regions -------------------------------------
        torch._dynamo.config.cache_size_limit = 64
        dit.run_block = torch.compile(run_block, fullgraph=True)
        name = next(iter(shapes)) if args.tiny else "480p"
        f, h, w = shapes[name]
        x = torch.randn(2, 16, f, h, w, generator=gen, device=device, dtype=dtype)
        t = torch.full((2,), 500, device=device, dtype=torch.int64)
        text = torch.randn(2, 512, text_dim, generator=gen, device=device, dtype=dtype)
        step = {"video": name, "layers": cfg.num_layers}
        for phase in ("single", "ulysses", "ulysses-pipelined", "cfg"):
            rt = controller.activate(phase)
            if phase == "cfg":
                mine = slice(rt.cfg_rank, rt.cfg_rank + 1)
                fn = (lambda rt=rt, mine=mine: rt.gather_cfg(dit_step(rt, dit, x[mine], t[mine], text[mine])))
            else:
                fn = (lambda rt=rt: dit_step(rt, dit, x, t, text))
            step[phase] = round(_time(fn, device, 2, args.iters, group), 2)
        for phase in ("ulysses", "ulysses-pipelined", "cfg"):
            step[f"{phase}_efficiency"] = round(step["single"] / (2 * step[phase]), 3)
        out["step"] = step
    if ctx.rank == 0:
        print(json.dumps(out, indent=1))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier(group=group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
