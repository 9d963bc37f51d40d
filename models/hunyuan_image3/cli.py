"""HunyuanImage-3.0 text-to-image.

    dtgen run --model hunyuan-image3                                  # tiny default, one process
    dtgen run --model hunyuan-image3 --prompt "a fox" --prompt "a lighthouse at dusk"   # two requests, one run
    dtgen run --model hunyuan-image3 --world-size 4 --plan hybrid     # 4 gloo ranks spawned here (CPU)
    dtgen run --model hunyuan-image3 --lora style/:0.8                # a PEFT adapter folder, in both phases
    torchrun --nproc-per-node 4 -m dtgen run --model hunyuan-image3 --world-size 4 --plan hybrid \\
        --checkpoint /path/to/HunyuanImage-3                         # 4 GPUs, NCCL

With no --checkpoint, a tiny random model is written once (official format) into the
cache folder and loaded through the real loader. Writes the PNG, prints a per-stage timing
table and, with --report, a JSON report. Several prompts (--prompt repeated, --prompts-file,
or --prompt-tokens N,M,...) run one after another in the same process: the report gives
each request's timings and the graphs each one compiled.

`python -m examples.hunyuan_t2i` runs the same command.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist


from dtgen.checkpoint import unreadable
from dtgen.compile import CompileOptions, unique_graphs
from dtgen.host import GcPauses, process_age_s, settle_heap
from dtgen.harness import (add_run_flags, compile_facts, compile_problem,
                           example_main, run_device_type,
                           finish_launch_args, gather_rank_facts, launch_problem, max_diff, output_path_problem,
                           peak_memory, rank_device, reference_threads, rel_l2, table)
from dtgen.devices import parse_dtype
from dtgen.image_files import image_path_problem, save_image
from dtgen.launch import RankContext
from dtgen.profiling import PhaseProfiler
from dtgen import schema
from dtgen.requests import flag_line
from dtgen.requests import RequestError
from dtgen.fp8 import add_fp8_flags, attention_head_problem, check_attention_dtype
from dtgen.lora import LoraError, ResidentLoras, read_lora
from dtgen.lora.flags import add_lora_flags, lora_problem, parse_lora_flag, request_loras, resident_loras
from dtgen.storage import FP8_RECIPES
from models.hunyuan_image3.config import HunyuanImage3Config
from models.hunyuan_image3.loading import MOE_DTYPES, load, lora_targets, memory_budget_problem
from models.hunyuan_image3.tokenizer import load_tokenizer
from kernels.moe_dispatch import MOE_IMPLS, moe_impl_problem
from models.hunyuan_image3.model import set_moe_token_chunk
from models.hunyuan_image3.presets import full_config
from models.hunyuan_image3.requests import (Limits, OFFICIAL_TAYLOR_KNOBS, T2IRequest, filler_ids, size_to_hw,
                                            taylor_from_official, warmup_request)
from dtgen.step_cache import StepCacheError, parse_step_cache
from models.hunyuan_image3.cond_image import load_reference_image, reference_tensor
from models.hunyuan_image3.pipeline import PROFILE_ROWS, HunyuanT2IPipeline, to_uint8
from models.hunyuan_image3.stack import KV_CACHE_POLICIES
from models.hunyuan_image3.tiny import ensure_tiny_checkpoint, tiny_config
from models.registry import checkpoint_problem
from placements.hunyuan_image3 import PLANS, get_plan


DEFAULT_PROMPT = "A photo of a red fox in fresh snow, golden hour"
# The official Taylor-cache flags: (flag, type, the official default); `--taylor-cache-X` maps
# to the official keyword `taylor_cache_X` (models/hunyuan_image3/requests.py).
TAYLOR_FLAGS = (("--taylor-cache-interval", int, 5), ("--taylor-cache-order", int, 2),
                ("--taylor-cache-enable-first-enhance", bool, False), ("--taylor-cache-first-enhance-steps", int, 3),
                ("--taylor-cache-enable-tailing-enhance", bool, False), ("--taylor-cache-tailing-enhance-steps", int, 1),
                ("--taylor-cache-low-freqs-order", int, 2), ("--taylor-cache-high-freqs-order", int, 2))
# Request defaults a checkpoint's generation_config.json may set (its key, the flag's attribute, the fallback).
GENERATION_DEFAULTS = (("diff_infer_steps", "steps", 50), ("diff_guidance_scale", "guidance", 5.0),
                       ("flow_shift", "flow_shift", 3.0))
# What spawned CPU ranks import before they fork (dtgen.launch.RankPool): this example's code.
RANK_PRELOAD = ("models.hunyuan_image3.cli",)


def parse_args(argv=None, prog: str = "dtgen run --model hunyuan-image3") -> argparse.Namespace:
    return finish_args(build_parser(prog).parse_args(argv))


# What only the CLI reads (a server's parser leaves these out, with these values).
CLI_ONLY = dict(prompt=None, prompts_file=None, prompt_tokens=None, image=None, system_prompt="",
                profile_steps=None, profile_top=None, check=False, profile=None, output=None, report=None)


def build_parser(prog: str = "dtgen run --model hunyuan-image3", description: str = __doc__.split("\n")[0],
                 cli: bool = True):
    """The model, plan, compile and request flags; `cli=False` (a server, which adds its own):
    without the flags only the CLI reads (`CLI_ONLY`)."""
    p = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add = p.add_argument if cli else (lambda *a, **k: None)
    p.add_argument("--checkpoint", help="official checkpoint folder (default: the embedded tiny model)")
    p.add_argument("--random-weights", choices=("full", "full-distil", "tiny"), default=None,
                   help="no checkpoint: random weights made on each rank, for the released architecture "
                        "('full'), Instruct-Distil's (its CFG-distilled meanflow sampler: 'full-distil') or the "
                        "tiny default's ('tiny')")
    p.add_argument("--layers", type=int, default=None, help="with --random-weights: decoder layers (default 32)")
    add("--prompt", action="append", default=None,
                   help=f"the prompt (default: {DEFAULT_PROMPT!r}); repeat it for several requests in one run")
    add("--prompts-file", default=None, help="one prompt per line (blank lines skipped), after any --prompt")
    add("--image", default=None, metavar="PATH",
                   help="edit this reference image (the Instruct template: the prompt says what to change)")
    add("--prompt-tokens", default=None, metavar="N[,M,...]",
                   help="benchmark prompts of these lengths (fixed ids), one request each, instead of --prompt")
    # the request's fields (models/hunyuan_image3/requests.py T2IRequest), less the prompt (the
    # flags above make one request a prompt) and, on a server, an edit's system prompt
    schema.add_flags(p, T2IRequest, omit=("prompt",) + (() if cli else ("system_prompt",)))
    official = p.add_argument_group("the official command line's Taylor-cache flags (run_image_gen.py; the same "
                                    "cache as --step-cache taylor)")
    official.add_argument("--use-taylor-cache", action="store_true", help="the Taylor cache, at the defaults below")
    for flag, kind, default in TAYLOR_FLAGS:
        if kind is bool:
            official.add_argument(flag, action="store_true", default=None, help="(default: off)")
        else:
            official.add_argument(flag, type=kind, default=None, metavar="N", help=f"(default: {default})")
    p.add_argument("--moe-impl", default="auto", choices=MOE_IMPLS,
                   help="routed experts: kernel ops ('auto'), the plain loop ('eager'), or a forced variant; "
                        "'scaled_grouped_mm' / 'gluon': FP8 experts' GEMMs in torch._scaled_grouped_mm / our Gluon "
                        "kernel (--moe-dtype fp8 with channel or tensor scales, sm90)")
    p.add_argument("--moe-dtype", default="model", choices=MOE_DTYPES,
                   help="routed experts' storage: the model dtype, or fp8 (e4m3, quantized at load from the "
                        "bf16 checkpoint; GPU: compute capability 8.9 or 9.0+)")
    add_fp8_flags(p, "every layer's QKV, O and shared MLP, and the lm_head (error table: "
                     "tests/hunyuan_image3/test_fp8_dense.py)",
                  "the attention of the denoise image rows and of an edit's condition-image rows at prefill (text "
                  "rows and the AR decode step stay in the model dtype; error table: "
                  "tests/hunyuan_image3/test_fp8_attention.py)")
    p.add_argument("--fp8-scales", default=None, choices=FP8_RECIPES,
                   help="with --moe-dtype fp8: one scale per weight row and activation row ('channels', the fast "
                        "one), per 128x128 weight block and 128 activation columns ('blocks'), or one per expert "
                        "matrix and activation row ('tensor', as fast as 'channels')")
    add("--profile-steps", type=int, default=None,
                   help="denoise steps of the profiled run (default: --steps)")
    add("--profile-top", type=int, default=None,
                   help="device kernels listed per phase in the profile (default: 12)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compile on GPU: replay the AR decode step as a CUDA graph (default: on)")
    p.add_argument("--decode-impl", choices=("sdpa", "reference", "triton"), default=None,
                   help="how the AR decode step attends: masked SDPA over the whole cache (sdpa), or the batched "
                        "decode path, the fused QK-norm/RoPE/KV-write prologue and split-KV attention over the "
                        "request's own keys, as torch ops (reference) or Triton kernels (triton). Default: triton "
                        "on CUDA, sdpa elsewhere; an AR phase with sequence parallelism always runs sdpa")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run a short request first (same shapes; 2 denoise steps) so that compilation and "
                        "first-call kernel JIT stay out of the figures; its wall time is reported on its own "
                        "(default: on with --compile or on GPU, where Triton kernels JIT on first call)")
    p.add_argument("--warmup-shapes", default=None, metavar="TOKENS:WIDTHxHEIGHT[,...]",
                   help="the warm-up compiles these shapes instead of the first request's: prompt tokens "
                        "(<bos> included) and image size, each run with --max-new-tokens AR tokens "
                        "(e.g. 256:1024x1024,512:1024x1024; a server warms up its buckets before traffic)")
    p.add_argument("--prompt-bucket", type=int, default=None, metavar="N",
                   help="pad the AR prompt and the denoise text to a multiple of N rows (exact: no real row "
                        "attends to the padding), so that prompts of similar length share every compiled "
                        "graph; 0 = exact lengths "
                        "(default: 256 with --compile, else 0)")
    p.add_argument("--compile-autotune", action="store_true",
                   help="with --compile: let inductor tune the prefill and denoise GEMMs (the dense ones; "
                        "--moe-impl graph lets it tune the MoE's too, slower than the default fused kernels "
                        "on an H200); slower compile")
    p.add_argument("--vae-dtype", default=None, choices=("float32", "bfloat16"),
                   help="the VAE's weights and compute (default: the checkpoint's vae_dtype, float32 in the "
                        "released ones); bfloat16 halves its memory (its error: python -m bench vae decode)")
    p.add_argument("--vae-chunks", type=int, default=None, metavar="N",
                   help="decode on one rank (and encode an edit's reference) with the VAE's big maps convolved N "
                        "slabs of rows at a time (exact; two whole maps live at once instead of three; default 1)")
    p.add_argument("--vae-layout", default="auto", choices=("auto", "channels-last", "ncdhw"),
                   help="the VAE's activation layout: channels-last (channels_last_3d from its first conv to its last: "
                        "cuDNN's bf16 convs without layout conversions) or ncdhw; auto (default): channels-last for a "
                        "bf16 VAE on CUDA (--vae-dtype bfloat16), else ncdhw (the float32 golden path)")
    p.add_argument("--moe-token-chunk", type=int, default=None, metavar="N",
                   help="run the routed experts over at most N tokens a call (the dispatch buffers grow with "
                        "tokens x top-k: a memory lever for long denoise sequences; default: all at once)")
    p.add_argument("--kv-caches", default="keep", choices=KV_CACHE_POLICIES,
                   help="'keep': the KV caches stay allocated between requests (a CUDA-graph decode is recorded "
                        "once); 'release': the AR cache is freed after AR, the denoise caches after denoise "
                        "(before the VAE decode), for less memory at each peak; 'keep-ar': the denoise caches "
                        "released, the AR cache kept (the decode graph records once)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help="the memory a rank may use (GB, 1e9 bytes): a plan whose weights do not fit it is refused "
                        "before any weight is read, and on GPU the caching allocator is capped to it (as on a card "
                        "of that size; default: the device's free memory)")
    p.add_argument("--vae-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="with several ranks, split the VAE decode over all of them (halo exchange; default: on)")
    add_lora_flags(p)
    server = add_run_flags(p, PLANS, "outputs/hunyuan_t2i.png", cli, CLI_ONLY, "HunyuanImage-3")
    if server is not None:
        server.add_argument("--edits", action=argparse.BooleanOptionalAction, default=None,
                            help="serve /v1/images/edits: load the vision tower and the VAE encoder (default: when "
                                 "the checkpoint has them)")
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on other flags or on torchrun (plan: single, or hybrid on 4 ranks)."""
    return finish_launch_args(args, lambda world: "single" if world == 1 else "hybrid")


