"""Where the memory of one HunyuanImage-3 request goes, phase by phase, with each memory lever on and off.

Random weights at the released shapes (`--layers` of 32), FP8 experts, image editing loaded, one compiled
region per layer; 1251 prompt tokens and 256 forced AR tokens, 1024x1024, `--steps` denoise steps, T2I and
TI2I (a random reference: the ~6.3k-row edit prefill). Per phase of every run: the bytes allocated at its
start, its peak and the peak over the resident weights (a T2I row also the peak of a process without the
editing modules). The levers (`CONFIGS`), alone and together: plain_vae (the VAE decoder's ops before its
memory-lean forward), release_kv (`--kv-caches release`), keep_ar_kv (`--kv-caches keep-ar`), vae_chunks
(`--vae-chunks 4`), moe_chunks (`--moe-token-chunk 2048`), vae_bf16 (`--vae-dtype bfloat16`: a bf16 copy
stands in, `projected_peak_bytes` subtracting the fp32 VAE; loaded in bf16 when every config has it).
`--tiny`: the same runs at tiny shapes on the CPU.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch

from bench.bench_vae import plain_ops
from bench.harness import Bench
from dtgen.compile import CompileOptions
from dtgen.host import settle_heap
from dtgen.build import planned_storage
from models.hunyuan_image3.loading import HunyuanAdapter, load
from models.hunyuan_image3.model import set_moe_token_chunk
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest, filler_ids, warmup_request
from models.hunyuan_image3.presets import full_config
from models.hunyuan_image3.tiny import tiny_config
from models.hunyuan_image3.vae import HunyuanVAE
from placements.hunyuan_image3 import get_plan

LEVERS = ("plain_vae", "release_kv", "keep_ar_kv", "vae_bf16", "vae_chunks", "moe_chunks")
CONFIGS = {"baseline": (), **{name: (name,) for name in LEVERS},
           "all": ("release_kv", "vae_bf16", "vae_chunks", "moe_chunks"),
           "all_fp32_vae": ("release_kv", "vae_chunks", "moe_chunks"),
           # every lever but the MoE token chunks (which cost the denoise step time, and the
           # denoise phase is not where a request peaks once the VAE is chunked)
           "lean": ("release_kv", "vae_bf16", "vae_chunks"),
           # lean, but the AR cache kept: a server's later requests decode on the graph the
           # first one recorded (run it with --repeats 2 to see them)
           "lean_ar": ("keep_ar_kv", "vae_bf16", "vae_chunks")}
MOE_TOKEN_CHUNK = 2048   # the moe_chunks lever: --moe-token-chunk 2048
VAE_CHUNKS = 4   # the vae_chunks lever: --vae-chunks 4 (256-row slabs of the last 1024-row maps)
MODULE = "bench.bench_memory"


def requests(tiny: bool, steps: int) -> dict[str, T2IRequest]:
    size = "256x256" if tiny else "1024x1024"
    new = 4 if tiny else 256
    t2i = T2IRequest(prompt_ids=filler_ids(30 if tiny else 1250), max_new_tokens=new, ignore_stop=True,
                     image_size=size, seed=1, steps=steps, forced_tokens=filler_ids(new))
    side = 256 if tiny else 1024
    reference = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    system = "You edit images as the user asks, keeping everything else unchanged. " * (1 if tiny else 16)
    ti2i = replace(t2i, prompt_ids=None, prompt="make the sky a deep red at sunset", reference=reference,
                   system_prompt=system, image_size="auto")
    return {"t2i": t2i, "ti2i": ti2i}


class PhaseMemory:
    """A profiler stand-in (the pipeline's `profiler.phase(...)` / `.region(...)`): per phase,
    the bytes allocated at its start and its peak, the peak statistic reset at each start."""

    def __init__(self, device: torch.device):
        self.device, self.phases = device, {}

    @contextlib.contextmanager
    def phase(self, name: str, together: bool = True):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = torch.cuda.memory_allocated(self.device) if cuda else None
        t0 = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(self.device)
        self.phases[name] = {"start_bytes": start,
                             "peak_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
                             # what the caching allocator held from the device: what a card must have
                             "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device) if cuda else None,
                             "end_bytes": torch.cuda.memory_allocated(self.device) if cuda else None,
                             "wall_ms": round((time.perf_counter() - t0) * 1e3, 1)}

    def region(self, name: str, units: int = 1):
        return contextlib.nullcontext()


def bf16_copy(vae: HunyuanVAE) -> HunyuanVAE:
    """A bf16 twin of `vae` with its own weights (what --vae-dtype bfloat16 would load)."""
    with torch.device("meta"):
        twin = HunyuanVAE(vae.cfg, with_encoder=vae.encoder is not None)
    twin.load_state_dict({k: v.to(torch.bfloat16) for k, v in vae.state_dict().items()}, assign=True)
    return twin.eval()


@contextlib.contextmanager
def levers(pipe: HunyuanT2IPipeline, on: tuple[str, ...], vae16: HunyuanVAE | None):
    vae, policy, chunks = pipe.model.vae, pipe.kv_caches, pipe.vae_row_chunks
    try:
        pipe.vae_row_chunks = VAE_CHUNKS if "vae_chunks" in on else 1
        set_moe_token_chunk(pipe.model, MOE_TOKEN_CHUNK if "moe_chunks" in on else None)
        if "vae_bf16" in on:
            pipe.model.vae = vae16
        pipe.kv_caches = "release" if "release_kv" in on else "keep-ar" if "keep_ar_kv" in on else "keep"
        pipe.release_caches()   # every config starts from the same pool: nothing kept
        with plain_ops() if "plain_vae" in on else contextlib.nullcontext():
            yield
    finally:
        pipe.model.vae, pipe.kv_caches, pipe.vae_row_chunks = vae, policy, chunks
        set_moe_token_chunk(pipe.model, None)
        pipe.release_caches()


def main(argv=None) -> int:
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--configs", default=",".join(c for c in CONFIGS if c not in ("all_fp32_vae", "lean")),
                   help=f"comma-separated, of {list(CONFIGS)} (default: all but all_fp32_vae and lean)")
    p.add_argument("--runs", default="t2i,ti2i")
    p.add_argument("--repeats", type=int, default=1,
                   help="requests of each kind in a row per config (a row each, `repeat` 0, 1, ...): the "
                        "first one records the CUDA-graph decode, the later ones are what a server's next "
                        "requests see")
    p.add_argument("--dense-dtype", default="model", choices=("model", "fp8"),
                   help="the dense linears (QKV, O, shared MLP, lm_head): as examples.hunyuan_t2i --dense-dtype")
    p.add_argument("--tiny", action="store_true", help="the tiny architecture on the CPU (a check of this script)")
    args = b.parse()
    configs = args.configs.split(",")
    runs = args.runs.split(",")
    if set(configs) - set(CONFIGS) or set(runs) - {"t2i", "ti2i"}:
        raise SystemExit(f"error: --configs from {list(CONFIGS)}, --runs from t2i, ti2i")
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats must be at least 1, got {args.repeats}")
    for c in configs:
        if {"release_kv", "keep_ar_kv"} <= set(CONFIGS[c]):
            raise SystemExit(f"error: config {c!r} has two KV-cache policies (release_kv and keep_ar_kv)")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda", 0)
    if device.type == "cpu":
        device = torch.device("cpu")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    # When every config runs the bf16 VAE, load it so (as --vae-dtype bfloat16 does): the
    # process then holds what a real one would, and its peak is measured, not projected.
    bf16_vae_only = all("vae_bf16" in CONFIGS[c] for c in configs)
    loaded = load(None, get_plan("single"), 0, 1, dtype, device, random_config=tiny_config(2) if args.tiny
                  else full_config(args.layers), moe_dtype="fp8" if cuda else "model", image_editing=True,
                  dense_dtype=args.dense_dtype, vae_dtype="bfloat16" if bf16_vae_only else None)
    load_s = time.perf_counter() - t0
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                              compile_options=CompileOptions(enabled=cuda, regions=True))
    reqs = {k: v for k, v in requests(args.tiny, args.steps).items() if k in runs}
    vae_bytes = sum(t.nbytes for t in loaded.model.vae.parameters())
    vae16 = (loaded.model.vae if bf16_vae_only else
             bf16_copy(loaded.model.vae) if any("vae_bf16" in CONFIGS[c] for c in configs) else None)
    vae16_bytes = sum(t.nbytes for t in vae16.parameters()) if vae16 is not None and not bf16_vae_only else 0
    warm = {}
    # Compile every shape once (untimed, unmeasured); MoE token chunks change the layer's graph.
    chunked = (False, True) if any("moe_chunks" in CONFIGS[c] for c in configs) else (False,)
    for name, req in reqs.items():
        for chunk in chunked:
            set_moe_token_chunk(pipe.model, MOE_TOKEN_CHUNK if chunk else None)
            t1 = time.perf_counter()
            pipe.generate(warmup_request(req))
            warm[name + ("_moe_chunks" if chunk else "")] = round(time.perf_counter() - t1, 1)
            print(f"warm-up {name}{' (MoE token chunks)' if chunk else ''}: {time.perf_counter() - t1:.1f} s",
                  flush=True)
    set_moe_token_chunk(pipe.model, None)
    pipe.release_caches()
    settle_heap()
    weights = loaded.storage.nbytes
    # A text-to-image process does not load the vision tower and the VAE encoder: its weights,
    # planned on meta (nothing allocated), for the T2I rows' `t2i_process_peak_bytes`.
    t2i_weights, _ = planned_storage(HunyuanAdapter(loaded.model.cfg, False, fp8_experts=cuda,
                                                    fp8_dense=args.dense_dtype == "fp8",
                                                    vae_dtype="bfloat16" if bf16_vae_only else None),
                                     get_plan("single"), 1, dtype, "channels" if cuda else None)
    rows = []

    def write(rows):
        """The JSON so far (after every run: a command cut short keeps what it measured)."""
        b.write({"dtype": str(dtype).removeprefix("torch."), "layers": None if args.tiny else args.layers,
                 "moe_dtype": "fp8-channels" if cuda else "model", "dense_dtype": args.dense_dtype,
                 "compile": "regions" if cuda else "off", "steps": args.steps, "weights_bytes": weights,
                 "vae_fp32_bytes": None if bf16_vae_only else vae_bytes, "vae_loaded_in_bf16": bf16_vae_only,
                 "t2i_process_weights_bytes": t2i_weights, "load_s": round(load_s, 1), "warmup_s": warm,
                 "rows": rows}, device, quiet=True)

    def record(name: str, config: str, on: tuple[str, ...], repeat: int, mem: PhaseMemory, result) -> None:
        peak = max((ph["peak_bytes"] or 0) for ph in mem.phases.values()) if cuda else None
        # Held only by this bench: the bf16 VAE copy (when its lever is off) or the fp32 VAE
        # (when on: a --vae-dtype bfloat16 process holds the bf16 one alone).
        extra = 0 if bf16_vae_only else vae_bytes if "vae_bf16" in on else vae16_bytes
        row = {"run": name, "config": config, "levers": list(on), "repeat": repeat, "phases": mem.phases,
               "peak_bytes": peak, "projected_peak_bytes": None if peak is None else peak - extra,
               "bench_only_bytes": extra, "timings_ms": {k: round(v, 2) for k, v in result.timings_ms.items()}}
        if cuda:
            row["peak_over_weights_bytes"] = row["projected_peak_bytes"] - weights
            if name == "t2i":   # without the editing modules a T2I process does not hold
                row["t2i_process_peak_bytes"] = row["projected_peak_bytes"] - (weights - t2i_weights)
        rows.append(row)
        tag = f"{config}#{repeat}" if args.repeats > 1 else config
        for phase, ph in mem.phases.items():
            fmt = (lambda b: "-" if b is None else f"{b / 1e9:.2f} GB")
            print(f"{name:5} {tag:11} {phase:9} start {fmt(ph['start_bytes'])}, peak {fmt(ph['peak_bytes'])}"
                  f" ({ph['wall_ms']} ms)", flush=True)
        if cuda:
            t2i = (f"; a T2I process: {row['t2i_process_peak_bytes'] / 1e9:.2f} GB" if name == "t2i" else "")
            print(f"{name:5} {tag:11} peak {peak / 1e9:.2f} GB, projected {row['projected_peak_bytes'] / 1e9:.2f}"
                  f" GB ({row['peak_over_weights_bytes'] / 1e9:.2f} over {weights / 1e9:.2f} GB of weights){t2i}",
                  flush=True)
        write(rows)

    for config in configs:
        on = CONFIGS[config]
        for name, req in reqs.items():
            with levers(pipe, on, vae16):   # the repeats share the config's pool (what a server keeps)
                for repeat in range(args.repeats):
                    mem = PhaseMemory(device)
                    record(name, config, on, repeat, mem, pipe.generate(req, profiler=mem))
    write(rows)
    write(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
