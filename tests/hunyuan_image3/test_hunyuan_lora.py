"""LoRA adapters on HunyuanImage-3 (dtgen/lora), unmerged, against the same checkpoint with their deltas
merged into its weights (W + w s B A, written as a new official-format checkpoint and read by the official
loader): AR logits and velocities in one process and on every 2-rank plan and the 4-rank hybrid plan (its
AR on TP4, its denoise on TP2 x SP2, over one resident copy). The adapters: a PEFT folder on the official
module names (rank and alpha patterns) and a diffusers-style file (`transformer.` prefix, its header), on
every layer's attention and shared MLP linears, the lm_head and a timestep embedder. CPU, float32.

The FP8 base (--dense-dtype fp8: QKV, O, shared MLP, lm_head in e4m3) with the adapters unmerged in the
model dtype, against the merged checkpoint without FP8 (relative L2; AR tokens forced to the merged run's):

| output | FP8 + adapters (CPU, float32) | FP8 without the adapters | bound |
|---|---|---|---|
| AR prefill logits | 0.089 | 0.38 | 0.15 |
| velocity, step 1 | 0.041 | 0.17 | 0.1 |
| velocity, step 2 | 0.064 | 0.18 | 0.1 |

The FP8 error of the base alone is of the same size (tests/hunyuan_image3/test_fp8_dense.py's table); the
GPU row (bf16, `torch._scaled_mm` and the decode GEMV) is the test's `gpu-bf16` case, not measured here."""
import json
from functools import partial
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dtgen.launch import RankPool
from dtgen.lora import LoraError, ResidentLoras
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest
from placements.hunyuan_image3 import PLANS, get_plan

LAYER_LINEARS = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.shared_mlp.gate_and_up_proj",
                 "mlp.shared_mlp.down_proj"]
TARGETS_A = [f"model.layers.{i}.{m}" for i in range(2) for m in LAYER_LINEARS] + ["lm_head", "time_embed.mlp.0"]
TARGETS_B = ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.shared_mlp.down_proj", "timestep_emb.mlp.2"]
# PEFT's rank and alpha patterns: the down projections take rank 2 and alpha 5 (r 4, alpha 6 elsewhere)
A_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 6, "rank_pattern": {"down_proj": 2},
            "alpha_pattern": {"down_proj": 5}, "target_modules": sorted({t.rsplit(".", 1)[-1] for t in TARGETS_A})}
B_RANK, B_ALPHA = 2, 3
ADAPTERS = (("a", 0.7), ("b", -0.5))
REQUEST = T2IRequest(prompt="a red fox", steps=2, max_new_tokens=2, temperature=0.0, image_size="256x256", seed=7)
TOL = 1e-5   # fp32: the merged weights and the unmerged deltas differ by rounding only


def _checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def _pairs(shapes, targets, rank_of, seed):
    """module -> (A [r, in], B [out, r]): non-zero B, large enough that the delta is far above TOL."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in targets:
        rows, cols = shapes[t + ".weight"]
        r = rank_of(t)
        out[t] = (torch.randn(r, cols, generator=g) / cols ** 0.5, 0.05 * torch.randn(rows, r, generator=g))
    return out


def _scale(config_r, config_alpha, module, patterns_r=None, patterns_alpha=None):
    leaf = module.rsplit(".", 1)[-1]
    r = (patterns_r or {}).get(leaf, config_r)
    return (patterns_alpha or {}).get(leaf, config_alpha) / r


@pytest.fixture(scope="module")
def files(tiny_checkpoint, tmp_path_factory):
    """The two adapters, their pairs and scales, and the checkpoint with both merged at ADAPTERS' weights."""
    root = tmp_path_factory.mktemp("hunyuan-lora")
    base = _checkpoint_tensors(tiny_checkpoint)
    shapes = {k: tuple(v.shape) for k, v in base.items()}
    a = _pairs(shapes, TARGETS_A, lambda t: 2 if t.endswith("down_proj") else 4, seed=1)
    b = _pairs(shapes, TARGETS_B, lambda t: B_RANK, seed=2)
    peft = root / "a"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps(A_CONFIG))
    save_file({f"base_model.model.{m}.lora_{w}.weight": t for m, (A, B) in a.items() for w, t in (("A", A), ("B", B))},
              str(peft / "adapter_model.safetensors"))
    diffusers_style = root / "b.safetensors"
    header = {"lora_adapter_metadata": json.dumps({"transformer.r": B_RANK, "transformer.lora_alpha": B_ALPHA})}
    save_file({f"transformer.{m}.lora_{w}.weight": t for m, (A, B) in b.items() for w, t in (("A", A), ("B", B))},
              str(diffusers_style), metadata=header)
    merged = {k: v.float() for k, v in base.items()}
    for (name, weight), pairs in zip(ADAPTERS, (a, b)):
        for module, (A, B) in pairs.items():
            scale = (_scale(4, 6, module, {"down_proj": 2}, {"down_proj": 5}) if name == "a"
                     else B_ALPHA / B_RANK)
            merged[module + ".weight"] += weight * scale * (B @ A)
    folder = root / "merged"
    shutil.copytree(tiny_checkpoint, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(merged, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in merged}}))
    return {"a": peft, "b": diffusers_style, "merged": folder}