def _prompt_lengths(text: str | None) -> list[int] | None:
    """--prompt-tokens "N[,M,...]" -> [N, M, ...]; ValueError naming the bad item."""
    if text is None:
        return None
    lengths = []
    for item in text.split(","):
        if not item.strip().isdigit() or int(item) < 1:
            raise ValueError(f"--prompt-tokens {text!r}: {item.strip()!r} is not a length of at least 1")
        lengths.append(int(item))
    return lengths


def _warmup_shapes(text: str | None, base: int) -> list[tuple[int, str]] | None:
    """--warmup-shapes "TOKENS:WIDTHxHEIGHT[,...]" -> [(tokens, the pipeline's "HxW"), ...];
    ValueError naming the bad item."""
    if text is None:
        return None
    shapes = []
    for item in text.split(","):
        tokens, _, size = item.strip().partition(":")
        if not tokens.isdigit() or int(tokens) < 1 or not size:
            raise ValueError(f"--warmup-shapes {text!r}: {item.strip()!r} is not TOKENS:WIDTHxHEIGHT with TOKENS >= 1")
        if size == "auto":
            raise ValueError(f"--warmup-shapes {text!r}: {item.strip()!r} needs an image size WIDTHxHEIGHT, not 'auto'")
        try:
            shapes.append((int(tokens), size_to_hw(size, "size", base)))
        except RequestError as e:
            raise ValueError(f"--warmup-shapes {text!r}: {e.message}") from None
    return shapes


