"""Bad input gets a clear error naming the problem, and leaves nothing half-written."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dtgen.checkpoint import CheckpointError, CheckpointReader
from dtgen.devices import parse_device, parse_dtype
from dtgen.plan import match_rules, resolve
from dtgen.storage import StorageShard, planned_nbytes
from models.hunyuan_image3.config import ConfigError, HunyuanImage3Config
from models.hunyuan_image3.loading import build_on_meta, load, param_specs
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest
from models.hunyuan_image3.resolutions import parse_image_size
from placements.hunyuan_image3 import get_plan


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    """A private, writable copy of the tiny checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    return dst


def _shard_with(ckpt, key):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    return ckpt / index["weight_map"][key], index


def _rewrite(ckpt, key, fn):
    """Apply fn(tensors) to the shard holding `key`, keeping the index consistent."""
    path, index = _shard_with(ckpt, key)
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if k in tensors or f != path.name}
    index["weight_map"].update({k: path.name for k in tensors})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_keys_are_listed(ckpt):
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    _rewrite(ckpt, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=r"missing keys \(1\).*experts\.3\.down_proj"):
        load(ckpt, get_plan("single"))


def test_unexpected_keys_are_listed(ckpt):
    key = "model.ln_f.weight"
    _rewrite(ckpt, key, lambda t: t.update({"model.extra_head.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys \(1\).*model\.extra_head\.weight"):
        load(ckpt, get_plan("single"))


def test_unused_t2i_keys_are_ignored(ckpt):
    """Text-to-image on a checkpoint that can also edit images: the SigLIP tower, its aligner
    and the VAE encoder are in it (the tiny default has them) but not loaded, and the tower's
    pooling head, never used, is not an error either."""
    key = "model.ln_f.weight"
    _rewrite(ckpt, key, lambda t: t.update({"vision_model.head.probe.weight": torch.zeros(2)}))
    model = load(ckpt, get_plan("single")).model
    assert model.vision_model is None and model.vae.encoder is None
    assert load(ckpt, get_plan("single"), image_editing=True).model.vision_model is not None


def test_shape_mismatch_names_key_expected_and_found(ckpt):
    key = "model.layers.0.self_attn.o_proj.weight"
    _rewrite(ckpt, key, lambda t: t.update({key: torch.zeros(256, 128, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"shape mismatch for model\.layers\.0\.self_attn\.o_proj\.weight: "
                                              r"expected \[256, 256\], found \[256, 128\]"):
        load(ckpt, get_plan("single"))


def test_truncated_safetensors(ckpt):
    path, _ = _shard_with(ckpt, "model.ln_f.weight")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{path.name}: truncated"):
        CheckpointReader(ckpt)


def test_corrupt_safetensors_header(ckpt):
    path, _ = _shard_with(ckpt, "model.ln_f.weight")
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{path.name}: corrupt"):
        CheckpointReader(ckpt)


def test_pickle_checkpoint_refused(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle checkpoints are refused"):
        CheckpointReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "pytorch_model.bin"}}))
    with pytest.raises(CheckpointError, match="pickle checkpoints are refused"):
        CheckpointReader(tmp_path)


def test_single_file_checkpoint(tmp_path):
    save_file({"a": torch.arange(6.0).view(2, 3)}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert reader.read("a", 1, 1, 3).tolist() == [[1.0, 2.0], [4.0, 5.0]]
    assert reader.bytes_read == 4 * 4


def test_unsupported_rope_type(tiny_checkpoint):
    cfg = json.loads((tiny_checkpoint / "config.json").read_text())
    with pytest.raises(ConfigError, match="unsupported rope_type 'yarn'"):
        HunyuanImage3Config.from_dict({**cfg, "rope_type": "yarn"})
    with pytest.raises(ConfigError, match="unsupported rope_scaling"):
        HunyuanImage3Config.from_dict({**cfg, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="missing required field 'hidden_size'"):
        HunyuanImage3Config.from_dict({k: v for k, v in cfg.items() if k != "hidden_size"})


def test_prompt_longer_than_position_budget(tiny_checkpoint):
    loaded = load(tiny_checkpoint, get_plan("single"))
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    with pytest.raises(ValueError, match=r"needs \d+ positions; the model's max_position_embeddings is 2048"):
        pipe.generate(T2IRequest(prompt="x" * 3000, steps=1))


def test_image_size_outside_table():
    assert parse_image_size("auto", 1024) is None
    assert parse_image_size("1024x1024", 1024) == 16
    with pytest.raises(ValueError, match=r"image size 1000x1000 is not in the resolution table.*1024x1024"):
        parse_image_size("1000x1000", 1024)
    with pytest.raises(ValueError, match="is not 'auto' or 'HxW'"):
        parse_image_size("big", 1024)


def test_unknown_device_or_dtype():
    with pytest.raises(ValueError, match="unknown device 'tpu0'"):
        parse_device("tpu0")
    with pytest.raises(ValueError, match="unsupported device 'mps'"):
        parse_device("mps")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        parse_dtype("float8", torch.device("cpu"))
    assert parse_dtype(None, torch.device("cpu")) == torch.float32
    assert parse_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1 and <= 1000, got 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 0, got -5"),
    (["--image-size", "123x45"], "--image-size 123x45 is not one of the model's sizes (WIDTHxHEIGHT); nearest:"),
    (["--image-size", "big"], "--image-size 'big' is not 'auto' or 'WIDTHxHEIGHT'"),
    # in the table, but more than the tiny model's 2048 positions: one line up front, not a traceback
    (["--image-size", "1024x768"], "--image-size a 1024x768 image with this prompt and 16 new tokens needs"),
    (["--temperature", "-1"], "--temperature must be >= 0 and <= 100, got -1"),
    (["--top-p", "2"], "--top-p must be > 0 and <= 1, got 2"),
    (["--top-k", "-1"], "--top-k must be >= 0 (0: off), got -1"),
    (["--guidance", "nan"], "--guidance must be a number, got nan"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--prompt", " "], "--prompt must be a non-empty string"),
    (["--checkpoint", "/nonexistent/ckpt"], "--checkpoint /nonexistent/ckpt: no config.json there"),
    (["--prompt-tokens", "40,x"], "--prompt-tokens '40,x': 'x' is not a length of at least 1"),
    (["--prompt-tokens", "0"], "--prompt-tokens '0': '0' is not a length of at least 1"),
    (["--prompt-tokens", "40", "--prompt", "a fox"], "--prompt-tokens makes its own prompts"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file /nonexistent/prompts.txt: no such file"),
    (["--prompt-bucket", "-1"], "--prompt-bucket must be at least 0, got -1"),
    (["--prompt-tokens", "100000"], "--prompt-tokens: a prompt of 100000 tokens + 16 new tokens + 2 image-head "
                                    "tokens needs 100018 positions; the model has 2048"),
    (["--warmup-shapes", "5000:256x256"], "--warmup-shapes: a prompt of 5000 tokens"),
    (["--warmup-shapes", "0:256x256"], "'0:256x256' is not TOKENS:WIDTHxHEIGHT with TOKENS >= 1"),
    (["--warmup-shapes", "64:auto"], "'64:auto' needs an image size WIDTHxHEIGHT, not 'auto'"),
    (["--warmup-shapes", "64:123x45"], "123x45 is not one of the model's sizes (WIDTHxHEIGHT)"),
    (["--warmup-shapes", "64:256x256", "--no-warmup"], "--warmup-shapes needs the warm-up"),
    (["--image", "/nonexistent/ref.png"], "--image: reference image /nonexistent/ref.png: no such file"),
    (["--system-prompt", "Edit."], "--system-prompt belongs to image editing: give --image too"),
    (["--step-cache", "taylor:interval=0"], "--step-cache 'taylor:interval=0': interval: must be >= 1, got 0"),
    (["--step-cache", "tailor"], "--step-cache 'tailor': method: unknown method 'tailor'"),
    (["--step-cache", "taylor:intervall=5"], "intervall: is not a knob of taylor; its knobs: interval, order"),
    (["--step-cache", "taylor:order=5"], "order: must be >= 0 and <= 4, got 5"),
    (["--step-cache", "first-block"], "--step-cache HunyuanImage-3 runs the step caches taylor, taylorseer"),
    (["--taylor-cache-interval", "3"], "--taylor-cache-interval needs --use-taylor-cache"),
    (["--use-taylor-cache", "--taylor-cache-order", "9"], "--taylor-cache-order must be >= 0 and <= 4, got 9"),
    (["--use-taylor-cache", "--taylor-cache-interval", "0"], "--taylor-cache-interval must be >= 1, got 0"),
    (["--use-taylor-cache", "--step-cache", "taylor"], "give --step-cache or --use-taylor-cache, not both"),
    # a flag that needs another names both (it would otherwise do nothing)
    (["--compile-regions"], "--compile-regions needs --compile (without it every step runs eagerly)"),
    (["--compile-mode", "step"], "--compile-mode needs --compile"),
    (["--compile-backend", "eager"], "--compile-backend needs --compile"),
    (["--compile-autotune"], "--compile-autotune needs --compile"),
    (["--no-cuda-graph"], "--no-cuda-graph needs --compile"),
    (["--compile", "--cuda-graph", "--device", "cpu"], "--cuda-graph applies on CUDA (the decode step's CUDA graph); "
                                                       "this run's device is cpu"),
    (["--compile", "--compile-backend", "eager", "--compile-autotune"], "--compile-autotune tunes inductor's GEMMs"),
    (["--compile", "--compile-regions", "--compile-mode", "step"], "give one of them, not --compile-mode step too"),
    (["--profile-steps", "2"], "--profile-steps needs --profile"),
    (["--profile-top", "40"], "--profile-top needs --profile"),
    (["--profile", "/tmp/dtgen-never-written", "--profile-top", "0"], "--profile-top must be at least 1, got 0"),
    (["--fp8-scales", "blocks"], "--fp8-scales blocks needs --moe-dtype fp8"),
    (["--moe-impl", "scaled_grouped_mm"], "--moe-impl scaled_grouped_mm: MoE implementation 'scaled_grouped_mm' "
                                          "runs FP8 experts only (--moe-dtype fp8)"),
    (["--moe-impl", "scaled_grouped_mm", "--moe-dtype", "fp8", "--fp8-scales", "blocks"],
     "takes one scale per weight row (--fp8-scales channels or tensor), not 'blocks'"),
    (["--moe-impl", "graph", "--moe-dtype", "fp8"],
     "--moe-impl graph: MoE implementation 'graph' runs experts in the model dtype; FP8 experts (--moe-dtype fp8) "
     "take auto, reference, fused, scaled_grouped_mm, gluon"),
    (["--world-size", "4", "--plan", "hybrid-ring", "--attention-dtype", "fp8"],
     "--attention-dtype fp8 runs under the attention kinds ('local', 'ulysses', 'ulysses-pipelined'); this plan "
     "uses ['ring']"),
    (["--vae-chunks", "0"], "--vae-chunks must be at least 1, got 0"),
    (["--moe-token-chunk", "0"], "--moe-token-chunk must be at least 1, got 0"),
    (["--world-size", "2", "--plan", "tp2", "--vae-chunks", "4"], "--vae-chunks applies to a decode on one rank"),
    (["--world-size", "2", "--plan", "tp2", "--vae-layout", "channels-last"],
     "--vae-layout channels-last applies to a decode on one rank"),
    (["--no-vae-parallel"], "--no-vae-parallel splits the VAE decode over several ranks; this run has --world-size 1"),
])
def test_command_line_mistakes_are_one_line(tiny_checkpoint, monkeypatch, capsys, argv, message):
    from models.hunyuan_image3.cli import main
    monkeypatch.setenv("DTGEN_CACHE", str(tiny_checkpoint.parent))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_an_option_the_device_cannot_run_is_one_line(tiny_checkpoint, monkeypatch, capsys):
    """Checked on the rank, where the device is (the launcher never touches a GPU): exit 1 and one
    line naming the flag, no traceback. (The FP8 options run on a CPU, through their emulations.)"""
    from models.hunyuan_image3.cli import main
    monkeypatch.setenv("DTGEN_CACHE", str(tiny_checkpoint.parent))
    assert main(["--moe-dtype", "fp8", "--moe-impl", "scaled_grouped_mm"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --moe-impl scaled_grouped_mm: "), err
    assert "runs on CUDA" in err[0], err


def test_model_that_does_not_fit_is_refused_before_loading(tiny_checkpoint, monkeypatch):
    """The bytes per rank come from the plan before any is allocated; the error names them."""
    from dtgen import storage
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 10 ** 6, 80 * 10 ** 9))
    with pytest.raises(MemoryError, match=r"plan 'single' needs 20,000,000 bytes \(20\.0 MB\) of weights per rank"
                                          r".* has 3\.0 MB free of 80\.0 GB"):
        storage.check_fits(20 * 10 ** 6, torch.device("cuda"), "single", reserve_bytes=0)
    storage.check_fits(2 * 10 ** 6, torch.device("cuda"), "single", reserve_bytes=0)  # fits: no error


@pytest.mark.parametrize("plan, world", [("single", 1), ("hybrid2", 2), ("tp2", 2)])
def test_planned_bytes_equal_what_the_storage_holds(tiny_checkpoint, plan, world):
    cfg = HunyuanImage3Config.from_json(tiny_checkpoint / "config.json")
    resolved = resolve(get_plan(plan), world)
    model = build_on_meta(cfg)
    specs = param_specs(model, match_rules(get_plan(plan), [n for n, _ in model.named_parameters()],
                                           model.unbuilt_modules()), torch.float32)
    planned = planned_nbytes(specs, StorageShard(resolved.storage_tp, 0, resolved.num_micros), torch.float32)
    if world == 1:
        assert planned == load(tiny_checkpoint, get_plan(plan)).storage.nbytes
    else:  # a storage shard of TP degree S holds 1/S of every split weight
        full = planned_nbytes(specs, StorageShard(1, 0, 1), torch.float32)
        assert (planned == full) == (resolved.storage_tp == 1) and planned <= full


def test_image_editing_mistakes_are_one_line(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """--image: a file that is no image, an image too small for the encoders, and a checkpoint
    without the modules that read images (a text-to-image-only config) are each refused in
    one line before anything loads."""
    from PIL import Image

    from models.hunyuan_image3.cli import main
    from models.hunyuan_image3.tiny import tiny_config
    monkeypatch.setenv("DTGEN_CACHE", str(tiny_checkpoint.parent))
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    small = tmp_path / "small.png"
    Image.new("RGB", (8, 40)).save(small)
    t2i_only = tmp_path / "t2i-only"
    t2i_only.mkdir()
    config = {k: v for k, v in tiny_config().items() if k not in ("vit", "vit_aligner", "vit_processor")}
    (t2i_only / "config.json").write_text(json.dumps(config))
    for argv, message in ((["--image", str(text)], "not a readable image file"),
                          (["--image", str(small)], "8x40 (WxH) is too small, each side must be at least"),
                          (["--image", str(small), "--checkpoint", str(t2i_only)],
                           "--image needs a checkpoint that can read images (vision tower, VAE encoder); "
                           "this one has no vit, vit_aligner, vit_processor section")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_attention_fp8_over_the_kernels_head_size_is_one_line(tmp_path, capsys):
    """--attention-dtype fp8 with a head_dim over 128 (the config says it): refused before any
    rank starts (the model's own head size, read from config.json)."""
    from models.hunyuan_image3.cli import main
    from models.hunyuan_image3.tiny import tiny_config
    big = tmp_path / "big-heads"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(dict(tiny_config(), head_dim=256, attention_head_dim=256)))
    assert main(["--checkpoint", str(big), "--attention-dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --attention-dtype fp8: the FP8 attention kernel handles head_dim up to 128; this model "
                   "has 256"], err


DISTIL_CASE = Path(__file__).resolve().parents[3] / "shared" / "golden-taylor" / "hunyuan3_tiny_distil_a"


@pytest.mark.skipif(not DISTIL_CASE.is_dir(), reason="needs ../shared/golden-taylor/hunyuan3_tiny_distil_a")
@pytest.mark.parametrize("argv, message", [
    (["--cfg-mode", "batch"], "--cfg-mode does not apply: this checkpoint is CFG-distilled"),
    (["--cfg-mode", "serial"], "--cfg-mode does not apply: this checkpoint is CFG-distilled"),
    (["--plan", "hybrid-cfg", "--world-size", "4"], "--plan hybrid-cfg splits the CFG branches over ranks, but "
                                                    "this checkpoint is CFG-distilled"),
])
def test_distilled_checkpoint_mistakes_are_one_line(capsys, argv, message):
    from models.hunyuan_image3.cli import main
    assert main(["--checkpoint", str(DISTIL_CASE), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


@pytest.mark.skipif(not DISTIL_CASE.is_dir(), reason="needs ../shared/golden-taylor/hunyuan3_tiny_distil_a")
def test_distilled_config_and_weights_must_agree(tmp_path):
    """cfg_distilled without guidance_emb.* weights (and the other way round): one line each."""
    ckpt = tmp_path / "distil"
    shutil.copytree(DISTIL_CASE, ckpt)
    for name in ("golden.safetensors", "golden.json"):
        (ckpt / name).unlink()
    key = "guidance_emb.mlp.0.weight"
    _rewrite(ckpt, key, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("guidance_emb.")]])
    with pytest.raises(CheckpointError, match=r"says cfg_distilled: true .* has no guidance_emb\.\* weights"):
        load(ckpt, get_plan("single"))
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "cfg_distilled": False, "use_meanflow": False}))
    with pytest.raises(CheckpointError, match=r"has timestep_r_emb\.\* weights .* does not say use_meanflow: true"):
        load(ckpt, get_plan("single"))


def test_request_defaults_come_from_generation_config(tiny_checkpoint, tmp_path):
    """--steps, --guidance, --flow-shift not given: the checkpoint's generation_config.json
    (Instruct-Distil's 8 steps, say); given: the flags; no such file: 50, 5.0, 3.0."""
    from models.hunyuan_image3.cli import _fill_request_defaults, parse_args
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    args = parse_args(["--checkpoint", str(ckpt)])
    _fill_request_defaults(args)
    assert (args.steps, args.guidance, args.flow_shift) == (50, 5.0, 3.0)
    (ckpt / "generation_config.json").write_text(json.dumps({"diff_infer_steps": 8, "diff_guidance_scale": 2.5,
                                                             "flow_shift": 4.0}))
    args = parse_args(["--checkpoint", str(ckpt)])
    _fill_request_defaults(args)
    assert (args.steps, args.guidance, args.flow_shift) == (8, 2.5, 4.0)
    args = parse_args(["--checkpoint", str(ckpt), "--steps", "3"])
    _fill_request_defaults(args)
    assert (args.steps, args.guidance) == (3, 2.5)


def test_compile_mode_defaults_to_regions_on_gpu_and_step_on_cpu(monkeypatch):
    """--compile alone: one region per decoder layer where the ranks run on CUDA, whole steps on
    the CPU (spawned gloo ranks included); the inductor backend unless told otherwise."""
    from argparse import Namespace

    from dtgen.harness import compile_problem

    def resolved(**kw):
        args = Namespace(**{**dict(compile=True, compile_mode=None, compile_regions=False, compile_backend=None,
                                   world_size=1, device="auto"), **kw})
        assert compile_problem(args) is None
        return args.compile_mode, args.compile_backend

    assert resolved(device="cpu") == ("step", "inductor")
    assert resolved(device="cpu", compile_regions=True) == ("regions", "inductor")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolved() == ("regions", "inductor")
    assert resolved(compile_mode="step", compile_backend="aot_eager") == ("step", "aot_eager")
    assert resolved(world_size=2) == ("step", "inductor")   # spawned ranks run on the CPU


def test_a_memory_budget_that_cannot_hold_the_weights_says_what_fp8_experts_take(capsys):
    """The released 32 layers in bf16 on a 96 GB budget: one line before any rank starts, with
    the bf16 bytes and the bytes with FP8 experts (e4m3 + their scales), which fit; with FP8
    experts on 80 GB: refused without an alternative (they are FP8 already). The model is built
    on meta only."""
    from models.hunyuan_image3.cli import main
    base = ["--random-weights", "full", "--dtype", "bfloat16", "--prompt-tokens", "100"]
    assert main(base + ["--memory-budget", "96"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert ("needs 166,100,372,044 bytes (166.1 GB) of weights per rank in bfloat16, plus a 1.1 GB working reserve, "
            "but the memory budget (--memory-budget) is 96.0 GB: with --moe-dtype fp8 they would take "
            "88,874,846,796 bytes (88.9 GB: the experts 77.3 GB in e4m3 + 83.9 MB of scales), which fits: add "
            "--moe-dtype fp8") in err[0], err
    assert main(base + ["--memory-budget", "80", "--moe-dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 88,874,846,796 bytes (88.9 GB)" in err[0] and "with --moe-dtype" not in err[0], err
    assert main(base + ["--memory-budget", "0"]) == 2
    assert "--memory-budget must be > 0 GB, got 0.0" in capsys.readouterr().err


def test_fp8_alternative_is_what_the_fp8_build_plans(tiny_checkpoint):
    """The refusal's FP8 bytes are exactly what `--moe-dtype fp8` would hold (e4m3 experts and
    their per-row scales), and a budget below the weights is refused before a byte is read."""
    from dtgen.build import planned_storage
    from dtgen.storage import ResidentStorage, fit_problem
    from models.hunyuan_image3.loading import HunyuanAdapter
    cfg = HunyuanImage3Config.from_json(tiny_checkpoint / "config.json")
    for plan, world in (("single", 1), ("tp2", 2)):
        bf16, alternative = planned_storage(HunyuanAdapter(cfg), get_plan(plan), world, torch.bfloat16)
        fp8, none = planned_storage(HunyuanAdapter(cfg, fp8_experts=True), get_plan(plan), world, torch.bfloat16,
                                    "channels")
        assert none is None and alternative.total_bytes == fp8 < bf16, (plan, alternative, fp8, bf16)
    text = fit_problem(bf16, "cuda:0", "tp2", 0, budget_bytes=fp8 - 1, free_bytes=10 * bf16, total_bytes=10 * bf16,
                       alternative=alternative)
    assert "the memory budget (--memory-budget) is" in text and "which does not fit either" in text, text
    assert fit_problem(bf16, "cuda:0", "tp2", 0, budget_bytes=fp8, alternative=alternative).count("which fits") == 1
    assert fit_problem(bf16, "cpu", "single", 0) is None          # the CPU without a budget: not checked

    def no_read(*a, **k):
        raise AssertionError("a weight was read")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ResidentStorage, "load", no_read)
        with pytest.raises(MemoryError, match=r"plan 'single' needs .* but the memory budget \(--memory-budget\) is "
                                              r"1\.0 MB: with --moe-dtype fp8 they would take"):
            load(tiny_checkpoint, get_plan("single"), memory_budget_bytes=10 ** 6)