def _without_vae(pipe):
    """The VAE takes no adapter and is what a CPU run of the tiny model spends most on: left out (the
    checks read the AR logits and the velocities)."""
    pipe.decode_image = lambda latents: None
    return pipe


def _pipe(ckpt, files, plan="single", rank=0, world=1, adapters=True):
    loaded = load(ckpt, get_plan(plan), rank, world)
    pipe = _without_vae(HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu",
                                           is_main=rank == 0))
    if adapters:
        pipe.loras = ResidentLoras(loaded, torch.float32)
        for name, _ in ADAPTERS:
            pipe.loras.load(name, files[name])
    return pipe


def _summary(result):
    return {"tokens": result.tokens, "ratio": result.ratio_index, "ar_logits": result.record["ar_logits"],
            "velocity": result.record["velocity"]}


def _assert_same(got, want, what, tol=TOL):
    assert got["tokens"] == want["tokens"] and got["ratio"] == want["ratio"], what
    for key in ("ar_logits", "velocity"):
        assert len(got[key]) == len(want[key]) > 0, (what, key)
        for x, y in zip(got[key], want[key]):
            rel = float((x - y).abs().max() / y.abs().max())
            assert rel < tol, f"{what}: {key} differs by {rel:.2e} of its largest value"


@pytest.fixture(scope="module")
def merged(files):
    """The merged checkpoint's AR logits and velocities, one process, no adapter."""
    return _summary(_pipe(files["merged"], files, adapters=False).generate(REQUEST))


def test_unmerged_adapters_equal_the_merged_checkpoint(tiny_checkpoint, files, merged):
    pipe = _pipe(tiny_checkpoint, files)
    assert set(pipe.loras.adapters["a"].layers) >= {"model.layers.1.mlp.shared_mlp.gate_and_up_out",
                                                     "model.layers.1.mlp.shared_mlp.down_out", "lm_head"}
    got = _summary(pipe.generate(replace(REQUEST, loras=ADAPTERS)))
    _assert_same(got, merged, "single")
    base = _summary(pipe.generate(REQUEST))   # no adapter: far from the merged checkpoint
    assert float((base["velocity"][0] - merged["velocity"][0]).abs().max()) > 1e-2
    assert float((base["ar_logits"][0] - merged["ar_logits"][0]).abs().max()) > 1e-2


