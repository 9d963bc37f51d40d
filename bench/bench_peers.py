"""A registered model's DiT against its reference library's, same weights and inputs, one process.

`--model` names a model of models/registry.py with a peer here: `wan` (diffusers' WanTransformer3DModel;
sizes 1.3B at its 30 blocks and 14B-8, the 14B width at 8 blocks, 480p x 81 frames; the image-to-video
DiT as I2V-14B and I2V-14B-8: Wan2.1-I2V's 36 input channels and 257 CLIP tokens through the added
key / value projections, random image features as the tokens) and `qwen-image`
(diffusers' QwenImageTransformer2DModel at the published 60 blocks, one CFG branch, 1024x1024). Both
modules hold the same random weights. Per size, mode and variant: the median of `--iters` forwards after
`--warmup` (CUDA events; the first call, which compiles, is timed apart). Modes: eager; regions (one
compiled region per block: dtgen's `run_block`, diffusers' `compile_repeated_blocks(fullgraph=True)`);
whole (the whole forward compiled). dtgen's variants against diffusers' bf16: bf16, dense-fp8 (the blocks'
linears in e4m3), attn-fp8 (kernels/fp8_attention.py; attn-fp8-pv16: FP16 PV), fp8 (both); each with
its relative L2 against dtgen's bf16 and diffusers' outputs. `--profile TOP`: one more forward of each
row under torch.profiler (kernel time by kind, the TOP kernels). Floor: the forward's FLOPs at 694
TFLOP/s. `--tiny`: CPU, float32, tiny shapes, eager (a check that it runs). Needs diffusers 0.42.1.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from bench.floors import DENSE_BF16_TFLOPS
from bench.harness import Bench, kernel_profile, rel_err, time_ms

MODULE = "bench.bench_peers"
MODES = ("eager", "regions", "whole")
VARIANTS = ("bf16", "dense-fp8", "attn-fp8", "attn-fp8-pv16", "fp8")


def set_attention(attentions, head_dim: int, variant: str) -> None:
    """The attention modules' cores for `variant`: FP8 attention (FP8 or FP16 PV), or SDPA."""
    from dtgen.attention import LocalAttention
    from dtgen.fp8 import use_fp8_attention
    if variant in ("attn-fp8", "fp8", "attn-fp8-pv16"):
        use_fp8_attention(attentions, head_dim, pv="fp16" if variant == "attn-fp8-pv16" else "fp8")
    else:
        for attention in attentions:
            attention.core = LocalAttention()


def wan_config(text_dim: int = 4096, in_channels: int = 16, **shape):
    """Wan's DiT config at a size (`WanPeer.sizes`: heads, head size, FFN width, blocks; image to
    video: 36 input channels, the image features' width and the added K/V projections')."""
    from models.wan.transformer import WanTransformerConfig
    return WanTransformerConfig.from_dict(dict(
        patch_size=[1, 2, 2], in_channels=in_channels, out_channels=16, text_dim=text_dim, freq_dim=256,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **shape))


