"""LoRA at inference (dtgen/lora): what an unmerged adapter costs a DiT step, what loading and switching
adapters cost, and what serving rows with different adapters in one batch gains.

`--measure step` (`--model wan --size 14B-8`: Wan's published 14B width at 8 blocks, 480p x 81 frames;
`--model hunyuan-image3 --layers N`: the released shapes at N layers, 1251 prompt tokens, 256 forced AR
tokens, 1024x1024): random weights built through dtgen's build (`--dense-dtype fp8`, `--attention-dtype
fp8`, HunyuanImage-3's `--moe-dtype fp8`), a random rank-`--rank` adapter file in diffusers' layout
(`transformer.<module>.lora_A/B.weight`, rank and alpha in its header) on every attention and MLP linear
of the blocks that takes a pair (HunyuanImage-3's routed experts take none: its attention and shared
MLP do), loaded through `ResidentLoras.load`. The DiT step is timed with no adapter and with the adapter
unmerged, the two interleaved (ABAB, `--repeats` rounds of `--iters`, warm-up excluded), in each of
`--modes`: eager and compiled (the product's mode: one region per block on a GPU, the whole step on the
CPU); then with the adapter merged into the weights (not on FP8 weights). Wan: the DiT forward through
the denoise loop's calls (dtgen/denoiser_calls.py); HunyuanImage-3: whole requests, each one's mean
denoise step after its first. Per case the median and range, the overhead over no adapter, and the
delta's extra FLOPs (2 rows r (in + out) per targeted linear) against the targeted linears' own.
`--measure load`: `ResidentLoras.load` of the same file into the built model (file read, checks, shard,
device copy; the first load apart, then the median of `--iters` with an unload between), and switching
the rows of the next step to an already-resident adapter (`set_rows`: a uniform batch and a batch of
four rows with four adapters).
`--measure batch` (CPU, the tiny default of `--model wan` or `qwen-image`, float32): four requests with
four different rank-`--rank` adapters as one batch (`generate_batch`, what the server's engine runs
with --max-batch 4) against four batches of one, and the same requests without adapters both ways,
interleaved (`--repeats` rounds): images per minute of each, the ratios, each phase's time (encode,
denoise, decode), and a cProfile of one of each; the batch's outputs are asserted equal to each
request alone.
`--tiny`: step and load on the CPU at the tiny size, float32 (a check that it runs); `--cpu`: on the CPU at
`--size` (`--layers` fewer blocks: a load's time grows with the blocks' pairs).
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.harness import Bench, summary, sync, time_ms

MODULE = "bench.bench_lora"
MEASURES = ("step", "load", "batch")
STEP_MODELS = ("wan", "hunyuan-image3")
BATCH_MODELS = ("wan", "qwen-image")
MODES = ("eager", "compiled")
# The blocks' part of each model's module tree: the attention and MLP linears an adapter targets there.
BLOCKS = {"wan": "transformer.blocks.", "hunyuan-image3": "model.layers.",
          "qwen-image": "transformer.transformer_blocks."}
KINDS = ("attn", "mlp", "ffn")   # a linear under one of these is an attention or MLP linear (not a modulation)
BATCH = 4
# Each flag past the measure and model, and the runs ("MEASURE MODEL") that use it: any other run refuses it.
_STEP_LOAD = ("step wan", "step hunyuan-image3", "load wan")
FLAG_USE = {"--size": ("step wan", "load wan"), "--layers": _STEP_LOAD, "--rank": _STEP_LOAD + tuple(
    f"batch {m}" for m in BATCH_MODELS), "--batch": ("step wan",), "--modes": _STEP_LOAD[:2],
    "--dense-dtype": _STEP_LOAD, "--attention-dtype": _STEP_LOAD, "--moe-dtype": ("step hunyuan-image3",),
    "--hy-steps": ("step hunyuan-image3",), "--warmup": ("step wan",), "--iters": ("step wan", "load wan"),
    "--repeats": _STEP_LOAD[:2] + tuple(f"batch {m}" for m in BATCH_MODELS), "--tiny": _STEP_LOAD,
    "--cpu": _STEP_LOAD}


# ---- the adapter file -----------------------------------------------------------------------------------
def targets(loras, model: str) -> dict[str, tuple[str, tuple[int, int]]]:
    """The blocks' attention and MLP linears that take a pair: module -> (checkpoint key, [out, in])."""
    return {m: t for m, t in loras.pair_targets().items()
            if m.startswith(BLOCKS[model]) and any(k in part for part in m.split(".") for k in KINDS)}