def test_folded_adapters_equal_the_merged_checkpoint(tiny_checkpoint, files, merged):
    """--lora-merge: each adapter folded into the resident weights at load (`ResidentLoras.merge`)."""
    loaded = load(tiny_checkpoint, get_plan("single"))
    folding = ResidentLoras(loaded, torch.float32)
    for name, weight in ADAPTERS:
        folding.merge(files[name], weight)
    pipe = _without_vae(HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu"))
    _assert_same(_summary(pipe.generate(REQUEST)), merged, "folded")


def job_plan(ctx, ckpt, files, plan):
    pipe = _pipe(ckpt, files, plan, ctx.rank, ctx.world_size)
    result = pipe.generate(replace(REQUEST, loras=ADAPTERS))
    return _summary(result) if ctx.rank == 0 else None


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_every_plan_equals_the_merged_checkpoint(tiny_checkpoint, files, merged, world):
    """Every 2-rank plan (TP2 in both phases; AR TP2 and denoise SP2 or CFG2 over a full replica), and the
    4-rank hybrid plan: the pairs follow their weights' rules in each phase across the phase switch."""
    plans = [n for n, p in PLANS.items() if p.world_size == 2] if world == 2 else ["hybrid"]
    with RankPool(world, timeout_s=240) as pool:
        for plan in plans:
            _assert_same(pool.run(job_plan, tiny_checkpoint, files, plan)[0], merged, f"plan {plan}")


def test_routed_experts_are_refused_naming_the_module(tiny_checkpoint, tmp_path):
    loaded = load(tiny_checkpoint, get_plan("single"))
    folder = tmp_path / "experts"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    save_file({"base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_A.weight": torch.ones(2, 64),
               "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_B.weight": torch.ones(256, 2)},
              str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match=r"model\.layers\.0\.mlp\.experts\.3\.down_proj is a routed expert's weight, "
                                        r"stacked with its layer's other experts: it takes no LoRA pair"):
        ResidentLoras(loaded, torch.float32).load("experts", folder)


def _flags(files):
    return ["--lora", f"{files['a']}:0.7", "--lora", f"{files['b']}:-0.5"]


def test_the_commands_flags_equal_the_merged_checkpoint(tiny_checkpoint, files, merged):
    """`dtgen run --model hunyuan-image3 --lora FILE:WEIGHT ...`: the flags' request and this rank's pipeline
    (the command's own `prepare`, `request_from_args` and `build_pipeline`) give the merged checkpoint's
    logits and velocities; with --lora-merge, one adapter folded at load gives what it gives unmerged."""
    from models.hunyuan_image3.cli import build_pipeline, parse_args, prepare, request_from_args
    from dtgen.launch import RankContext
    ctx = RankContext(0, 1, 0, torch.device("cpu"), "gloo")

    def run(*flags):
        args = parse_args(["--checkpoint", str(tiny_checkpoint), "--steps", "2", "--max-new-tokens", "2",
                           "--temperature", "0", "--image-size", "256x256", "--seed", "7", *flags])
        assert prepare(args)[0] is None
        pipe = _without_vae(build_pipeline(ctx, args)[0])
        return request_from_args(args, prompt=REQUEST.prompt), pipe

    req, pipe = run(*_flags(files))
    assert req.loras == ((str(files["a"]), 0.7), (str(files["b"]), -0.5))
    _assert_same(_summary(pipe.generate(req)), merged, "--lora")
    req, pipe = run("--lora", f"{files['a']}:0.7", "--lora-merge")
    assert req.loras == () and pipe.loras is None
    _, unmerged = run("--lora", f"{files['a']}:0.7")
    want = unmerged.generate(replace(req, loras=((str(files["a"]), 0.7),)))
    _assert_same(_summary(pipe.generate(req)), _summary(want), "--lora-merge")


@pytest.mark.parametrize("flags, message", [
    (lambda f: ["--lora", str(f["experts"])], "--lora: LoRA .*experts: model.layers.0.mlp.experts.3.down_proj is a "
                                              "routed expert's weight, stacked with its layer's other experts"),
    (lambda f: ["--lora", str(f["router"])], "--lora: LoRA .*router: model.layers.1.mlp.gate.wg is the MoE router, "
                                             "whose logits are computed from its weight directly: it takes no LoRA"),
    (lambda f: ["--lora", str(f["nothing"])], r"--lora: LoRA .*nothing: 1 of 1 module\(s\) match nothing in this "
                                              r"model \(e.g. \['model.layers.0.self_attn.to_q'\]\)"),
    (lambda f: ["--lora", str(f["shape"])], r"--lora: LoRA .*shape: model.layers.0.self_attn.o_proj: lora_A \[2, 8\] "
                                            r"/ lora_B \[256, 2\] do not fit model.layers.0.self_attn.o_proj"),
    (lambda f: ["--lora", str(f["experts"]) + "/nope"], "--lora: LoRA .*nope: no such file or folder"),
    (lambda f: _flags(f) + ["--lora-merge"], "--lora-merge folds exactly one --lora adapter into the weights; 2 given"),
    (lambda f: ["--lora", f"{f['a']}:0.7", "--lora-merge", "--dense-dtype", "fp8"],
     "--lora-merge folds the adapter into float32/bf16 weights; --dense-dtype fp8"),
])
def test_command_line_lora_mistakes_are_one_line(tiny_checkpoint, files, tmp_path, capsys, flags, message):
    import re
    from models.hunyuan_image3.cli import main
    bad = {"experts": ("model.layers.0.mlp.experts.3.down_proj", 64, 256),
           "nothing": ("model.layers.0.self_attn.to_q", 256, 256),
           "router": ("model.layers.1.mlp.gate.wg", 256, 8),
           "shape": ("model.layers.0.self_attn.o_proj", 8, 256)}
    made = dict(files)
    for name, (module, cols, rows) in bad.items():
        folder = made[name] = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
        save_file({f"base_model.model.{module}.lora_A.weight": torch.ones(2, cols),
                   f"base_model.model.{module}.lora_B.weight": torch.ones(rows, 2)},
                  str(folder / "adapter_model.safetensors"))
    assert main(["--checkpoint", str(tiny_checkpoint), *flags(made)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def fp8_errors(ckpt, files, merged_folder, device, dtype):
    """Relative L2 against the merged checkpoint in `dtype` (no FP8) of the FP8 base (--dense-dtype fp8:
    QKV, O, shared MLP, lm_head in e4m3) with the adapters unmerged in `dtype`, and without them; the
    AR tokens and ratio forced to the merged run's, so that every velocity sees the same sequence."""
    def run(folder, dense_dtype, adapters):
        loaded = load(folder, get_plan("single"), dtype=dtype, device=device, dense_dtype=dense_dtype)
        pipe = _without_vae(HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, torch.device(device)))
        if adapters:
            pipe.loras = ResidentLoras(loaded, dtype)
            for name, _ in ADAPTERS:
                pipe.loras.load(name, files[name])
        return pipe
    want = run(merged_folder, "model", False).generate(REQUEST)
    forced = replace(REQUEST, forced_tokens=tuple(want.tokens), forced_ratio=want.ratio_index)
    out = {}
    for label, adapters in (("fp8 + adapters", True), ("fp8, no adapter", False)):
        got = run(ckpt, "fp8", adapters).generate(replace(forced, loras=ADAPTERS if adapters else ()))
        out[label] = {"prefill_logits": _rel_l2(got.record["ar_logits"][0], want.record["ar_logits"][0]),
                      **{f"velocity_step{i + 1}": _rel_l2(g, w) for i, (g, w) in
                         enumerate(zip(got.record["velocity"], want.record["velocity"]))}}
    return out


# The FP8 base with the adapters unmerged against the merged checkpoint (relative L2); the FP8 error of
# the base alone (test_fp8_dense.py's table) bounds it the same way. See the module's table.
FP8_BOUNDS = {"prefill_logits": 0.15, "velocity_step1": 0.1, "velocity_step2": 0.1}


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)],
                         ids=["cpu-float32", "gpu-bf16"])
