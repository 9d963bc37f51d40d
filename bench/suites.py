"""The benchmark suites as data, and `python -m bench`: one entry point for every script in bench/.

    python -m bench                      # the suites, one line each (also: --list)
    python -m bench SUITE --help         # what it measures, its parts and their flags
    python -m bench SUITE [PART] [ARGS]  # a part (no PART: the suite's default) with ARGS

`python -m bench SUITE PART ARGS` is `python -m <the part's module> <the part's fixed flags> ARGS`, run
as __main__ in this process (under torchrun too). `main(argv)` is the command's body (`dtgen bench`).
"""
from __future__ import annotations

import contextlib
import io
import runpy
import sys
import warnings
from dataclasses import dataclass

PROG = "python -m bench"
RUN_ALL = "run-all"   # the GPU runner (bench/runner.py): the suites' steps
USAGE_LINES = 8   # a part's usage in its suite's help; a CLI's runs to dozens of lines


@dataclass(frozen=True)
class Part:
    name: str
    module: str                 # run as `python -m module`
    what: str                   # one line: what it measures
    args: tuple[str, ...] = ()  # flags placed before the caller's (a later flag of the caller's wins)


@dataclass(frozen=True)
class Step:
    """One step of `python -m bench run-all` (bench/runner.py): a part with its flags, under a time limit.
    In `args`, {out} is the run's folder and {ref_image} a random 1024x1024 RGB reference (an edit's)."""

    name: str                   # its log is {out}/<name>.log; its JSON, where it writes one, {out}/<name>.json
    part: str
    args: str
    limit_s: float
    gpus: int = 1               # > 1: under torchrun, one process a GPU; skipped on a machine with fewer


@dataclass(frozen=True)
class Suite:
    name: str
    what: str                   # one line: what the suite measures
    parts: tuple[Part, ...]
    default: str | None = None  # the part run when the first argument names none
    steps: tuple[Step, ...] = ()  # what the GPU runner runs of it, in order


HY_CLI = ("dtgen", ("run", "--model", "hunyuan-image3"))   # the CLI the user runs
# one request at the released shapes (random weights), the one-H200 configuration: FP8 experts, dense linears and
# attention, compiled regions; 256 forced AR tokens, 10 steps
HY_REQUEST = ("--random-weights full --moe-dtype fp8 --dense-dtype fp8 --attention-dtype fp8 --compile "
              "--max-new-tokens 256 --ignore-eos --steps 10")
TWO_GPU_REQUEST = ("--random-weights full --compile --prompt-tokens 1251 --max-new-tokens 256 --ignore-eos "
                   "--image-size 1024x1024 --steps 10")