def _longest_prompt_problem(args, warmup_tokens: list[int], context: int) -> str | None:
    """The one-line refusal of a prompt length (--prompt-tokens, --warmup-shapes) whose AR
    sequence would not fit the model's positions, or None. Text prompts are checked by the
    pipeline, once tokenized."""
    new = args.max_new_tokens or 0
    for flag, tokens in (("--prompt-tokens", _prompt_lengths(args.prompt_tokens) or []),
                         ("--warmup-shapes", warmup_tokens)):
        for n in tokens:
            if context and n + new + 2 > context:
                return (f"{flag}: a prompt of {n} tokens + {new} new tokens + 2 image-head tokens needs "
                        f"{n + new + 2} positions; the model has {context} (max_position_embeddings)")
    return None


def _prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    return prompts or [DEFAULT_PROMPT]


def _requests(args) -> list[T2IRequest]:
    """Every request of the run, in order (all share the sampling, image and step settings)."""
    if args.prompt_tokens is not None:
        # Benchmark prompts: fixed ids (the <bos> comes on top of the N - 1 given here).
        return [request_from_args(args, prompt_ids=filler_ids(n - 1)) for n in _prompt_lengths(args.prompt_tokens)]
    return [request_from_args(args, prompt=p) for p in _prompts(args)]


def request_from_args(args, prompt: str = DEFAULT_PROMPT, prompt_ids=None) -> T2IRequest:
    """The request the flags say (a server's: the defaults of the fields a request leaves out):
    the declared fields' flags (dtgen/schema.py), with what the command works out itself: the
    prompt, the pipeline's "HxW" of --image-size, the step cache of --step-cache or the
    official Taylor-cache flags, an edit's image."""
    return schema.from_args(T2IRequest, args, prompt=prompt, prompt_ids=prompt_ids, image_size=args.image_size_hw,
                            cfg_mode=args.cfg_mode or "serial", reference=getattr(args, "reference", None),
                            step_cache=_step_cache(args), loras=request_loras(args))


def _step_cache(args):
    """--step-cache, or the official --use-taylor-cache flags, as a config (None: no cache).
    ValueError with the one-line problem, naming the flag."""
    given = [(flag, getattr(args, flag[2:].replace("-", "_"))) for flag, _, _ in TAYLOR_FLAGS]
    given = [(flag, value) for flag, value in given if value is not None]
    if given and not args.use_taylor_cache:
        raise ValueError(f"{given[0][0]} needs --use-taylor-cache")
    if args.use_taylor_cache and args.step_cache:
        raise ValueError("give --step-cache or --use-taylor-cache, not both")
    try:
        if args.use_taylor_cache:
            return taylor_from_official({"use_taylor_cache": True,
                                         **{flag[2:].replace("-", "_"): value for flag, value in given}})
        return parse_step_cache(args.step_cache)
    except StepCacheError as e:
        if args.use_taylor_cache:
            official = {knob: name for name, knob in OFFICIAL_TAYLOR_KNOBS.items()}
            raise ValueError(f"--taylor-cache-{official.get(e.knob, e.knob).replace('_', '-')} {e.message}") from None
        raise ValueError(f"--step-cache {args.step_cache!r}: {e.knob}: {e.message}") from None