def random_wan_dit(cfg, device, dtype):
    """Wan's DiT with random weights in `dtype` (float32 where diffusers keeps float32)."""
    from models.wan.transformer import WanTransformer, keeps_fp32
    with torch.device("meta"):
        dit = WanTransformer(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(dit.named_parameters()):
        t = torch.randn(p.shape, generator=g, device=device) * (0.02 if p.dim() > 1 else 1.0)
        if name.startswith("condition_embedder.time_proj"):
            t = t * 0.1   # a random modulation at full scale drowns the blocks' updates
        owner, _, attr = name.rpartition(".")
        dit.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(
            t.to(torch.float32 if keeps_fp32(name) else dtype), requires_grad=False)
    return dit.eval()


class WanPeer:
    """Wan's DiT (models/wan) and diffusers' WanTransformer3DModel: one denoise forward, timestep 500."""
    sizes = {   # Wan2.1 transformer/config.json values; "-8": the 14B width at 8 blocks
        "1.3B": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
        "14B": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40),
        "14B-8": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=8),
        "tiny": dict(num_attention_heads=2, attention_head_dim=64, ffn_dim=256, num_layers=2)}
    # Wan2.1-I2V-14B's DiT (transformer/config.json): the 14B shapes, 36 input channels, CLIP ViT-H features.
    I2V = dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
    sizes.update({"I2V-14B": dict(sizes["14B"], **I2V), "I2V-14B-8": dict(sizes["14B-8"], **I2V),
                  "I2V-tiny": dict(sizes["tiny"], in_channels=36, image_dim=32, added_kv_proj_dim=128)})
    default_sizes = "1.3B,14B-8"
    IMAGE_TOKENS = 257   # the CLIP ViT-H/14 tower's 1 + 16 x 16 tokens at 224 px

    def __init__(self, size: str, args, device: str, dtype: torch.dtype):
        import diffusers

        from models.wan.model import FP8_LINEARS
        from models.wan.transformer import run_block
        self.run_block, self.fp8_linears = run_block, FP8_LINEARS
        tiny = size.endswith("tiny")
        cfg = wan_config(**self.sizes[size], text_dim=64 if tiny else 4096)
        ours = random_wan_dit(cfg, device, dtype)
        with torch.device(device):
            theirs = diffusers.WanTransformer3DModel(
                patch_size=tuple(cfg.patch_size), num_attention_heads=cfg.num_attention_heads,
                attention_head_dim=cfg.attention_head_dim, in_channels=cfg.in_channels, out_channels=16,
                text_dim=cfg.text_dim, freq_dim=256, ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
                image_dim=cfg.image_dim, added_kv_proj_dim=cfg.added_kv_proj_dim)
        keys = theirs.load_state_dict(ours.state_dict())
        assert not keys.missing_keys and not keys.unexpected_keys, keys
        keep = tuple(getattr(theirs, "_keep_in_fp32_modules", None) or ())
        for name, param in theirs.named_parameters():
            param.data = param.data.to(torch.float32 if any(m in name.split(".") for m in keep) else dtype)
        self.ours, self.theirs, self.cfg = ours.eval(), theirs.eval(), cfg
        frames, height, width = (3, 6, 8) if tiny else (21, 60, 104)   # 480x832 x 81 frames
        # diffusers' I2V attention takes the text as the last 512 rows: image to video needs all 512
        text_rows = 16 if size == "tiny" else 512
        image_rows = (5 if tiny else self.IMAGE_TOKENS) if cfg.image_tokens else 0
        g = torch.Generator(device=device).manual_seed(1)
        self.x = torch.randn(args.batch, cfg.in_channels, frames, height, width, generator=g, device=device).to(dtype)
        self.t = torch.full((args.batch,), 500.0, device=device)
        self.text = torch.randn(args.batch, text_rows, cfg.text_dim, generator=g, device=device).to(dtype)
        self.image = (torch.randn(args.batch, image_rows, cfg.image_dim, generator=g, device=device).to(dtype)
                      if image_rows else None)
        tokens, D, F = frames * (height // 2) * (width // 2), cfg.inner_dim, cfg.ffn_dim
        self.shape = {"latent": [cfg.in_channels, frames, height, width], "tokens": tokens, "text_rows": text_rows,
                      "image_rows": image_rows, "batch": args.batch}
        self.flops = args.batch * cfg.num_layers * (8 * tokens * D * D + 4 * tokens * tokens * D   # self-attention
                                                    + 4 * tokens * D * D + 4 * text_rows * D * D
                                                    + 4 * tokens * text_rows * D + 4 * tokens * D * F
                                                    + 4 * image_rows * D * D + 4 * tokens * image_rows * D)

    def attentions(self, module):
        return module.self_attentions()

    def call_ours(self, module):
        return lambda: module(self.x, self.t, self.text, self.image)

    def call_theirs(self, module):
        return lambda: module(hidden_states=self.x, timestep=self.t, encoder_hidden_states=self.text,
                              encoder_hidden_states_image=self.image, return_dict=False)[0]

    def dense_fp8(self):
        from dtgen.fp8 import quantize_linears_
        module = copy.deepcopy(self.ours)
        quantize_linears_(module, self.fp8_linears)
        return module


class QwenImagePeer:
    """Qwen-Image's MMDiT (models/qwen_image) and diffusers' QwenImageTransformer2DModel: one forward of
    one CFG branch, batch 1. dtgen's module is assigned diffusers' tensors (no copy: one H200 holds both)."""
    published = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=[16, 56, 56])
    sizes = {"60-blocks": published,
             "tiny": dict(published, num_layers=2, attention_head_dim=16, num_attention_heads=4,
                          joint_attention_dim=32, axes_dims_rope=[4, 6, 6])}
    default_sizes = "60-blocks"

    def __init__(self, size: str, args, device: str, dtype: torch.dtype):
        import diffusers

        from dtgen.requests import parse_size
        from models.qwen_image.model import FP8_LINEARS
        from models.qwen_image.transformer import QwenImageTransformer, QwenImageTransformerConfig, run_block
        self.run_block, self.fp8_linears = run_block, FP8_LINEARS
        cfg = dict(self.sizes[size], **({"num_layers": args.layers} if args.layers else {}))
        torch.manual_seed(0)
        with torch.device(device):
            self.theirs = diffusers.QwenImageTransformer2DModel(**cfg).to(dtype).eval()
        with torch.device("meta"):
            ours = QwenImageTransformer(QwenImageTransformerConfig.from_dict(cfg))
        ours.load_state_dict(self.theirs.state_dict(), strict=True, assign=True)
        self.ours, self.cfg = ours.eval(), SimpleNamespace(**cfg)
        width, height = parse_size(args.image_size, "--image-size", "1024x1024")
        self.h, self.w = height // 16, width // 16
        g = torch.Generator(device).manual_seed(1)
        self.x = torch.randn(1, self.h * self.w, cfg["in_channels"], generator=g, device=device, dtype=dtype)
        self.text = torch.randn(1, args.text_rows, cfg["joint_attention_dim"], generator=g, device=device,
                                dtype=dtype)
        self.t = torch.full((1,), 0.7, device=device, dtype=dtype)
        D, S = cfg["num_attention_heads"] * cfg["attention_head_dim"], self.h * self.w + args.text_rows
        self.shape = {"config": cfg, "image_size": args.image_size, "image_rows": self.h * self.w,
                      "text_rows": args.text_rows}
        self.flops = cfg["num_layers"] * (24 * S * D * D + 4 * S * S * D)   # projections and MLPs, attention

    def attentions(self, module):
        return module.joint_attentions()

    def call_ours(self, module):
        return lambda: module(self.x, self.t, self.text, self.h, self.w)

    def call_theirs(self, module):
        return lambda: module(hidden_states=self.x, encoder_hidden_states=self.text, timestep=self.t,
                              img_shapes=[[(1, self.h, self.w)]], return_dict=False)[0]

    def dense_fp8(self):
        """The blocks' linears in e4m3, every other weight shared with dtgen's bf16 module; one block
        copied at a time, so the peak stays low."""
        from dtgen.fp8 import quantize_linears_
        shell = copy.copy(self.ours)
        shell._modules = dict(self.ours._modules)
        blocks = []
        for block in self.ours.transformer_blocks:
            holder = torch.nn.Module()                # under the names FP8_LINEARS matches
            holder.transformer = torch.nn.Module()
            holder.transformer.transformer_blocks = torch.nn.ModuleList([copy.deepcopy(block)])
            quantize_linears_(holder, self.fp8_linears)
            blocks.append(holder.transformer.transformer_blocks[0])
        shell._modules["transformer_blocks"] = torch.nn.ModuleList(blocks)
        return shell