def test_fp8_base_with_unmerged_adapters_stays_near_the_merged_checkpoint(tiny_checkpoint, files, device, dtype):
    errors = fp8_errors(tiny_checkpoint, files, files["merged"], device, dtype)
    print({label: {k: round(v, 4) for k, v in e.items()} for label, e in errors.items()})
    for key, bound in FP8_BOUNDS.items():
        assert errors["fp8 + adapters"][key] < bound, (key, errors)
        # the adapters' deltas are there: without them the FP8 base is much further from the merged weights
        assert errors["fp8, no adapter"][key] > 2 * errors["fp8 + adapters"][key], (key, errors)


@pytest.fixture
def float32_convs():
    """float32 means float32 in both runs: with TF32 matmuls or cuDNN convolutions (torch's default for
    convolutions) the patch embedding's convs differ between eager and inductor's layouts by TF32's
    rounding (~1e-3), above a compiled run's few ulps."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
def test_compiled_steps_follow_each_request_s_adapters(tiny_checkpoint, files, float32_convs):
    """--compile (regions, the decode step recorded as a CUDA graph around them) with requests
    that switch adapters: each request's AR logits and velocities equal an eager run with its adapters.
    A recorded decode step bakes in the adapters it ran with: one recording per adapter set, and an
    unload drops them all (`ResidentLoras.graph_key`, `on_change`). On the CPU, the hooks under
    compiled regions are checked in tests/wan/test_wan_lora.py (no graph for a new weight)."""
    from dtgen.compile import CompileOptions, graph_breaks, unique_graphs
    torch._dynamo.reset()

    def pipe_of(options):
        loaded = load(tiny_checkpoint, get_plan("single"), device="cuda")
        pipe = _without_vae(HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cuda",
                                               compile_options=options))
        pipe.loras = ResidentLoras(loaded, torch.float32)
        for name, _ in ADAPTERS:
            pipe.loras.load(name, files[name])
        return pipe
    eager = pipe_of(None)
    compiled = pipe_of(CompileOptions(enabled=True, backend="inductor", regions=True))
    # inductor fuses and reorders float32 math: a few ulps apart (as test_compile.py's bound)
    same = partial(_assert_same, tol=1e-4)
    sets = [(("a", 0.7),), ADAPTERS, (("a", 0.3),), (), (("a", 0.7),)]
    graphs = []
    for loras in sets:
        want = eager.generate(replace(REQUEST, loras=loras))
        forced = replace(REQUEST, loras=loras, forced_tokens=tuple(want.tokens), forced_ratio=want.ratio_index)
        same(_summary(compiled.generate(forced)), _summary(want), f"compiled, {loras}")
        graphs.append(unique_graphs())
    assert graph_breaks() == {}
    assert graphs[2] == graphs[1], graphs   # ("a", 0.3), a weight of a set run before: no new graph
    graphed = compiled.ar_phase.graphed_decode   # one recording per adapter set, the repeated ones replayed
    assert graphed.recorded == 3, graphed.recorded   # {a}, {a, b}, {}
    compiled.loras.unload("b")
    assert not graphed._recordings
    same(_summary(compiled.generate(replace(forced, loras=(("a", 0.7),)))),
         _summary(eager.generate(replace(forced, loras=(("a", 0.7),)))), "after the unload")
    assert graphed.recorded == 4