def _first_denoise_step_clock(hook, ready_s: list[float]):
    """`hook`, which also notes the process age when a denoise step first completes: how long
    a process takes to be ready (loading, compiling or reading the compile cache, first AR)."""
    def progress(phase: str, done: int, total: int) -> None:
        if phase == "denoise" and done == 1 and not ready_s:
            ready_s.append(round(process_age_s(), 2))
        hook(phase, done, total)
    return progress


def _progress_hook(ctx: RankContext):
    """progress(phase, done, total): tells the stall watch."""
    def progress(phase: str, done: int, total: int) -> None:
        ctx.progress(f"{phase} {done}/{total}")

    return progress


def request_progress(ctx: RankContext):
    """The progress hook of each timed request (the warm-up and the profiled run report
    through `_progress_hook` alone): a seam of its own because the error-path tests wrap it
    to fail a rank at a step of the requests, never of a warm-up (tests/support/faults.py)."""
    return _progress_hook(ctx)


def build_pipeline(ctx: RankContext, args: argparse.Namespace):
    """This rank's share of the model, loaded, and its pipeline: (pipeline, loaded, device, dtype)."""
    device, dtype = rank_device(ctx, args)
    torch.manual_seed(args.seed)
    ctx.progress("loading")
    budget = None if args.memory_budget is None else int(args.memory_budget * 1e9)
    if budget is not None and device.type == "cuda":
        # What a card of this size would allow: the allocator fails past it, as that card would.
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.get_device_properties(device).total_memory),
                                                   device)
    loaded = load(args.checkpoint, get_plan(args.plan), ctx.rank, ctx.world_size, dtype, device, moe_impl=args.moe_impl,
                  random_config=_random_config(args), moe_dtype=args.moe_dtype, fp8_scales=args.fp8_scales,
                  image_editing=getattr(args, "image_editing", args.image is not None), memory_budget_bytes=budget,
                  vae_dtype=args.vae_dtype, dense_dtype=getattr(args, "dense_dtype", "model"),
                  attention_dtype=getattr(args, "attention_dtype", "model"))
    options = CompileOptions(enabled=args.compile, backend=args.compile_backend, autotune=args.compile_autotune,
                             decode_cuda_graph=args.cuda_graph is not False, regions=args.compile_mode == "regions")
    set_moe_token_chunk(loaded.model, args.moe_token_chunk)
    vae_group = dist.group.WORLD if args.vae_parallel is not False and ctx.world_size > 1 else None
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device, is_main=ctx.rank == 0,
                              compile_options=options, vae_group=vae_group, prompt_bucket=args.prompt_bucket,
                              kv_caches=args.kv_caches, vae_row_chunks=args.vae_chunks or 1,
                              decode_impl=args.decode_impl, vae_layout=args.vae_layout)
    pipe.loras = resident_loras(loaded, args, dtype)
    return pipe, loaded, device, dtype