PEERS = {"wan": WanPeer, "qwen-image": QwenImagePeer}   # registry name -> its peer


def _timed(fn, args, cuda: bool, profile: int) -> tuple[dict, torch.Tensor]:
    t0 = time.perf_counter()
    out = fn()   # compiles, in a compiled mode
    first_s = time.perf_counter() - t0
    times = time_ms(fn, args.iters, args.warmup, "cuda" if cuda else "cpu")
    row = {"ms": statistics.median(times), "times_ms": times, "first_call_s": round(first_s, 2)}
    if profile and cuda:
        row["profile"] = kernel_profile(fn, calls=1, top=profile)
    return row, out


def _compiled(peer, module, mode: str, theirs: bool):
    """The module's forward in `mode` (regions: set on the module, undone by `_eager`)."""
    if mode == "regions":
        if theirs:
            module.compile_repeated_blocks(fullgraph=True)
        else:
            module.run_block = torch.compile(peer.run_block, fullgraph=True)
    call = peer.call_theirs(module) if theirs else peer.call_ours(module)
    return torch.compile(call, fullgraph=True) if mode == "whole" else call


def _eager(peer, module, theirs: bool) -> None:
    if theirs:
        for block in module.modules():   # undo nn.Module.compile of compile_repeated_blocks
            block._compiled_call_impl = None
    else:
        module.run_block = peer.run_block
        set_attention(peer.attentions(module), peer.cfg.attention_head_dim, "bf16")