def file_path(key: str, prefixes: dict[str, str]) -> str:
    """The module path a diffusers file names for checkpoint `key` (the model's LoRA name map read
    backwards: its longest prefixed entry whose checkpoint prefix `key` starts with)."""
    for prefix, target in sorted(prefixes.items(), key=lambda kv: -len(kv[0])):
        if prefix and key.startswith(target):
            return prefix + key[len(target):].removesuffix(".weight")
    raise ValueError(f"{key}: no prefixed entry of the LoRA name map {prefixes} covers it")


def write_adapter(path: Path, pairs: dict[str, tuple[str, tuple[int, int]]], prefixes: dict[str, str], rank: int,
                  seed: int, dtype: torch.dtype) -> Path:
    """A random rank-`rank` adapter on `pairs` in diffusers' layout (alpha = r: scale 1), B non-zero."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, (out, inp) in pairs.values():
        name = file_path(key, prefixes)
        tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) / inp ** 0.5).to(dtype)
        tensors[f"{name}.lora_B.weight"] = (0.01 * torch.randn(out, rank, generator=g)).to(dtype)
    header = {"lora_adapter_metadata": json.dumps({"transformer.r": rank, "transformer.lora_alpha": rank})}
    save_file(tensors, str(path), metadata=header)
    return path


def delta_flops(model_tree, pairs, rank: int, fn, counted=lambda: True, per: int = 1) -> dict:
    """One call of `fn` with hooks counting each targeted linear's rows (while `counted()`; divided
    by `per`: a request's steps): the delta's FLOPs (2 rows r (in + out)) and the linears' own (2 rows
    in out)."""
    rows: dict[str, int] = {}
    modules = dict(model_tree.named_modules())

    def count(m, x):
        if counted():
            rows[m] = rows.get(m, 0) + x.numel() // x.shape[-1] // per
    hooks = [modules[m].register_forward_pre_hook(lambda _m, args, m=m: count(m, args[0])) for m in pairs]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    delta = sum(2 * rows.get(m, 0) * rank * (inp + out) for m, (_, (out, inp)) in pairs.items())
    base = sum(2 * rows.get(m, 0) * inp * out for m, (_, (out, inp)) in pairs.items())
    return {"targeted_linears": len(pairs), "delta_flops": delta, "targeted_linear_flops": base,
            "delta_over_targeted": delta / base if base else None}


# ---- models for step and load ---------------------------------------------------------------------------
class WanStep:
    """Wan's DiT at a peer size (bench_peers), built with random weights through dtgen's build; one
    step: the denoise call's prediction (dtgen/denoiser_calls.py), on the denoise phase."""

    def __init__(self, args, device, dtype):
        from bench.bench_peers import WanPeer, wan_config
        from dtgen.build import build
        from dtgen.layers.t5 import UMT5Config
        from dtgen.layers.wan_vae import WanVAEConfig
        from models.wan.model import WanAdapter, WanConfigs
        from models.wan.tiny import tiny_configs
        from placements.wan import get_plan
        tiny = args.size == "tiny"
        shape = dict(WanPeer.sizes[args.size], **({"num_layers": args.layers} if args.layers else {}))
        text_dim = 64 if tiny else 4096
        cfg = wan_config(**shape, text_dim=text_dim)
        small = tiny_configs()   # the text encoder and VAE stay tiny: the step runs the DiT alone
        cfgs = WanConfigs(UMT5Config.from_dict(small["text_encoder"]), cfg, WanVAEConfig.from_dict(small["vae"]))
        self.built = build(WanAdapter(cfgs), get_plan("single"), None, 0, 1, dtype, device,
                           dense_dtype=args.dense_dtype, attention_dtype=args.attention_dtype)
        self.dit = self.built.model.transformer
        self.plain_block = self.dit.run_block
        frames, height, width = (3, 6, 8) if tiny else (21, 60, 104)   # 480x832 x 81 frames
        g = torch.Generator(device=device).manual_seed(1)
        self.x = torch.randn(args.batch, cfg.in_channels, frames, height, width, generator=g, device=device).to(dtype)
        self.t = torch.full((args.batch,), 500.0, device=device)
        self.text = torch.randn(args.batch, 16 if tiny else 512, text_dim, generator=g, device=device).to(dtype)
        self.shape = {"size": args.size, "config": shape, "latent": [cfg.in_channels, frames, height, width],
                      "tokens": frames * height * width // 4, "text_rows": self.text.shape[1], "batch": args.batch}
        self.device = device

    def step_fn(self, compiled: bool):
        """The step as the pipeline calls it, eager or in the product's compile mode (regions on a
        GPU, the whole step on the CPU); the denoise phase stays bound."""
        from dtgen.compile import CompileOptions
        from dtgen.compiled_steps import CompiledSteps
        from dtgen.denoiser_calls import DenoiserCalls
        self.dit.run_block = self.plain_block
        steps = CompiledSteps(CompileOptions(enabled=compiled, regions=self.device.type == "cuda"), self.device)
        calls = DenoiserCalls(steps, [self.dit])
        rt = self.built.controller.activate("denoise")
        return lambda: calls(rt, self.dit, self.x, self.t, self.text).predict()


# ---- --measure step ---------------------------------------------------------------------------------------
def _graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _wan_built(args, device, dtype):
    """Wan's DiT at `args.size` with random weights, its (empty) resident adapters, the linears a
    pair may target, a folder for adapter files, and the build's seconds."""
    from dtgen.lora import ResidentLoras
    t0 = time.perf_counter()
    model = WanStep(args, device, dtype)
    build_s = time.perf_counter() - t0
    loras = ResidentLoras(model.built, dtype)
    return model, loras, targets(loras, "wan"), Path(tempfile.mkdtemp(prefix="lora-bench-")), build_s


def wan_step(b: Bench, args, device, dtype) -> dict:
    from dtgen.lora import LoraError
    model, loras, pairs, folder, build_s = _wan_built(args, device, dtype)
    path = write_adapter(folder / "adapter.safetensors", pairs, loras.prefixes, args.rank, 1, dtype)
    loras.load("a", path)
    result = {"model": "wan", "shape": model.shape, "build_s": round(build_s, 1), "rank": args.rank,
              "adapter_bytes": path.stat().st_size, "cases": {}, "complete": False}
    with torch.no_grad():
        loras.set_default((("a", 1.0),))
        eager = model.step_fn(False)
        result["flops"] = delta_flops(model.built.model, pairs, args.rank, eager)
        unmerged = eager().float()
        loras.set_default(())
        plain = eager().float()
        # the adapter's effect on the step's output (the timed work is not a no-op)
        result["adapter_moves_output_rel_l2"] = float((unmerged - plain).norm() / plain.norm())
        for mode in args.modes:
            fn = model.step_fn(mode == "compiled")
            cases = {"none": (), "unmerged": (("a", 1.0),)}
            first, graphs = {}, {}
            for case, adapters in cases.items():   # each case's first calls (compiling, in compiled mode)
                loras.set_default(adapters)
                t0 = time.perf_counter()
                fn()
                sync(device)
                first[case] = round(time.perf_counter() - t0, 2)
                time_ms(fn, 0, args.warmup, device)
            before = _graphs()
            times = {case: [] for case in cases}
            for _ in range(args.repeats):   # ABAB: load on the machine hits both alike
                for case, adapters in cases.items():
                    loras.set_default(adapters)
                    times[case] += time_ms(fn, args.iters, 1, device)
            graphs = _graphs() - before
            for case in cases:
                result["cases"][f"{mode}/{case}"] = {**summary(times[case]), "times_ms": times[case],
                                                     "first_call_s": first[case]}
            result["cases"][f"{mode}/unmerged"]["overhead_pct"] = _overhead(times, "unmerged")
            result["cases"][f"{mode}/unmerged"]["graphs_after_warmup"] = graphs
            _print(mode, result["cases"], ("none", "unmerged"))
            b.write(result, device, quiet=True)
        loras.set_default(())
        try:   # merged: the adapter folded into the weights (then no per-step work is left)
            loras.unload("a")
            loras.merge(path, 1.0)
        except LoraError as e:
            result["merged"] = f"not measured: {e}"
        else:
            merged = model.step_fn(False)().float()
            result["merged_vs_unmerged_rel_l2"] = float((merged - unmerged).norm() / unmerged.norm())
            for mode in args.modes:
                fn = model.step_fn(mode == "compiled")
                t0 = time.perf_counter()
                fn()
                sync(device)
                first_s = round(time.perf_counter() - t0, 2)
                times = time_ms(fn, args.iters * args.repeats, args.warmup, device)
                none = result["cases"][f"{mode}/none"]["median"]
                result["cases"][f"{mode}/merged"] = {**summary(times), "times_ms": times, "first_call_s": first_s,
                                                     "overhead_pct": 100 * (statistics.median(times) / none - 1)}
                _print(mode, result["cases"], ("merged",))
    model.dit.run_block = model.plain_block
    return result


def hunyuan_step(b: Bench, args, device, dtype) -> dict:
    """HunyuanImage-3: whole requests (AR forced, then the denoise steps); a step's time is the
    request's mean denoise step after its first (the pipeline's `denoise_step` timing)."""
    from dtgen.compile import CompileOptions
    from dtgen.lora import LoraError, ResidentLoras
    from models.hunyuan_image3.loading import load
    from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
    from models.hunyuan_image3.presets import full_config
    from models.hunyuan_image3.requests import T2IRequest, filler_ids
    from models.hunyuan_image3.tiny import tiny_config
    from placements.hunyuan_image3 import get_plan
    tiny = args.size == "tiny"
    t0 = time.perf_counter()
    loaded = load(None, get_plan("single"), 0, 1, dtype, device, random_config=tiny_config(args.layers or 2)
                  if tiny else full_config(args.layers or 8), moe_dtype=args.moe_dtype,
                  dense_dtype=args.dense_dtype, attention_dtype=args.attention_dtype)
    build_s = time.perf_counter() - t0
    loras = ResidentLoras(loaded, dtype)
    pairs = targets(loras, "hunyuan-image3")
    folder = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    path = write_adapter(folder / "adapter.safetensors", pairs, loras.prefixes, args.rank, 1, dtype)
    loras.load("a", path)
    tokens = 4 if tiny else 256
    req = T2IRequest(prompt_ids=filler_ids(30 if tiny else 1250), max_new_tokens=tokens, ignore_stop=True,
                     forced_tokens=filler_ids(tokens), image_size="256x256" if tiny else "1024x1024", seed=1,
                     steps=args.hy_steps)
    result = {"model": "hunyuan-image3", "targeted_linears": len(pairs), "shape": {"layers": args.layers or (2 if tiny else 8), "tiny": tiny,
                                                   "image_size": req.image_size, "prompt_tokens": 1251 if not tiny
                                                   else 31, "ar_tokens": tokens, "steps": req.steps},
              "build_s": round(build_s, 1), "rank": args.rank, "adapter_bytes": path.stat().st_size,
              # compiled on a GPU, the AR decode replays as a CUDA graph, one recording per adapter set
              # (`ResidentLoras.graph_key`): requests with and without the adapter alternate in one pipeline
              "decode_cuda_graph": device.type == "cuda", "cases": {}, "complete": False}

    def pipeline(compiled: bool):
        pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                                  compile_options=CompileOptions(enabled=compiled, regions=device.type == "cuda"))
        if args.size == "tiny":
            pipe.decode_image = lambda latents: None   # the VAE is no part of the step
        pipe.loras = loras
        return pipe

    def step_ms(pipe, adapters) -> float:
        return pipe.generate(replace(req, loras=adapters)).timings_ms["denoise_step"]

    cases = {"none": (), "unmerged": (("a", 1.0),)}
    with torch.no_grad():
        # a denoise step's rows through each targeted linear (the request's denoise calls over its steps)
        eager = pipeline(False)
        result["flops"] = delta_flops(loaded.model, pairs, args.rank, lambda: step_ms(eager, (("a", 1.0),)),
                                      lambda: loaded.controller.active == "denoise", req.steps)
        del eager
        for mode in args.modes:
            pipe = pipeline(mode == "compiled")
            first = {}
            for case, adapters in cases.items():
                t0 = time.perf_counter()
                step_ms(pipe, adapters)
                first[case] = round(time.perf_counter() - t0, 2)
            before = _graphs()
            times = {case: [] for case in cases}
            for _ in range(args.repeats):
                for case, adapters in cases.items():
                    times[case].append(step_ms(pipe, adapters))
            for case in cases:
                result["cases"][f"{mode}/{case}"] = {**summary(times[case]), "times_ms": times[case],
                                                     "first_request_s": first[case]}
            result["cases"][f"{mode}/unmerged"]["overhead_pct"] = _overhead(times, "unmerged")
            result["cases"][f"{mode}/unmerged"]["graphs_after_warmup"] = _graphs() - before
            _print(mode, result["cases"], ("none", "unmerged"))
            b.write(result, device, quiet=True)
            del pipe
        try:
            loras.unload("a")
            loras.merge(path, 1.0)
        except LoraError as e:
            result["merged"] = f"not measured: {e}"
        else:
            for mode in args.modes:
                pipe = pipeline(mode == "compiled")
                step_ms(pipe, ())
                times = [step_ms(pipe, ()) for _ in range(args.repeats)]
                none = result["cases"][f"{mode}/none"]["median"]
                result["cases"][f"{mode}/merged"] = {**summary(times), "times_ms": times,
                                                     "overhead_pct": 100 * (statistics.median(times) / none - 1)}
                _print(mode, result["cases"], ("merged",))
    return result