def run_rank(ctx: RankContext, args: argparse.Namespace) -> dict:
    """One rank's whole run; returns what the report needs (the image on rank 0)."""
    pipe, loaded, device, dtype = build_pipeline(ctx, args)
    profiler = PhaseProfiler(args.profile, ctx.rank, top=args.profile_top or 12, group=loaded.controller.topology.control,
                             table_rows=PROFILE_ROWS) if args.profile else None
    requests = _requests(args)
    warmup_ms, ready_s = None, []
    if args.warmup if args.warmup is not None else (args.compile or device.type == "cuda" or args.warmup_shapes):
        # The first request's prompt, seed and image size: its shapes, so every graph it needs
        # compiles (and every kernel is JIT-compiled) here, not in the timed run. Or the shapes
        # given (a server's buckets): requests in their buckets then compile nothing.
        t0 = time.perf_counter()
        shapes = _warmup_shapes(args.warmup_shapes, loaded.model.cfg.image_base_size)
        if shapes:
            pipe.warm_up(shapes, requests[0], progress=_first_denoise_step_clock(_progress_hook(ctx), ready_s))
        else:
            pipe.generate(warmup_request(requests[0]),
                          progress=_first_denoise_step_clock(_progress_hook(ctx), ready_s))
        warmup_ms = (time.perf_counter() - t0) * 1e3
    warm_graphs = unique_graphs()
    # What compiling and loading made lives as long as the process: keep the collector off it,
    # or a full collection pauses one rank mid-request and the others wait (dtgen/host.py).
    settle_heap()
    results, per_request = [], []
    with GcPauses() as gc_pauses:
        for req in requests:
            graphs, compile_s = unique_graphs(), pipe.compiler.compile_s
            hook = request_progress(ctx)
            res = pipe.generate(req, progress=_first_denoise_step_clock(hook, ready_s))
            results.append(res)
            per_request.append({
                "prompt_tokens": len(req.prompt_ids) + 1 if req.prompt_ids is not None
                else len(loaded.tokenizer.encode(req.prompt)) + 1,
                "tokens_generated": len(res.tokens), "image_size": list(res.image_size),
                "timings_ms": res.timings_ms, "new_graphs": unique_graphs() - graphs,
                "compile_s": round(pipe.compiler.compile_s - compile_s, 3)})
    result = results[0]
    compile_report = None
    if args.compile:
        compile_report = compile_facts(pipe.compiler, warm_graphs)
        compile_report["decode_cuda_graph"] = pipe.decode_cuda_graph
    profile_summary = None
    if profiler:
        # The same request (fewer denoise steps at most): its AR tokens make the denoise
        # sequence, so any other token count would compile new denoise graphs in here.
        profiled = pipe.generate(replace(requests[0], steps=args.profile_steps or args.steps), profiler,
                                 progress=_progress_hook(ctx))
        profile_summary = profiler.write(profiled.timings_ms, compile_report)
    out = {"rank": ctx.rank, "timings_ms": result.timings_ms, "warmup_ms": warmup_ms, "tokens": result.tokens,
           "step_cache": (result.record.get("step_cache") or [None])[0],
           "first_denoise_step_done_s": ready_s[0] if ready_s else None,
           "requests": per_request,
           "image_size": result.image_size, "switch": loaded.controller.last_switch.as_dict(),
           "storage_bytes": loaded.storage.nbytes, "peak_memory_bytes": peak_memory(device), "device": str(device),
           "gc": gc_pauses.as_dict(),
           "compile": compile_report, "profile": profile_summary}
    # Every rank's small facts reach rank 0 (under torchrun it alone reports).
    out["ranks"] = gather_rank_facts(ctx, {k: out[k] for k in ("rank", "switch", "storage_bytes", "peak_memory_bytes",
                                                                "gc")}, loaded.controller.topology.control)
    out["dtype"] = str(dtype).replace("torch.", "")
    if ctx.rank == 0:
        out["images"] = [r.image for r in results]
        if args.check:  # the first request
            # The same experts' storage: FP8 scales belong to the official matrices, so the
            # single-process model quantizes every weight as the plan's ranks did.
            with reference_threads(ctx, device):
                reference = load(args.checkpoint, get_plan("single"), 0, 1, dtype, device,
                                 moe_impl="auto" if args.moe_dtype == "fp8" else "eager",
                                 moe_dtype=args.moe_dtype, fp8_scales=args.fp8_scales,
                                 image_editing=args.image is not None, dense_dtype=args.dense_dtype,
                                 attention_dtype=args.attention_dtype)
                ref_pipe = HunyuanT2IPipeline(reference.model, reference.tokenizer, reference.controller, device)
                ref_pipe.loras = resident_loras(reference, args, dtype)   # the same adapters, on one process
                ref = ref_pipe.generate(replace(requests[0], forced_tokens=result.tokens,
                                                forced_ratio=result.ratio_index))
            out["check"] = {
                "max_abs_diff_logits": max_diff(result.record["ar_logits"], ref.record["ar_logits"]),
                "max_abs_diff_velocity": max_diff(result.record["velocity"], ref.record["velocity"]),
                "max_abs_diff_latents": max_diff([result.latents], [ref.latents]),
                "max_abs_diff_image": max_diff([result.image], [ref.image]),
                "rel_l2_logits": rel_l2(result.record["ar_logits"], ref.record["ar_logits"]),
                "rel_l2_velocity": rel_l2(result.record["velocity"], ref.record["velocity"]),
            }
    return out


def _random_config(args) -> dict | None:
    return {"full": lambda: full_config(args.layers or 32),
            "full-distil": lambda: full_config(args.layers or 32, distilled=True),
            "tiny": lambda: tiny_config(args.layers or 2),
            None: lambda: None}[args.random_weights]()


def _fill_request_defaults(args) -> None:
    """--steps, --guidance, --flow-shift not given: the checkpoint's generation_config.json
    (diff_infer_steps, diff_guidance_scale, flow_shift: 8 steps on Instruct-Distil, say), else
    the official defaults."""
    path = Path(args.checkpoint) / "generation_config.json" if args.checkpoint else None
    generation = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    for key, attr, fallback in GENERATION_DEFAULTS:
        if getattr(args, attr) is None:
            setattr(args, attr, type(fallback)(generation.get(key, fallback)))


def _distilled_problem(args, config: dict) -> str | None:
    """A CFG-distilled checkpoint runs one row a step: no --cfg-mode, no plan with a cfg axis."""
    if not config.get("cfg_distilled"):
        return None
    if args.cfg_mode is not None:
        return ("--cfg-mode does not apply: this checkpoint is CFG-distilled (one row a step, the guidance "
                "embedded as a token)")
    plan = get_plan(args.plan)
    if plan.phases["denoise"].cfg:
        return (f"--plan {args.plan} splits the CFG branches over ranks, but this checkpoint is CFG-distilled "
                "(one row a step): choose a plan without a cfg axis")
    return None


def _attention_problem(args, config: dict) -> str | None:
    """--attention-dtype fp8 that every rank's load would refuse, as one line before any rank
    starts: an SP attention kind of the plan that would not run it, or a head over the kernel's
    size. (A GPU without FP8 is refused by load on each rank, before any weight is read, as for
    --dense-dtype: the launcher does not touch the device, hence the CPU here.)"""
    try:
        check_attention_dtype(args.attention_dtype, torch.device("cpu"),
                              tuple(phase.attention for phase in get_plan(args.plan).phases.values()))
    except ValueError as e:
        return str(e)
    return attention_head_problem(args.attention_dtype, HunyuanImage3Config.from_dict(config).head_dim)


def _budget_problem(args, config: dict) -> str | None:
    """--memory-budget GB that cannot hold a rank's weights, as one line, before any rank starts
    (the model on meta; nothing read)."""
    if args.memory_budget is None:
        return None
    if not args.memory_budget > 0:
        return f"--memory-budget must be > 0 GB, got {args.memory_budget}"
    device = torch.device(run_device_type(args))
    return memory_budget_problem(HunyuanImage3Config.from_dict(config), get_plan(args.plan), args.world_size,
                                 parse_dtype(args.dtype, device), args.moe_dtype, args.fp8_scales,
                                 getattr(args, "image_editing", args.image is not None),
                                 int(args.memory_budget * 1e9), args.vae_dtype,
                                 getattr(args, "dense_dtype", "model"))