def main(argv=None) -> int:
    from models.registry import names
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--model", required=True, help=f"a registered model with a peer: {', '.join(PEERS)}")
    p.add_argument("--sizes", help="comma-separated, of the model's sizes (default: its released ones)")
    p.add_argument("--modes", default="eager,regions", help=f"comma-separated, of {MODES}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"dtgen's, comma-separated, of {VARIANTS}")
    p.add_argument("--batch", type=int, default=1, help="wan: rows a forward in both (2: both CFG rows at once)")
    p.add_argument("--image-size", default="1024x1024", help="qwen-image: WIDTHxHEIGHT in pixels")
    p.add_argument("--text-rows", type=int, default=256, help="qwen-image: prompt embedding rows")
    p.add_argument("--layers", type=int, help="qwen-image: blocks (default: the published 60)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the tiny size, eager")
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="GPU: one more forward of each row under torch.profiler; its kernels by kind, the TOP ones")
    args = b.parse()
    if args.model not in PEERS:
        known = [n for n in names() if n in PEERS]
        print(f"--model {args.model!r}: no peer here; registered models with one: {', '.join(known)}",
              file=sys.stderr)
        return 2
    Peer = PEERS[args.model]
    sizes, modes = (args.sizes or Peer.default_sizes).split(","), args.modes.split(",")
    variants = list(dict.fromkeys(["bf16"] + args.variants.split(",")))
    if args.tiny:   # the tiny size of each kind asked for (text to video, image to video)
        tiny = ["I2V-tiny" if s.startswith("I2V") else "tiny" for s in sizes]
        sizes, modes, device, dtype = list(dict.fromkeys(tiny)), ["eager"], "cpu", torch.float32
    else:
        device, dtype = "cuda", torch.bfloat16
        if not torch.cuda.is_available():
            print(f"{MODULE} needs a CUDA GPU (or --tiny)", file=sys.stderr)
            return 2
    for flag, values, known in (("--sizes", sizes, Peer.sizes), ("--modes", modes, MODES),
                                ("--variants", variants, VARIANTS)):
        bad = [v for v in values if v not in known]
        if bad:
            print(f"{flag}: unknown {bad}; known: {list(known)}", file=sys.stderr)
            return 2
    try:
        import diffusers
    except ImportError:
        print("needs diffusers 0.42.1 (pip install --no-deps diffusers==0.42.1, or its wheel on PYTHONPATH)",
              file=sys.stderr)
        return 2
    cuda = device == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = cuda
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = False   # each size's shapes compile static, as a server's
    rows = []
    result = {"what": f"{args.model} DiT forward, dtgen against diffusers {diffusers.__version__}, one process, "
                      "same weights and inputs", "model": args.model, "dtype": str(dtype).removeprefix("torch."),
              "sizes": {}, "rows": rows, "complete": False}
    with torch.no_grad():
        for size in sizes:
            torch._dynamo.reset()
            peer = Peer(size, args, device, dtype)
            flops = peer.flops
            result["sizes"][size] = {**peer.shape, "flops": flops, "floor_ms": flops / (DENSE_BF16_TFLOPS * 1e9)}
            ours_fp8 = peer.dense_fp8() if any(v in ("dense-fp8", "fp8") for v in variants) else None
            for mode in modes:
                torch._dynamo.reset()
                _eager(peer, peer.theirs, theirs=True)
                ref, ref_out = _timed(_compiled(peer, peer.theirs, mode, theirs=True), args, cuda, args.profile)
                rows.append({"size": size, "mode": mode, "who": "diffusers", "variant": "bf16", **ref})
                print(f"{size:9s} {mode:8s} diffusers {'bf16':14s} {ref['ms']:9.2f} ms "
                      f"(first call {ref['first_call_s']:.0f} s)", flush=True)
                base = None
                for variant in variants:
                    module = ours_fp8 if variant in ("dense-fp8", "fp8") else peer.ours
                    set_attention(peer.attentions(module), peer.cfg.attention_head_dim, variant)
                    row, out = _timed(_compiled(peer, module, mode, theirs=False), args, cuda, args.profile)
                    _eager(peer, module, theirs=False)
                    base = out if variant == "bf16" else base
                    row.update(size=size, mode=mode, who="dtgen", variant=variant,
                               ratio_vs_diffusers=row["ms"] / ref["ms"], rel_l2_vs_dtgen_bf16=rel_err(out, base),
                               rel_l2_vs_diffusers=rel_err(out, ref_out))
                    rows.append(row)
                    print(f"{size:9s} {mode:8s} dtgen     {variant:14s} {row['ms']:9.2f} ms  dtgen/diffusers "
                          f"{row['ratio_vs_diffusers']:.3f}  rel L2 vs bf16 {row['rel_l2_vs_dtgen_bf16']:.2e}  "
                          f"vs diffusers {row['rel_l2_vs_diffusers']:.2e}", flush=True)
                    b.write(result, device, quiet=True)   # after every row: a run cut short keeps what it measured
            peer = ours_fp8 = module = None
            if cuda:
                torch.cuda.empty_cache()
    result["complete"] = True
    result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1) if cuda else None
    b.write(result, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