SUITES: tuple[Suite, ...] = (
    Suite("decode", "HunyuanImage-3's AR decode step on one GPU: wall and device time a token, kernels by kind, "
          "against the bytes floor", (
              Part("step", "bench.bench_decode", "one request's decode step end to end (compiled regions, CUDA graph)"),
          ), default="step", steps=(
              Step("decode_dense_fp8", "step", "--layers 32 --moe-dtype fp8 --dense-dtype fp8 --decode-impls triton "
                   "--tokens 64 --kernels 12 --out {out}/decode_dense_fp8.json", 200),
          )),
    Suite("dit", "Wan's denoise transformer step on one GPU against its FLOP floor", (
        Part("wan", "bench.bench_wan", "Wan's denoise step, eager and one region per block, against 694 TFLOP/s"),
    ), default="wan", steps=(
        Step("wan_1.3B", "wan", "--model 1.3B --out {out}/wan_1.3B.json", 200),
        Step("wan_14B_8layers", "wan", "--model 14B --layers 8 --out {out}/wan_14B_8layers.json", 250),
    )),
    Suite("e2e", "The CLI's whole request (AR, denoise, VAE) at the released shapes, on one GPU and two", (
        Part("cli", HY_CLI[0], "`dtgen run --model hunyuan-image3`: its --report JSON holds each phase's "
             "timings", HY_CLI[1]),
    ), default="cli", steps=(
        Step("t2i", "cli", f"{HY_REQUEST} --prompt-tokens 1251 --image-size 1024x1024 --report {{out}}/t2i.json "
             "--output {out}/t2i.png", 230),
        Step("ti2i", "cli", f"{HY_REQUEST} --image {{ref_image}} --prompt redder --prompt redder "
             "--kv-caches keep-ar --vae-dtype bfloat16 --vae-chunks 4 --report {out}/ti2i.json "
             "--output {out}/ti2i.png", 230),
        # two GPUs, the released 32 layers in bf16 on plan tp2, then both 2-rank plans at 16 layers
        *(Step(f"t2i_{plan}_{n}", "cli", f"--world-size 2 --plan {plan} --layers {n} {TWO_GPU_REQUEST} "
               f"--report {{out}}/t2i_{plan}_{n}.json --output {{out}}/t2i_{plan}_{n}.png", limit, gpus=2)
          for plan, n, limit in (("tp2", 32, 560), ("tp2", 16, 280), ("hybrid2", 16, 280))),
    )),
    Suite("memory", "One HunyuanImage-3 request's memory, phase by phase, with each memory lever on and off", (
        Part("levers", "bench.bench_memory", "peak and timings of T2I and TI2I per lever configuration"),
    ), default="levers", steps=(
        Step("memory_lean_ar", "levers", "--configs lean_ar --dense-dtype fp8 --repeats 3 "
             "--out {out}/memory_lean_ar.json", 300),
    )),
    Suite("vae", "The HunyuanImage-3 VAE: its decode's variants, its FLOPs and their floors", (
        Part("decode", "bench.bench_vae", "the decode's dtypes, fast paths, layouts, chunks, compile; the encode",
             ("--suite",)),
        Part("flops", "bench.bench_vae", "the decode's FLOPs per convolution and its floors (no GPU)", ("--flops",)),
    ), default="decode", steps=(
        Step("vae_flops", "flops", "--sizes 1024 --out {out}/vae_flops.json", 120),
        Step("vae_suite", "decode", "--only-bf16 --out {out}/vae_suite.json", 300),
    )),
    Suite("kernels", "dtgen's kernels alone at HunyuanImage-3 / Wan shapes against torch's ops and the floors", (
        Part("moe", "bench.bench_moe", "the MoE expert ops: multi-micro prefill, decode, FP8 experts"),
        Part("grouped-gemm", "bench.bench_grouped_gemm", "the MoE's grouped GEMMs: torch._grouped_mm, inductor, "
             "the fused kernels"),
        Part("fp8-attention", "bench.bench_fp8_attention", "FP8 attention against SDPA bf16 per backend; "
             "--sweep: tiles; --kernels-only: the Triton and Gluon kernels alone"),
        Part("fp8-attention-trace", "bench.bench_fp8_attention_trace", "the Gluon FP8 attention kernel's phases "
             "per warpgroup in SM clocks (a %clock64 trace): where its softmax and MMAs wait; ping-pong on, off, "
             "half of exp2 on the FMA units"),
        Part("split-kv", "bench.bench_decode_batch", "batched decode attention: balanced split-KV against static "
             "splits and SDPA", ("--parts", "kernel")),
        Part("prologue", "bench.bench_decode_batch", "the fused attention prologue against the separate ops",
             ("--parts", "prologue")),
        Part("gemv", "bench.bench_decode_gemv", "the AR decode's dense GEMVs (e4m3 and bf16) in TB/s against the "
             "floor: the table's kernel, the stream kernel, torch; --sweep: stream candidates"),
    ), steps=(
        Step("moe", "moe", "--out {out}/moe.json", 200),
        Step("grouped_gemm", "grouped-gemm", "--out {out}/grouped_gemm.json", 120),
        Step("fp8_attention", "fp8-attention", "--out {out}/fp8_attention.json", 240),
        Step("fp8_attention_trace", "fp8-attention-trace", "--out {out}/fp8_attention_trace.json", 120),
        Step("split_kv", "split-kv", "--out {out}/split_kv.json", 120),
        Step("prologue", "prologue", "--out {out}/prologue.json", 120),
        Step("gemv", "gemv", "--out {out}/gemv.json", 120),
    )),
    Suite("serve", "The HTTP server: its overhead over the CLI a request, and under load", (
        Part("server", "bench.bench_serve", "overhead against the CLI (median of per-request differences); load "
             "at 1/4/16"),
    ), default="server", steps=(
        Step("serve_overhead", "server", "--overhead-requests 5 --requests 0 --steps 10 --max-new-tokens 256 "
             "--size 1024x1024 --timeout 300 --out {out}/serve_overhead.json -- --random-weights full --moe-dtype fp8 "
             "--compile", 420),
    )),
    Suite("compile", "Cold compile time against depth: whole-step graphs against regional compilation", (
        Part("depth", "bench.bench_compile", "cold compile seconds against depth, regions against whole-step graphs"),
    ), default="depth", steps=(
        Step("compile_depth", "depth", "--layers 2,16 --modes regions,whole --out {out}/compile_depth.json", 400),
    )),
    Suite("step-cache", "Step caches: fewer full denoise steps end to end, and what they cost in accuracy", (
        Part("hunyuan", "bench.bench_step_cache", "HunyuanImage-3 with its step caches against every step in full"),
        Part("wan", "bench.bench_wan_cache", "Wan's first-block cache: dtgen against diffusers' hook"),
        Part("wan-deviation", "bench.bench_step_cache", "each Wan step cache's deviation and speed-up on the "
             "tiny model (CPU)", ("--deviation", "--model", "wan")),
    ), default="hunyuan", steps=(
        Step("step_cache_t2i", "hunyuan", "--model t2i --out {out}/step_cache_t2i.json", 560),
        Step("step_cache_distil", "hunyuan", "--model distil --out {out}/step_cache_distil.json", 560),
        Step("wan_cache", "wan", "--out {out}/wan_cache.json", 560),
    )),
    Suite("peers", "A registered model's DiT against its reference library's on the same weights and inputs "
          "(needs diffusers 0.42.1)", (
              Part("wan", "bench.bench_peers", "Wan's DiT against WanTransformer3DModel, bf16 and the FP8 options",
                   ("--model", "wan")),
              Part("qwen", "bench.bench_peers", "Qwen-Image's MMDiT against QwenImageTransformer2DModel",
                   ("--model", "qwen-image")),
          ), steps=(
              Step("qwen_peers", "qwen", "--modes regions --variants bf16,dense-fp8,attn-fp8,fp8 --warmup 3 --iters 10 "
                   "--out {out}/qwen_peers.json", 240),
              Step("wan_peers", "wan", "--sizes 1.3B,14B-8 --modes regions --variants bf16,attn-fp8,fp8 "
                   "--out {out}/wan_peers.json", 300),
              Step("wan_i2v_peers", "wan", "--sizes I2V-14B-8 --modes regions --variants bf16,attn-fp8,fp8 "
                   "--out {out}/wan_i2v_peers.json", 300),
          )),
    Suite("lora", "LoRA at inference: an unmerged adapter's cost on a DiT step, loading and switching adapters, "
          "rows with different adapters in one batch", (
              Part("step", "bench.bench_lora", "the DiT step with no adapter, a rank-64 one unmerged and merged "
                   "(Wan at 14B width, HunyuanImage-3 with FP8 weights)", ("--measure", "step")),
              Part("load", "bench.bench_lora", "loading a rank-64 adapter into the built model; switching a request "
                   "to a resident one", ("--measure", "load")),
              Part("batch", "bench.bench_lora", "4 requests with 4 adapters as one batch against four (CPU, the tiny "
                   "defaults)", ("--measure", "batch")),
          ), default="step", steps=(
              Step("lora_step_wan", "step", "--model wan --size 14B-8 --out {out}/lora_step_wan.json", 300),
              Step("lora_step_wan_fp8", "step", "--model wan --size 14B-8 --dense-dtype fp8 --attention-dtype fp8 "
                   "--out {out}/lora_step_wan_fp8.json", 300),
              # the one-H200 configuration at 8 of its 32 layers, compiled (each request decodes 256 AR tokens)
              Step("lora_step_hunyuan", "step", "--model hunyuan-image3 --layers 8 --moe-dtype fp8 --dense-dtype fp8 "
                   "--attention-dtype fp8 --modes compiled --repeats 3 --out {out}/lora_step_hunyuan.json", 400),
              Step("lora_load_wan", "load", "--size 14B --out {out}/lora_load_wan.json", 200),
          )),
)