def _lora_problem(args, config: dict) -> str | None:
    """The --lora flags' first problem as one line, before any rank starts: each file read and
    matched against the model's weights (names, shapes; routed experts refused), on meta."""
    problem = lora_problem(args)
    if problem is not None or not args.lora:
        return problem
    editing = getattr(args, "image_editing", args.image is not None)
    targets = lora_targets(HunyuanImage3Config.from_dict(config), editing)
    try:
        for text in args.lora:
            targets.match(read_lora(parse_lora_flag(text)[0]))
    except LoraError as e:
        return f"--lora: {e}"
    return None


def _check_args(args, plan) -> str | None:
    """The first problem with the command line, as one line, or None."""
    problem = launch_problem(args, plan) or compile_problem(args)
    if problem is not None:
        return problem
    if args.profile_steps is not None and not args.profile:
        return "--profile-steps needs --profile (it sets the profiled run's denoise steps)"
    if args.profile_top is not None and not args.profile:
        return "--profile-top needs --profile (it sets how many kernels the profile lists)"
    if args.profile_top is not None and args.profile_top < 1:
        return f"--profile-top must be at least 1, got {args.profile_top}"
    if args.fp8_scales is not None and args.moe_dtype != "fp8":
        return f"--fp8-scales {args.fp8_scales} needs --moe-dtype fp8 (the scales of FP8 experts)"
    args.fp8_scales = args.fp8_scales or "channels"
    problem = moe_impl_problem(args.moe_impl, args.fp8_scales if args.moe_dtype == "fp8" else None)
    if problem:
        return f"--moe-impl {args.moe_impl}: {problem}"
    if args.moe_token_chunk is not None and args.moe_token_chunk < 1:
        return f"--moe-token-chunk must be at least 1, got {args.moe_token_chunk}"
    if args.vae_chunks is not None and args.vae_chunks < 1:
        return f"--vae-chunks must be at least 1, got {args.vae_chunks}"
    if args.vae_chunks is not None and args.world_size > 1 and args.vae_parallel is not False:
        return ("--vae-chunks applies to a decode on one rank; with several ranks the decode is split over them "
                "(--vae-parallel): add --no-vae-parallel to decode on rank 0 in chunks")
    if args.vae_layout == "channels-last" and args.world_size > 1 and args.vae_parallel is not False:
        return ("--vae-layout channels-last applies to a decode on one rank; the decode split over several ranks "
                "(--vae-parallel) runs its halo convs NCDHW: add --no-vae-parallel, or leave --vae-layout at auto")
    if args.vae_parallel is not None and args.world_size == 1:
        flag = "--vae-parallel" if args.vae_parallel else "--no-vae-parallel"
        return f"{flag} splits the VAE decode over several ranks; this run has --world-size 1"
    if args.random_weights and (args.checkpoint or args.check):
        return ("--random-weights makes its own weights: it takes no --checkpoint and no --check "
                "(the single-process reference would have other random weights)")
    if args.layers is not None and not args.random_weights:
        return "--layers applies to --random-weights only"
    for flag, value, least in (("--layers", args.layers, 1), ("--prompt-bucket", args.prompt_bucket, 0)):
        if value is not None and value < least:
            return f"{flag} must be at least {least}, got {value}"
    _prompt_lengths(args.prompt_tokens)     # raises ValueError naming a bad length
    _step_cache(args)                       # raises ValueError naming a bad cache flag
    if args.prompt_tokens is not None and (args.prompt or args.prompts_file):
        return "--prompt-tokens makes its own prompts: give it, or --prompt / --prompts-file, not both"
    if args.prompts_file and not Path(args.prompts_file).is_file():
        return f"--prompts-file {args.prompts_file}: no such file"
    if args.prompts_file and not Path(args.prompts_file).read_text().strip():
        return f"--prompts-file {args.prompts_file}: no prompt in it (every line is blank)"
    if args.checkpoint:
        problem = checkpoint_problem("hunyuan-image3", args.checkpoint,
                                     "no config.json there (expected the official checkpoint folder)")
        if problem is not None:
            return problem
    if args.system_prompt and args.image is None:
        return "--system-prompt belongs to image editing: give --image too"
    if args.image is not None and args.prompt_tokens is not None:
        return "--image edits with a text prompt: give --prompt, not --prompt-tokens"
    return None


# The request fields' flags (their declarations': dtgen/schema.py): `T2IRequest.check` names
# fields, the CLI names flags.
_FLAG_OF_FIELD = schema.flag_names(T2IRequest)


def _request_problem(args, config: dict) -> str | None:
    """The first bad request setting, in the server's words with the CLI's flag, or None:
    every request's `check`, with the position budget where the tokenizer is at hand, so
    that a size the model cannot hold is one line here, not a traceback on a rank."""
    cfg = HunyuanImage3Config.from_dict(config)
    try:
        args.image_size_hw = size_to_hw(args.image_size, "image_size", cfg.image_base_size)
        # an edit's rows are checked by the pipeline
        tok = load_tokenizer(args.checkpoint, cfg) if not args.random_weights and args.image is None else None
        limits = Limits.of(cfg, tok)
        for req in _requests(args):
            req.check(limits)
    except RequestError as e:
        flags = dict(_FLAG_OF_FIELD, prompt="--prompt-tokens") if args.prompt_tokens is not None else _FLAG_OF_FIELD
        return flag_line(e, flags)
    return None


