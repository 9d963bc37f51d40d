"""The MoE decode op on one GPU at HunyuanImage-3's per-rank shapes (H 4096, 64 experts, top-8, one micro of
768: AR at TP4), T = 1, 2, 8, 16: the Triton decode op (CUDA-graph replays and eager) against the torch
reference and the multi-micro op, bf16 and FP8 (channels, blocks), its tiles swept per kind (the best
beside the default; `--profile-decode`: the default tiles' kernels, no sweep). Each call uses another of 8
routings, so weights come from HBM. Floor: the distinct experts' bytes (`bench.floors.
moe_decode_expert_bytes`) at 4.3 TB/s, beside the copy bandwidth measured here. Times: do_bench medians.
(The denoise phase's MoE GEMMs: `python -m bench kernels grouped-gemm`.)
"""
import sys
from dataclasses import replace

import torch
import triton

from kernels.fp8_quant import quantize_experts
from kernels.moe_decode import DEFAULT_DECODE_CONFIG, DecodeConfig, decode_config_for, moe_decode_triton
from kernels.moe_multi_micro import moe_multi_micro, moe_multi_micro_reference

from bench.floors import HBM_TBPS as PEAK_TBPS, moe_decode_expert_bytes
from bench.harness import Bench, median_ms, need_cuda, rel_err as rel_error

MODULE = "bench.bench_moe"
HIDDEN, EXPERTS, TOP_K, INTER = 4096, 64, 8, 768
DECODE_TOKENS = (1, 2, 8, 16)
ROUTINGS = 8  # decode rotates over this many routings
TARGET_DECODE_US, TARGET_FP8_DECODE_US = 55.0, 30.0