def suite(name: str) -> Suite | None:
    return next((s for s in SUITES if s.name == name), None)


def listing() -> str:
    width = max(len(s.name) for s in SUITES)
    lines = [f"usage: {PROG} SUITE [PART] [ARGS]    ({PROG} SUITE --help: what it measures, its flags)", ""]
    lines += [f"  {s.name:{width}}  {s.what}" for s in SUITES]
    lines += ["", f"{PROG} {RUN_ALL} SUITE[,SUITE...]: the suites' steps on a GPU machine, each under a time limit "
              f"({PROG} {RUN_ALL} --help; bash bench/run_gpu.sh sets the machine up first)"]
    return "\n".join(lines)


def run_module(module: str, argv: list[str]) -> int:
    """`python -m module *argv` in this process: its exit status (SystemExit's, or 0)."""
    saved = sys.argv[:]
    sys.argv = [module, *argv]
    try:
        with warnings.catch_warnings():
            # a module imported before (a suite's help runs one twice) runs as a fresh __main__ copy, as intended
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        code = e.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved


def _usage(part: Part) -> str:
    """The part's usage lines, from its own --help."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        run_module(part.module, [*part.args, "--help"])
    lines = out.getvalue().split("\n\n")[0].strip().splitlines()
    if len(lines) > USAGE_LINES:
        lines = lines[:USAGE_LINES] + ["    ... (PART --help: every flag)"]
    return "\n".join(lines)


def help_text(s: Suite, flags: bool = True) -> str:
    """What the suite measures, and each part: what it measures, its command, its usage (flags)."""
    usage = f"usage: {PROG} {s.name} PART [ARGS]"
    if s.default:
        usage += f"    (no PART: {s.default})"
    lines = [f"{PROG} {s.name}: {s.what}.", "", usage, f"       {PROG} {s.name} PART --help: the part's flags", ""]
    width = max(len(p.name) for p in s.parts)
    for p in s.parts:
        fixed = f" {' '.join(p.args)}" if p.args else ""
        lines.append(f"  {p.name:{width}}  {p.what} (python -m {p.module}{fixed})")
        if flags:
            lines += [f"  {'':{width}}    {line}" for line in _usage(p).splitlines()]
    if s.steps:
        lines += ["", f"on a GPU machine, bash bench/run_gpu.sh {s.name} runs its steps ({s.name}:STEP one of them; "
                  f"{PROG} {RUN_ALL} {s.name} --list: their commands): {', '.join(st.name for st in s.steps)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name == RUN_ALL:
        from bench.runner import main as run_all
        return run_all(rest)
    s = suite(name)
    if s is None:
        print(f"{PROG}: unknown suite {name!r}; the suites: {', '.join(x.name for x in SUITES)}", file=sys.stderr)
        return 2
    if rest[:1] in (["-h"], ["--help"]):
        print(help_text(s))
        return 0
    part = next((p for p in s.parts if rest and p.name == rest[0]), None)
    if part is not None:
        rest = rest[1:]
    elif s.default is not None and not (rest and not rest[0].startswith("-")):   # a word names a part
        part = next(p for p in s.parts if p.name == s.default)
    else:
        what = f"unknown part {rest[0]!r}" if rest else "which part?"
        print(f"{PROG} {s.name}: {what}; its parts: {', '.join(p.name for p in s.parts)} "
              f"({PROG} {s.name} --help)", file=sys.stderr)
        return 2
    return run_module(part.module, [*part.args, *rest])