def _editing_problem(args, config: dict) -> str | None:
    """--image: the reference must be readable, and the checkpoint must hold what reads it.
    The image is read here, once (every rank gets it with the arguments)."""
    missing = [k for k in ("vit", "vit_aligner", "vit_processor") if not config.get(k)]
    if missing or (config.get("vae") or {}).get("only_decoder", True):
        what = f"no {', '.join(missing)} section" if missing else "a decoder-only VAE (only_decoder)"
        return f"--image needs a checkpoint that can read images (vision tower, VAE encoder); this one has {what}"
    try:
        args.reference = reference_tensor(load_reference_image(args.image))
    except ValueError as e:
        return f"--image: {e}"
    return None


def prepare(args) -> tuple[str | None, bool]:
    """Check the command line and fill the defaults that depend on it (the tiny checkpoint,
    --max-new-tokens): (the first problem as one line or None, whether the tiny default runs)."""
    tiny = args.checkpoint is None and not args.random_weights
    try:
        problem = _check_args(args, get_plan(args.plan)) or output_path_problem(args.output, "--output") \
            or image_path_problem(args.output) or output_path_problem(args.report, "--report") \
            or (None if args.checkpoint is None else unreadable(args.checkpoint))
        if args.max_new_tokens is None:
            args.max_new_tokens = 16 if tiny else 0
        if problem is None:
            if tiny:
                args.checkpoint = str(ensure_tiny_checkpoint())
            base = (_random_config(args) or json.loads((Path(args.checkpoint) / "config.json").read_text()))
            _fill_request_defaults(args)
            problem = _attention_problem(args, base)
            if args.image is not None:
                problem = problem or _editing_problem(args, base)
            problem = problem or _distilled_problem(args, base)
            shapes = _warmup_shapes(args.warmup_shapes, int(base.get("image_base_size", 1024))) or []
            if args.warmup_shapes and args.warmup is False and problem is None:
                problem = "--warmup-shapes needs the warm-up: drop --no-warmup"
            problem = problem or _longest_prompt_problem(args, [t for t, _ in shapes],
                                                         int(base.get("max_position_embeddings", 0)))
            problem = problem or _request_problem(args, base)
            problem = problem or _lora_problem(args, base)
            problem = problem or _budget_problem(args, base)
    except (KeyError, ValueError) as e:
        problem = e.args[0]
    return problem, tiny


def main(argv=None, prog: str = "dtgen run --model hunyuan-image3") -> int:
    return example_main(parse_args(argv, prog), prepare, run_rank, write_report, RANK_PRELOAD)


# ---- served (`dtgen serve`, the registry's contract: dtgen/registry.py) ----------
def serve_problem(args) -> str | None:
    """After `prepare`: --edits against what the checkpoint holds (the default: edits when it can)."""
    config = {} if args.random_weights else json.loads((Path(args.checkpoint) / "config.json").read_text())
    can = all(config.get(k) for k in ("vit", "vit_aligner", "vit_processor")) and \
        not (config.get("vae") or {}).get("only_decoder", True)
    if args.edits and not can:
        return "--edits needs a checkpoint with a vision tower and a VAE encoder; this one has none"
    args.image_editing = can if args.edits is None else args.edits
    return None


def serve_adapter(ctx: RankContext, args: argparse.Namespace, max_batch: int):
    """This rank's pipeline behind the server; the flags' request holds the defaults."""
    from models.hunyuan_image3.serving import HunyuanServeAdapter
    pipe, loaded, _, dtype = build_pipeline(ctx, args)
    if pipe.loras is None and loaded.lora_prefixes:   # adapters loaded by name while serving (POST /v1/loras)
        pipe.loras = ResidentLoras(loaded, dtype)
    return HunyuanServeAdapter(pipe, ctx.rank, request_from_args(args), warmup=args.warmup is not False,
                               warmup_shapes=_warmup_shapes(args.warmup_shapes, loaded.model.cfg.image_base_size),
                               warmup_batch=max_batch)


def _cache_line(report: dict, t: dict) -> str:
    full, cached = report["full_steps"], report["cached_steps"]
    times = "".join(f", {what} {t[key]:.1f} ms" for what, key in (("full step", "denoise_full_step"),
                                                                 ("cached step", "denoise_cached_step")) if key in t)
    return f"{report['method']}: {len(full)} full steps {full}, {len(cached)} cached{times}"