def _overhead(times: dict[str, list[float]], case: str) -> dict:
    """The case over no adapter in %: of the medians, and the range of the paired rounds' ratios."""
    ratios = [a / b for a, b in zip(times[case], times["none"])]
    return {"of_medians": 100 * (statistics.median(times[case]) / statistics.median(times["none"]) - 1),
            "paired_min": 100 * (min(ratios) - 1), "paired_max": 100 * (max(ratios) - 1)}


def _print(mode: str, cases: dict, names) -> None:
    for name in names:
        row = cases[f"{mode}/{name}"]
        over = row.get("overhead_pct")
        over = over["of_medians"] if isinstance(over, dict) else over
        extra = "" if over is None else f"  {over:+.2f}% over no adapter"
        print(f"{mode:8s} {name:9s} {row['median']:10.2f} ms [{row['min']:.2f}, {row['max']:.2f}]{extra}", flush=True)


# ---- --measure load ---------------------------------------------------------------------------------------
def load_times(b: Bench, args, device, dtype) -> dict:
    model, loras, pairs, folder, build_s = _wan_built(args, device, dtype)
    paths = [write_adapter(folder / f"adapter{k}.safetensors", pairs, loras.prefixes, args.rank, k + 1, dtype)
             for k in range(BATCH)]

    def load_ms(name: str, path: Path) -> float:
        sync(device)
        t0 = time.perf_counter()
        loras.load(name, path)
        sync(device)
        return (time.perf_counter() - t0) * 1e3

    first = load_ms("a", paths[0])   # the file's first read since it was written (page cache warm)
    loras.unload("a")
    loads = []
    for _ in range(args.iters):
        loads.append(load_ms("a", paths[0]))
        loras.unload("a")
    for k, path in enumerate(paths):
        loras.load(f"a{k}", path)
    resident = loras.adapters["a0"]

    def switch_us(rows_of) -> dict:
        """`set_rows` to rows whose adapters differ from the last call's: what a step of a request with
        another resident adapter does before its first evaluation."""
        times = []
        for i in range(200):
            rows = rows_of(i)
            t0 = time.perf_counter()
            loras.set_rows(rows)
            times.append((time.perf_counter() - t0) * 1e6)
        loras.set_rows(None)
        return summary(times)

    result = {"model": "wan", "shape": {"size": args.size, "config": model.shape["config"]},
              "build_s": round(build_s, 1), "rank": args.rank, "targeted_linears": len(pairs),
              "adapter_bytes": paths[0].stat().st_size, "resident_bytes": resident.nbytes,
              "first_load_ms": first, "load_ms": {**summary(loads), "times_ms": loads},
              "switch_uniform_us": switch_us(lambda i: [((f"a{i % BATCH}", 1.0),)]),
              "switch_mixed_4_rows_us": switch_us(
                  lambda i: [((f"a{(i + k) % BATCH}", 1.0),) for k in range(BATCH)]),
              "what": "load: ResidentLoras.load (file read, checks, shard, device copy), unloaded between; "
                      "switch: set_rows to rows carrying another resident adapter (no weight is read or copied; "
                      "the mixed rows' per-row weight table [rows, adapters] is made and sent to the device)"}
    print(f"load of a rank-{args.rank} adapter ({len(pairs)} linears, {result['adapter_bytes'] / 1e6:.1f} MB): "
          f"first {first:.1f} ms, median {result['load_ms']['median']:.1f} ms "
          f"[{result['load_ms']['min']:.1f}, {result['load_ms']['max']:.1f}]; switch: uniform "
          f"{result['switch_uniform_us']['median']:.1f} us, 4 mixed rows "
          f"{result['switch_mixed_4_rows_us']['median']:.1f} us", flush=True)
    return result