def make_routing(tokens, gen):
    """Top-k of a softmax over random logits, renormalised."""
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def make_weights(micros, gen):
    w_gate_up = torch.randn(micros, EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    w_down = torch.randn(micros, EXPERTS, HIDDEN, INTER, device="cuda", generator=gen, dtype=torch.bfloat16)
    return w_gate_up.mul_(HIDDEN ** -0.5), w_down.mul_(INTER ** -0.5)


def capture(calls) -> torch.cuda.CUDAGraph:
    """The calls (one per routing) in one CUDA graph, their kernels compiled before."""
    for call in calls:  # warm up: compile kernels outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def graph_ms_per_call(calls):
    """Time a replay of the calls' CUDA graph, per call."""
    return median_ms(capture(calls).replay) / len(calls)


def kernel_us_per_call(calls, replays: int = 20) -> dict[str, float]:
    """Device time of each kernel per call, under torch.profiler, over replays of one CUDA
    graph of the calls (the kernels as the timed rows run them)."""
    from torch.profiler import ProfilerActivity, profile
    graph = capture(calls)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per_call = replays * len(calls)
    return {e.key[:60]: round(e.self_device_time_total / per_call, 2) for e in prof.key_averages()
            if e.self_device_time_total > 0}


def copy_tbps() -> float:
    """Device-to-device copy bandwidth (read + write) of a 2 GiB buffer: what the floors'
    HBM peak stands for, measured on the machine of this run."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


# Decode tile sweep: stage-1 and stage-2 variants are timed separately (each over the kind's
# default for the other stage), then the best of each together. Blocks need block_h and
# block_i2 dividing 128.
STAGE1_SWEEP = [dict(block_i=16), dict(block_i=64), dict(block_h=128), dict(block_h=256), dict(block_h=512),
                dict(block_h=1024, stage1_warps=8), dict(stage1_stages=4), dict(stage1_stages=5),
                dict(block_i=16, stage1_stages=4), dict(stage1_warps=8),
                dict(fp8_dot_f16=True), dict(fp8_dot_f16=True, block_i=64),  # the f16 switches: e4m3 weights only
                dict(fp8_dot_f16=False), dict(block_h=256, stage1_stages=3)]
STAGE2_SWEEP = [dict(block_ho=32), dict(block_ho=128), dict(block_i2=64), dict(block_i2=128), dict(block_i2=256),
                dict(block_i2=256, stage2_stages=2), dict(stage2_stages=4), dict(stage2_warps=8),
                dict(block_ho=32, block_i2=256), dict(stage2_fp8_via_f16=True), dict(stage2_fp8_via_f16=False)]


def sweep_decode_config(default: DecodeConfig, time_config, fp8_recipe: str | None):
    """(best config, its ms, [(config, ms)]) over the stage variants around `default`."""
    def allowed(c):
        if fp8_recipe is None:
            return not (c.fp8_dot_f16 or c.stage2_fp8_via_f16)
        return fp8_recipe != "blocks" or (128 % c.block_h == 0 and 128 % c.block_i2 == 0)
    timed = {default: time_config(default)}
    best = {}
    for stage, variants in ((1, STAGE1_SWEEP), (2, STAGE2_SWEEP)):
        for change in variants:
            config = replace(default, **change)
            if allowed(config) and config not in timed:
                timed[config] = time_config(config)
        stage_fields = [f for f in vars(default)
                        if (f.startswith("stage1") or f in ("block_i", "block_h", "fp8_dot_f16")) == (stage == 1)]
        winner = min((c for c in timed if all(getattr(c, f) == getattr(default, f)
                                               for f in vars(default) if f not in stage_fields)), key=timed.get)
        best.update({f: getattr(winner, f) for f in stage_fields})
    combined = DecodeConfig(**best)
    if combined not in timed:
        timed[combined] = time_config(combined)
    config = min(timed, key=timed.get)
    return config, timed[config], list(timed.items())


DECODE_KINDS = ("bf16", "fp8_channels", "fp8_blocks")


def bench_decode(gen, decode_tokens=DECODE_TOKENS, kinds=DECODE_KINDS, profile=False):
    w_gate_up, w_down = make_weights(1, gen)
    fp8_weights = {recipe: quantize_experts(w_gate_up, w_down, recipe) for recipe in ("channels", "blocks")}
    rows = []
    for tokens in decode_tokens:
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
        routings = [make_routing(tokens, gen) for _ in range(ROUTINGS)]
        distinct = sum(ids.unique().numel() for ids, _ in routings) / ROUTINGS
        expected = moe_multi_micro_reference(x, *routings[0], w_gate_up, w_down)

        def calls(fn):
            return [lambda ids=ids, w=w: fn(x, ids, w, w_gate_up, w_down) for ids, w in routings]

        def record(variant, ms, timing, err, kind="bf16", **extra):
            moved = distinct * moe_decode_expert_bytes(kind, HIDDEN, INTER)  # in the row's own storage
            floor_us = moved / (PEAK_TBPS * 1e12) * 1e6
            rows.append(dict(bench="decode", tokens=tokens, variant=variant, us=ms * 1e3, timing=timing,
                             weight_kind=kind, distinct_experts=distinct, bytes=moved, floor_us=floor_us,
                             ratio_to_floor=ms * 1e3 / floor_us, gbps=moved / (ms * 1e-3) / 1e9,
                             rel_err_vs_reference=err, **extra))

        def rotating(fn):
            state = {"i": 0}

            def call():
                state["i"] = (state["i"] + 1) % ROUTINGS
                ids, w = routings[state["i"]]
                return fn(x, ids, w, w_gate_up, w_down)
            return call

        runs = {"": (None, DEFAULT_DECODE_CONFIG, {}, 1.0)} if "bf16" in kinds else {}
        for recipe, (q_gu, s_gu, q_dn, s_dn) in fp8_weights.items():
            if f"fp8_{recipe}" in kinds:
                runs[f"_fp8_{recipe}"] = (recipe, decode_config_for(s_gu),
                                          dict(w_gate_up_scale=s_gu, w_down_scale=s_dn, fp8=(q_gu, q_dn)), 0.5)
        for suffix, (recipe, default, scales, bytes_ratio) in runs.items():
            fp8 = scales.pop("fp8", None)

            def run(x_, ids, w, gate_up, down, config, scales=scales, fp8=fp8):
                return moe_decode_triton(x_, ids, w, *(fp8 or (gate_up, down)), config=config, **scales)

            def time_config(config, run=run):
                try:
                    return graph_ms_per_call(calls(lambda *a: run(*a, config=config)))
                except triton.runtime.errors.OutOfResources:  # the tiles do not fit in shared memory
                    return float("inf")

            def error(config, run=run):
                return rel_error(run(x, *routings[0], w_gate_up, w_down, config=config), expected)

            extra = dict(fp8_weight_bytes_ratio=bytes_ratio, kind=f"fp8_{recipe}") if fp8 else {}
            if profile:  # the default tiles' kernels, no sweep
                extra["kernel_us"] = kernel_us_per_call(calls(lambda *a: run(*a, config=default)))
                record(f"decode_triton{suffix}", time_config(default), "cuda_graph", error(default),
                       config=vars(default), **extra)
                print(f"decode T={tokens} {suffix or 'bf16'} kernels (us per call): {extra['kernel_us']}")
                continue
            best, best_ms, timed = sweep_decode_config(default, time_config, recipe)
            record(f"decode_triton{suffix}", dict(timed)[default], "cuda_graph", error(default), config=vars(default),
                   **extra)
            if not fp8:
                record("decode_triton_eager", median_ms(rotating(lambda *a: run(*a, config=default))), "eager",
                       error(default))
            record(f"decode_triton{suffix}_best_config", best_ms, "cuda_graph", error(best), config=vars(best),
                   swept={str(vars(c)): round(ms * 1e3, 1) for c, ms in timed}, **extra)
        mm_err = rel_error(moe_multi_micro(x, *routings[0], w_gate_up, w_down), expected)
        record("multi_micro_op", median_ms(rotating(moe_multi_micro)), "eager", mm_err)
        record("reference_torch", median_ms(rotating(moe_multi_micro_reference)), "eager (host sync inside)", 0.0)
        print(f"decode T={tokens}: " + ", ".join(f"{r['variant']} {r['us']:.1f} us" for r in rows if
                                                 r["tokens"] == tokens), flush=True)
    return rows


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--part", choices=("decode",), default="decode", help="the one part: the decode op")
    p.add_argument("--decode-tokens", type=int, nargs="+", default=list(DECODE_TOKENS))
    p.add_argument("--decode-kinds", nargs="+", choices=DECODE_KINDS, default=list(DECODE_KINDS))
    p.add_argument("--profile-decode", action="store_true",
                   help="decode: each kind's default tiles, timed and profiled per kernel (no tile sweep)")
    args = b.parse("outputs/bench_moe.json")
    if not torch.cuda.is_available():
        return need_cuda(MODULE)
    gen = torch.Generator(device="cuda").manual_seed(0)
    measured_copy_tbps = copy_tbps()
    decode = bench_decode(gen, args.decode_tokens, args.decode_kinds, args.profile_decode)
    b.write(dict(shapes=dict(hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K, inter_per_micro=INTER),
                 floors=dict(peak_tbps=PEAK_TBPS, measured_copy_tbps=measured_copy_tbps),
                 decode=decode, targets=dict(decode_us_at_1=TARGET_DECODE_US, fp8_decode_us_at_1=TARGET_FP8_DECODE_US)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