def write_report(args, main_result: dict, tiny: bool) -> dict:
    """The PNG, the printed table and (with --report) the JSON, from rank 0's result."""
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    images = main_result["images"]
    paths = [out] + [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(1, len(images))]
    # each request's image written as the server answers it (bench_serve compares the two)
    write_ms = [round(save_image(path, to_uint8(image)), 3) for image, path in zip(images, paths)]
    for request, ms in zip(main_result["requests"], write_ms):
        request["image_write_ms"] = ms

    ranks = main_result["ranks"]
    t = main_result["timings_ms"]
    switch = max((r["switch"] for r in ranks), key=lambda s: s["ms"])
    report = {
        "plan": args.plan, "world_size": args.world_size, "device": main_result["device"],
        "dtype": main_result["dtype"], "torch": torch.__version__,
        "moe_dtype": args.moe_dtype if args.moe_dtype == "model" else f"{args.moe_dtype}-{args.fp8_scales}",
        "vae_dtype": args.vae_dtype or "checkpoint", "vae_chunks": args.vae_chunks or 1,
        "vae_layout": args.vae_layout, "kv_caches": args.kv_caches,
        "moe_token_chunk": args.moe_token_chunk, "memory_budget_gb": args.memory_budget,
        "dense_dtype": args.dense_dtype, "attention_dtype": args.attention_dtype,
        "loras": args.lora or [], "lora_merge": args.lora_merge,
        "cfg_mode": args.cfg_mode,      # None: the default (serial; one row on a CFG-distilled checkpoint)
        "checkpoint": "tiny-default" if tiny else (f"random:{args.random_weights}:{args.layers or 32}-layers"
                                                   if args.random_weights else args.checkpoint),
        "timings_ms": {k: t.get(k, 0.0) for k in ("ar_prefill", "ar_decode_per_token", "denoise_step",
                                                  "denoise_first_step", "vae_decode", "total")
                       + tuple(k for k in ("condition_encode", "denoise_full_step", "denoise_cached_step") if k in t)},
        "step_cache": main_result["step_cache"],
        "edit": None if args.image is None else {"image": args.image, "system_prompt": args.system_prompt},
        "warmup_ms": main_result["warmup_ms"],
        # process start (this rank's) to the end of the first denoise step of the run (warm-up included)
        "first_denoise_step_done_s": main_result["first_denoise_step_done_s"],
        "tokens_generated": len(main_result["tokens"]), "image_size": list(main_result["image_size"]),
        "steps": args.steps, "phase_switch": switch,
        "storage_bytes_per_rank": [r["storage_bytes"] for r in ranks],
        "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks],
        "gc_pauses_per_rank": [r["gc"] for r in ranks],
        "requests": main_result["requests"],
    }
    if "check" in main_result:
        report["check"] = main_result["check"]
    if main_result["compile"] is not None:
        report["compile"] = main_result["compile"]
    if main_result["profile"] is not None:
        report["profile"] = {"dir": args.profile, "traces": main_result["profile"]["traces"],
                             "regions": main_result["profile"]["regions"],
                             "top_kernels": main_result["profile"]["top_kernels"]}
    h, w = main_result["image_size"]   # printed WIDTHxHEIGHT, as --image-size reads it
    peak = [r["peak_memory_bytes"] for r in ranks]
    rows = [("plan", f"{args.plan} on {args.world_size} rank(s), {main_result['device']}, {main_result['dtype']}"),
            ("warm-up run", "off (first-call compilation and JIT are inside the figures)" if main_result["warmup_ms"]
             is None else f"{main_result['warmup_ms']:9.1f} ms (compilation and first-call JIT; not in the figures)"),
            *([("condition encode", f"{t['condition_encode']:9.1f} ms (the reference image, once)")]
              if "condition_encode" in t else []),
            ("AR prefill", f"{t.get('ar_prefill', 0):9.1f} ms"),
            ("AR decode", f"{t.get('ar_decode_per_token', 0):9.2f} ms/token ({len(main_result['tokens'])} tokens)"),
            ("phase switch", f"{switch['ms']:9.2f} ms (agreement {switch['agree_ms']:.2f}), "
                             f"weights copied {switch['weights_copied']}, "
                             f"allocated {switch['allocated_bytes_delta']} B, "
                             f"param bytes {switch['param_bytes_before']} -> {switch['param_bytes_after']}"),
            ("denoise", f"{t.get('denoise_step', 0):9.1f} ms/step ({args.steps} steps, {w}x{h}; "
                        f"the first, whole-sequence step {t.get('denoise_first_step', 0):.1f} ms)"),
            *([("step cache", _cache_line(main_result["step_cache"], t))] if main_result["step_cache"] else []),
            ("VAE decode", f"{t.get('vae_decode', 0):9.1f} ms"),
            ("total", f"{t.get('total', 0):9.1f} ms")]
    if all(p is not None for p in peak):
        rows.append(("memory / rank", ", ".join(f"{r['storage_bytes'] / 1e9:.1f} GB weights, "
                                                f"{r['peak_memory_bytes'] / 1e9:.1f} GB peak" for r in ranks)))
    rows.append(("host GC pauses", "; ".join(f"{sum(g['collections_by_generation'])} ({g['max_ms']:.1f} ms max)"
                                              for g in report["gc_pauses_per_rank"]) + " in the timed run"))
    if "compile" in report:
        c = report["compile"]
        graph = "CUDA-graph decode" if c["decode_cuda_graph"] else "decode not CUDA-graphed"
        rows.append(("compile", f"{c['graphs']} graphs, {c['graph_breaks']} breaks, "
                                f"{c['recompiles_after_warmup']} recompiles after warm-up, {c['compile_s']:.1f} s; "
                                f"{graph}{', %d cudagraph skips' % c['cudagraph_skips'] if c['cudagraph_skips'] else ''}"))
    if "profile" in report:
        for phase, regions in report["profile"]["regions"].items():
            for r in regions:
                u = r["per_unit_ms"]
                wait = f", waiting {u['waiting_ms']:.3f}" if "waiting_ms" in u else ""
                rows.append((f"profile {r['region']}", f"per unit (x{r['units']}): {u['wall_ms']:.3f} ms = compute "
                                                       f"{u['compute_ms']:.3f} + comm {u['communication_ms']:.3f}"
                                                       f"{wait} + idle {u['idle_ms']:.3f}"))
    if "check" in report:
        rows += [(f"check {k}", f"{v:.3e}") for k, v in report["check"].items()]
    if len(main_result["requests"]) > 1:
        for i, r in enumerate(main_result["requests"]):
            rt = r["timings_ms"]
            rows.append((f"request {i}", f"{r['prompt_tokens']} prompt tokens, AR {rt.get('ar_decode_per_token', 0):.2f} "
                                         f"ms/token, denoise {rt.get('denoise_step', 0):.1f} ms/step, total "
                                         f"{rt.get('total', 0):.1f} ms, {r['new_graphs']} new graphs"
                                         + (f" ({r['compile_s']:.1f} s compiling)" if r["new_graphs"] else "")))
    print(table(rows))
    print("wrote " + ", ".join(str(p) for p in paths))
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.report}")
    return report