# ---- --measure batch --------------------------------------------------------------------------------------
def _tiny_pipeline(model: str):
    """The tiny default's pipeline on one CPU process, float32, and its default request."""
    from dtgen.lora import ResidentLoras
    if model == "wan":
        from models.wan.model import load
        from models.wan.pipeline import T2VRequest as Request, WanT2VPipeline as Pipeline
        from models.wan.tiny import ensure_tiny_checkpoint
        from placements.wan import get_plan
        request = Request(prompt="A red fox runs through fresh snow at golden hour, cinematic", height=48, width=64,
                          num_frames=9, steps=4)
    else:
        from models.qwen_image.model import load
        from models.qwen_image.pipeline import QwenImagePipeline as Pipeline, T2IRequest as Request
        from models.qwen_image.tiny import ensure_tiny_checkpoint
        from placements.qwen_image import get_plan
        request = Request(prompt="A red fox runs through fresh snow at golden hour", height=48, width=64, steps=4)
    loaded = load(ensure_tiny_checkpoint(), get_plan("single"))
    pipe = Pipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    pipe.loras = ResidentLoras(loaded, torch.float32)
    return pipe, loaded, request


def _profile(fn, top: int = 14) -> list[str]:
    """cProfile of one call of fn: its `top` functions by their own time."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [line.rstrip() for line in out.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return lines[start:start + top + 1]


def _quiet(*_):
    return None


def batch_ratio(b: Bench, args) -> dict:
    from dtgen.batching import per_member
    torch.manual_seed(0)
    pipe, loaded, request = _tiny_pipeline(args.model)
    pairs = targets(pipe.loras, args.model)
    folder = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    for k in range(BATCH):
        pipe.loras.load(f"a{k}", write_adapter(folder / f"a{k}.safetensors", pairs, pipe.loras.prefixes, args.rank,
                                               k + 1, torch.float32))
    requests = [replace(request, seed=10 + k, loras=((f"a{k}", 1.0),)) for k in range(BATCH)]
    hooks = per_member([_quiet] * BATCH)

    def together():
        return pipe.generate_batch(requests, hooks)

    def alone():
        return [pipe.generate(r) for r in requests]

    plain = [replace(r, loras=()) for r in requests]   # the same requests without their adapters

    def together_plain():
        return pipe.generate_batch(plain, hooks)

    def alone_plain():
        return [pipe.generate(r) for r in plain]

    with torch.no_grad():
        got, want = together(), alone()   # warm-up, and the check: the batch's rows equal each request alone
        worst = {}
        for k, (g, w) in enumerate(zip(got, want)):
            for what in ("latents", "image", "video"):
                a, c = getattr(g, what, None), getattr(w, what, None)
                if a is None or c is None:
                    continue
                a, c = torch.as_tensor(a).float(), torch.as_tensor(c).float()
                err = float((a - c).norm() / c.norm().clamp_min(1e-30))
                worst[what] = max(worst.get(what, 0.0), err)
                assert err < 1e-4, f"request {k}: the batch's {what} differ from it alone (rel L2 {err:.2e})"
        base = pipe.generate(replace(requests[0], loras=()))
        moved = float((base.latents - want[0].latents).norm() / want[0].latents.norm())
        rounds = []
        for _ in range(args.repeats):   # ABAB in one process: load on the machine hits both alike
            row = {}
            for name, fn in (("batch_of_4", together), ("four_of_1", alone), ("batch_of_4_no_adapters", together_plain),
                             ("four_of_1_no_adapters", alone_plain)):
                t0 = time.perf_counter()
                results = fn()
                row[name] = {"s": time.perf_counter() - t0,
                             "phases_ms": {k: round(sum(r.timings_ms.get(k, 0.0) for r in results)
                                                    / (len(results) if name.startswith("batch") else 1), 2)
                                           for k in ("encode", "denoise", "decode")}}
            row["ratio"] = row["four_of_1"]["s"] / row["batch_of_4"]["s"]
            row["ratio_no_adapters"] = row["four_of_1_no_adapters"]["s"] / row["batch_of_4_no_adapters"]["s"]
            rounds.append(row)
            print(f"batch of 4: {row['batch_of_4']['s']:.2f} s {row['batch_of_4']['phases_ms']}, four of 1: "
                  f"{row['four_of_1']['s']:.2f} s {row['four_of_1']['phases_ms']}: {row['ratio']:.2f}x (no adapters: "
                  f"{row['ratio_no_adapters']:.2f}x)", flush=True)
        profiles = {"batch_of_4": _profile(together), "four_of_1": _profile(alone)}
    ratios = [r["ratio"] for r in rounds]
    per_min = {name: summary([BATCH * 60 / r[name]["s"] for r in rounds]) for name in rounds[0]
               if isinstance(rounds[0][name], dict)}
    phases = {name: {k: statistics.median(r[name]["phases_ms"][k] for r in rounds)
                     for k in rounds[0][name]["phases_ms"]} for name in per_min}
    return {"model": args.model, "request": {k: v for k, v in vars(request).items() if k not in ("loras",)},
            "rank": args.rank, "adapters": BATCH, "targeted_linears": len(pairs), "threads": torch.get_num_threads(),
            "images_per_min": per_min, "ratio": summary(ratios), "target_ratio": 3.0,
            "ratio_no_adapters": summary([r["ratio_no_adapters"] for r in rounds]),
            # where the time goes: each phase's median ms (a batch: the batch's; four of 1: the sum of the four)
            "phases_ms": phases,
            "batch_equals_alone_rel_l2": worst, "adapter_moves_latents_rel_l2": moved, "rounds": rounds,
            "profile_top_tottime": profiles}


# ---- the command ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    from bench.bench_peers import WanPeer
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--measure", required=True, choices=MEASURES)
    p.add_argument("--model", default="wan", help=f"step: one of {STEP_MODELS}; load: wan; batch: one of "
                                                  f"{BATCH_MODELS}")
    p.add_argument("--size", default="14B-8", help=f"wan: one of {sorted(WanPeer.sizes)} (bench_peers' sizes)")
    p.add_argument("--layers", type=int, default=None,
                   help="blocks (wan: default the size's; hunyuan-image3: default 8 of the released 32)")
    p.add_argument("--rank", type=int, default=None, help="the adapters' rank (default: 64; batch: 4)")
    p.add_argument("--batch", type=int, default=1, help="wan step: rows a forward (2: both CFG rows at once)")
    p.add_argument("--modes", default="eager,compiled", help=f"step: comma-separated, of {MODES}")
    p.add_argument("--dense-dtype", choices=("model", "fp8"), default="model",
                   help="the blocks' linears in e4m3 (the FP8 base)")
    p.add_argument("--attention-dtype", choices=("model", "fp8"), default="model")
    p.add_argument("--moe-dtype", choices=("model", "fp8"), default="model", help="hunyuan-image3's routed experts")
    p.add_argument("--hy-steps", type=int, default=5, help="hunyuan-image3 step: denoise steps a request")
    p.add_argument("--warmup", type=int, default=2, help="step: untimed calls per case after its first")
    p.add_argument("--iters", type=int, default=None, help="step: timed calls per round (default 3); load: loads "
                                                           "(default 5)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (step, batch: the cases interleaved)")
    p.add_argument("--tiny", action="store_true", help="step, load: the CPU, float32, the tiny size")
    p.add_argument("--cpu", action="store_true", help="step, load: the CPU, float32, at --size (a CPU figure)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of torch (default: torch's; 1 keeps a loaded machine's spinning threads "
                        "from stalling one side)")
    args = b.parse()
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    models = {"step": STEP_MODELS, "load": ("wan",), "batch": BATCH_MODELS}[args.measure]
    if args.model not in models:
        p.error(f"--model {args.model!r}: --measure {args.measure} takes one of {list(models)}")
    run_of = f"{args.measure} {args.model}"
    for flag, applies in FLAG_USE.items():
        dest = flag[2:].replace("-", "_")
        if getattr(args, dest) != p.get_default(dest) and run_of not in applies:
            p.error(f"{flag}: --measure {args.measure} --model {args.model} does not use it (it applies to: "
                    f"{'; '.join(applies)})")
    args.modes = args.modes.split(",")
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; known: {list(MODES)}")
    for flag in ("layers", "rank", "batch", "iters", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.hy_steps < 2:
        p.error(f"--hy-steps must be >= 2 (a request's steps after its first are timed), got {args.hy_steps}")
    if args.size not in WanPeer.sizes or args.size.startswith("I2V"):
        p.error(f"--size {args.size!r}: one of {[s for s in WanPeer.sizes if not s.startswith('I2V')]}")
    if args.tiny:
        args.size = "tiny"
    if args.measure == "batch":
        args.rank = args.rank or 4
        result = batch_ratio(b, args)
        b.write({"measure": "batch", "device": "cpu", "dtype": "float32", **result}, "cpu")
        return 0
    args.rank = args.rank or 64
    args.iters = args.iters or (5 if args.measure == "load" else 3)
    cuda = torch.cuda.is_available() and not (args.tiny or args.cpu)
    if not cuda and not (args.tiny or args.cpu):
        print(f"{MODULE} --measure {args.measure} needs a CUDA GPU (or --cpu, --tiny)", file=sys.stderr)
        return 2
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    torch._dynamo.config.automatic_dynamic_shapes = False   # static shapes, as a server's buckets compile
    run = {"step": hunyuan_step if args.model == "hunyuan-image3" else wan_step, "load": load_times}[args.measure]
    result = {"measure": args.measure, "dtype": str(dtype).removeprefix("torch."), "dense_dtype": args.dense_dtype,
              "attention_dtype": args.attention_dtype, "moe_dtype": args.moe_dtype,
              "compile": "regions" if cuda else "step", **run(b, args, device, dtype)}
    result["complete"] = True
    if cuda:
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    b.write(result, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
