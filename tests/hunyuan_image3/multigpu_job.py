"""Every 2-rank plan on the GPUs: compiled against eager against one process (run by torchrun).

    torchrun --standalone --nproc-per-node 2 tests/hunyuan_image3/multigpu_job.py --dtype float32 \
        --plans tp2,hybrid2,hybrid2-cfg --out result.json

`tests/hunyuan_image3/test_multigpu.py` starts it and checks what rank 0 writes to --out, per plan:
the largest deviation of the AR logits and the velocities, relative to the largest
reference value, for compiled vs eager (same plan) and eager vs the single-process model
on rank 0; the tokens sampled by each; graph counts; recompiles after warm-up (the timed
run runs under `fail_on_recompile`, so a recompile fails the job); and whether the decode
step replayed as a CUDA graph.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from dtgen.compile import CompileOptions, graph_breaks, unique_graphs  # noqa: E402
from dtgen.devices import parse_dtype  # noqa: E402
from dtgen.launch import exit_process, run_on_ranks  # noqa: E402
from models.hunyuan_image3.loading import load  # noqa: E402
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline  # noqa: E402
from models.hunyuan_image3.requests import T2IRequest  # noqa: E402
from models.hunyuan_image3.tiny import ensure_tiny_checkpoint  # noqa: E402
from placements.hunyuan_image3 import get_plan  # noqa: E402

REQUEST = dict(prompt="a lighthouse at dusk", steps=3, max_new_tokens=6, image_size="256x256", seed=5)


def _rel(xs, ys) -> float:
    """Largest deviation relative to the largest reference value, over paired tensors."""
    if len(xs) != len(ys):
        return float("inf")
    return max(float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().cpu().abs().max())
               for a, b in zip(xs, ys))


def _pipe(loaded, device, compiled: bool, is_main: bool, backend: str = "inductor",
          regions: bool = False) -> HunyuanT2IPipeline:
    options = CompileOptions(enabled=compiled, backend=backend, decode_cuda_graph=True, regions=regions)
    return HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device, is_main=is_main,
                              compile_options=options)


def _say(ctx, t0: float, text: str) -> None:
    ctx.progress(text)
    print(f"[rank {ctx.rank}] {time.perf_counter() - t0:7.1f} s  {text}", flush=True)


def job(ctx, args) -> dict:
    torch._dynamo.config.cache_size_limit = 64
    dtype = parse_dtype(args.dtype, ctx.device)
    if dtype == torch.float32:  # float32 means float32 (see models/hunyuan_image3/cli.py)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    ckpt = ensure_tiny_checkpoint()
    out: dict = {"dtype": args.dtype, "torch": torch.__version__, "plans": {}}
    reference = None
    for plan in args.plans.split(","):
        t0 = time.perf_counter()
        _say(ctx, t0, f"{plan} {args.dtype}: load")
        loaded = load(ckpt, get_plan(plan), ctx.rank, ctx.world_size, dtype, ctx.device)
        eager = _pipe(loaded, ctx.device, False, ctx.rank == 0)
        eager.generate(T2IRequest(**{**REQUEST, "steps": 1}))          # first-call kernel JIT
        e = eager.generate(T2IRequest(**REQUEST))
        replay = T2IRequest(**REQUEST, forced_tokens=tuple(e.tokens), forced_ratio=e.ratio_index)
        if ctx.rank == 0 and reference is None:
            single = load(ckpt, get_plan("single"), 0, 1, dtype, ctx.device, moe_impl="eager")
            reference = _pipe(single, ctx.device, False, True).generate(replay)
        _say(ctx, t0, f"{plan}: eager done; compiling")
        compiled = _pipe(loaded, ctx.device, True, ctx.rank == 0, args.backend, args.regions)
        sampled = compiled.generate(T2IRequest(**REQUEST))             # warm-up: compiles, samples freely
        graphs = unique_graphs()
        _say(ctx, t0, f"{plan}: compiled ({graphs} graphs); timed runs")
        with torch.compiler.set_stance("fail_on_recompile"):
            for _ in range(2):                                         # switching changes nothing
                loaded.controller.activate("denoise")
                loaded.controller.activate("ar")
            c = compiled.generate(replay)
            again = compiled.generate(replay)
        row = {
            "eager_tokens": e.tokens, "compiled_sampled_tokens": sampled.tokens,
            "compiled_vs_eager_logits": _rel(c.record["ar_logits"], e.record["ar_logits"]),
            "compiled_vs_eager_velocity": _rel(c.record["velocity"], e.record["velocity"]),
            "replay_identical": all(torch.equal(a, b) for a, b in zip(c.record["velocity"], again.record["velocity"]))
            and torch.equal(c.latents, again.latents),
            "graphs_after_warmup": graphs, "recompiles_after_warmup": unique_graphs() - graphs,
            "graph_breaks": graph_breaks(), "decode_cuda_graph": compiled.decode_cuda_graph,
            "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if reference is not None:
            row["eager_vs_single_logits"] = _rel(e.record["ar_logits"], reference.record["ar_logits"])
            row["eager_vs_single_velocity"] = _rel(e.record["velocity"], reference.record["velocity"])
            row["compiled_vs_single_velocity"] = _rel(c.record["velocity"], reference.record["velocity"])
        out["plans"][plan] = row
        _say(ctx, t0, f"{plan}: done")
        del eager, compiled, loaded
        torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--plans", default="tp2,hybrid2,hybrid2-cfg")
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: a quick CPU check)")
    p.add_argument("--regions", action="store_true", help="regional compilation (--compile-regions)")
    args = p.parse_args()
    result = run_on_ranks(job, 2, args, stall_s=60.0)[0]
    if os.environ.get("RANK", "0") == "0":  # rank 0 holds the single-process comparison
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    exit_process(main())
