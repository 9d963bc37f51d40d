"""LoRA adapters on Qwen-Image (dtgen/lora) against diffusers 0.42 + peft on the tiny default: files
diffusers writes (rank/alpha header, rank and alpha patterns, alpha != r), one adapter at 0.7, two
stacked, folded into the weights, rows of one batch carrying different adapters, every plan on
gloo CPU ranks against one process, and the one-line refusals. CPU, float32."""
import dataclasses
import itertools

import pytest
import torch

from dtgen.launch import RankPool
from dtgen.lora import LoraError, ResidentLoras
from models.qwen_image.model import load
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest
from models.qwen_image.tiny import ensure_tiny_checkpoint
from placements.qwen_image import PLANS, get_plan
from tests.support.batching import assert_rel_close, quiet
from tests.support.lora import diffusers_transformer, diffusers_with, save_adapter

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

# Column-split (to_q/k/v, add_*_proj, net.0.proj), row-split (to_out.0, to_add_out, net.2) and
# replicated (img_mod.1) targets of the TP2 plan, so every sharding rule runs.
TARGETS_A = ["to_q", "to_k", "to_v", "add_k_proj", "to_out.0", "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
             "txt_mlp.net.2", "img_mod.1"]
TARGETS_B = ["to_q", "add_q_proj", "add_v_proj", "txt_mlp.net.0.proj", "img_mlp.net.2", "txt_mod.1"]
REQUEST = T2IRequest(prompt="a red fox runs on the snow at night", negative_prompt="blurry", height=48, width=80,
                     steps=2, true_cfg_scale=4.0, seed=5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("qwen-lora"))


@pytest.fixture(scope="module")
def files(ckpt, tmp_path_factory):
    """Adapter a: r 4, alpha 6 (to_k: r 2, alpha 3); adapter b: r 2, alpha 5."""
    root = tmp_path_factory.mktemp("qwen-lora-files")
    source = diffusers_transformer(diffusers.QwenImageTransformer2DModel, ckpt)
    a = save_adapter(diffusers.QwenImagePipeline, source, root / "a", r=4, alpha=6, targets=TARGETS_A, seed=1,
                     rank_pattern={"to_k": 2}, alpha_pattern={"to_k": 3})
    b = save_adapter(diffusers.QwenImagePipeline, source, root / "b", r=2, alpha=5, targets=TARGETS_B, seed=2)
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def built(ckpt):
    return load(ckpt, get_plan("single"))


def _inputs(batch: int = 2):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 12, 64, generator=g), torch.tensor([0.9, 0.31, 0.5][:batch]),
            torch.randn(batch, 9, 32, generator=g))


def _reference(ckpt, files, adapters):
    ref = diffusers_with(diffusers.QwenImagePipeline,
                         diffusers_transformer(diffusers.QwenImageTransformer2DModel, ckpt),
                         [(files[n], w) for n, w in adapters])
    x, t, text = _inputs()
    with torch.no_grad():
        return ref, ref(hidden_states=x, encoder_hidden_states=text, timestep=t, img_shapes=[[(1, 4, 3)]] * 2,
                        return_dict=False)[0]


@torch.no_grad()
def _ours(built, loras, adapters):
    loras.set_default(tuple(adapters))
    try:
        x, t, text = _inputs()
        return built.model.transformer(x, t, text, 4, 3)
    finally:
        loras.set_default(())


@pytest.fixture(scope="module")
def loras(built, files):
    loras = ResidentLoras(built, torch.float32)
    for name, path in files.items():
        loras.load(name, path)
    return loras


@pytest.mark.parametrize("adapters", [[("a", 0.7)], [("a", 0.7), ("b", -0.5)]], ids=["one-at-0.7", "two-stacked"])
def test_transformer_with_adapters_matches_diffusers(ckpt, files, built, loras, adapters):
    _, want = _reference(ckpt, files, adapters)
    got = _ours(built, loras, adapters)
    base = _ours(built, loras, [])
    assert float((want - base).abs().max()) > 1e-2   # the adapters change the output far beyond the tolerance
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)   # measured: 1.2e-7


def test_folded_adapter_matches_diffusers_fused_and_unfused(ckpt, files, built, loras):
    """--lora-merge: W + 0.7 s B A folded at load equals diffusers' fuse_lora and the unmerged delta."""
    ref, unfused = _reference(ckpt, files, [("a", 0.7)])
    ref.fuse_lora(adapter_names=["a0"])
    x, t, text = _inputs()
    with torch.no_grad():
        fused = ref(hidden_states=x, encoder_hidden_states=text, timestep=t, img_shapes=[[(1, 4, 3)]] * 2,
                    return_dict=False)[0]
        merged = load(ckpt, get_plan("single"))
        ResidentLoras(merged, torch.float32).merge(files["a"], 0.7)
        got = merged.model.transformer(x, t, text, 4, 3)
    torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, _ours(built, loras, [("a", 0.7)]), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rows_with_different_adapters_equal_each_row_alone(built, loras):
    x, t, text = _inputs(3)
    rows = [(("a", 0.7),), (("b", 0.5), ("a", -0.2)), ()]
    loras.set_rows(rows)
    together = built.model.transformer(x, t, text, 4, 3)
    for i, row in enumerate(rows):
        loras.set_rows([row])
        alone = built.model.transformer(x[i:i + 1], t[i:i + 1], text[i:i + 1], 4, 3)
        assert_rel_close(together[i:i + 1], alone, 1e-5, f"row {i}")
    loras.set_rows(None)


def _pipe(ckpt, files, plan="single", rank=0, world=1):
    import torch.distributed as dist
    loaded = load(ckpt, get_plan(plan), rank, world)
    pipe = QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0,
                             vae_group=dist.group.WORLD if world > 1 else None)
    pipe.loras = ResidentLoras(loaded, torch.float32)
    for name, path in files.items():
        pipe.loras.load(name, path)
    return pipe


def _batch():
    """Two requests as rows of one batch: one with two adapters stacked, one with none."""
    return [dataclasses.replace(REQUEST, loras=(("a", 0.7), ("b", 0.5)), seed=6), dataclasses.replace(REQUEST, seed=7)]


def job_plan(ctx, ckpt, files, plan):
    pipe = _pipe(ckpt, files, plan, ctx.rank, ctx.world_size)
    return [r.latents for r in pipe.generate_batch(_batch(), quiet(2), decode=False)]


def test_every_plan_and_a_mixed_batch_match_one_process(ckpt, files):
    """TP2 (A whole and B split for the column-split targets, A split and B whole for the row-split
    ones, the partial sums reduced with the base's), Ulysses SP2 and CFG2: the batch of a request
    with two adapters and one with none equals each request alone on one process."""
    single = _pipe(ckpt, files)
    batch = _batch()
    alone = [single.generate(r, decode=False).latents for r in batch]
    base = single.generate(dataclasses.replace(batch[0], loras=()), decode=False).latents
    assert float((alone[0] - base).abs().max()) > 1e-2   # the adapters move the result far beyond the tolerance
    for got, one in zip(single.generate_batch(batch, quiet(2), decode=False), alone):
        assert_rel_close(got.latents, one, 1e-5, "single, batch")
    with RankPool(2, timeout_s=240) as pool:
        for plan in [n for n, p in PLANS.items() if p.world_size == 2]:
            for rank, got in enumerate(pool.run(job_plan, ckpt, files, plan)):
                for g, one in zip(got, alone, strict=True):
                    assert_rel_close(g, one, 1e-5, f"plan {plan}, rank {rank}")


def _write(path, tensors, metadata=None):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def _refused(match: str, fn, *args, error=LoraError):
    with pytest.raises(error) as e:
        fn(*args)
    text = str(e.value)
    assert "\n" not in text and match in text, text


def test_bad_input_is_refused_in_one_line_and_leaves_the_resident_adapters(ckpt, files, built, loras, tmp_path):
    import json

    from safetensors.torch import load_file
    good = load_file(files["a"])
    key = "transformer.transformer_blocks.0.attn.to_q"
    pair = {key + ".lora_A.weight": good[key + ".lora_A.weight"], key + ".lora_B.weight": good[key + ".lora_B.weight"]}
    before = (dict(loras.adapters), dict(loras._hooks))
    bad = {
        "match nothing": {**pair, "transformer.blocks.0.attn9.lora_A.weight": torch.ones(4, 8),
                          "transformer.blocks.0.attn9.lora_B.weight": torch.ones(8, 4)},
        "do not fit": {key + ".lora_A.weight": torch.ones(4, 63), key + ".lora_B.weight": torch.ones(64, 4)},
        "NaN or inf": {**pair, key + ".lora_B.weight": torch.full((64, 4), float("nan"))},
        "kohya": {"lora_unet_blocks_0.lora_down.weight": torch.ones(2, 2)},
        "`.alpha` tensors": {**pair, key + ".alpha": torch.tensor(4.0)},
        "only lora_A": {key + ".lora_A.weight": torch.ones(4, 64)},
    }
    for i, (match, tensors) in enumerate(bad.items()):
        _refused(match, loras.load, f"bad{i}", _write(tmp_path / f"bad{i}.safetensors", tensors))
    # an adapter for another model: the Wan DiT's module names
    wan = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.ones(2, 32),
           "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.ones(64, 2)}
    _refused("another model", loras.load, "wan", _write(tmp_path / "wan.safetensors", wan))
    # a rank that is not the header's, a file that is not safetensors, a missing one, a name twice
    header = {"lora_adapter_metadata": json.dumps({"transformer.r": 8, "transformer.lora_alpha": 8})}
    _refused("has rank 4, but its config says r=8", loras.load, "r", _write(tmp_path / "r.safetensors", pair, header))
    (tmp_path / "text.safetensors").write_text("not a tensor file")
    _refused("not a safetensors file", loras.load, "text", tmp_path / "text.safetensors")
    _refused("no such file", loras.load, "missing", tmp_path / "missing.safetensors")
    _refused("already loaded", loras.load, "a", files["a"])
    assert (dict(loras.adapters), dict(loras._hooks)) == before   # nothing resident changed
    # weights and names a row carries
    _refused("not finite", loras.set_rows, [(("a", float("inf")),)])
    _refused("is not loaded", loras.set_rows, [(("zzz", 1.0),)])
    _refused("not finite", loras.merge, files["a"], float("nan"))


def test_folding_into_fp8_weights_is_refused(ckpt, files):
    """--lora-merge on FP8 weights would re-quantize them: refused before any weight changes."""
    loaded = load(ckpt, get_plan("single"))
    name = "transformer.transformer_blocks.0.attn.to_q.weight"
    loaded.storage.specs[name] = dataclasses.replace(loaded.storage.specs[name], fp8="channels")
    weights = {n: t.clone() for n, t in loaded.storage.tensors.items()}
    _refused("FP8", ResidentLoras(loaded, torch.float32).merge, files["a"], 0.7)
    assert all(torch.equal(t, weights[n]) for n, t in loaded.storage.tensors.items())


def test_flags_and_request_field_are_refused_in_one_line(files, tmp_path):
    import argparse

    from dtgen.lora.flags import lora_problem, parse_lora_flag
    from dtgen.requests import RequestError
    from dtgen.schema import parse_loras

    def problem(*loras, merge=False, dense="model"):
        return lora_problem(argparse.Namespace(lora=list(loras), lora_merge=merge, dense_dtype=dense))
    assert parse_lora_flag(f"{files['a']}:0.8") == (str(files["a"]), 0.8)
    assert parse_lora_flag(str(files["a"])) == (str(files["a"]), 1.0)
    assert problem(f"{files['a']}:0.8", f"{files['b']}:-0.5") is None
    for text, match in ((problem(f"{files['a']}:inf"), "not a finite number"),
                        (problem(str(files["a"]), str(files["b"]), merge=True), "exactly one --lora"),
                        (problem(str(files["a"]), merge=True, dense="fp8"), "--dense-dtype fp8"),
                        (problem(str(tmp_path / "none.safetensors")), "no such file"),
                        (problem(str(files["a"]), f"{files['a']}:0.5"), "given twice")):
        assert text is not None and text.startswith("--lora") and match in text and "\n" not in text, text
    assert parse_loras([{"name": "a", "weight": 0.5}, ["b", 1]]) == (("a", 0.5), ("b", 1.0))
    for value, field in (([{"name": "a", "weight": float("nan")}], "loras[0].weight"),
                         ([{"name": ""}], "loras[0].name"), ([{"name": "a", "scale": 1}], "loras[0].scale"),
                         ("a", "loras"),
                         ([{"name": "a"}, {"name": "a"}], "loras[1].name")):
        with pytest.raises(RequestError) as e:
            parse_loras(value)
        assert e.value.field == field, (value, e.value.field)


def test_a_peft_adapter_folder_reads_as_the_diffusers_file(ckpt, built, tmp_path):
    """peft's own `save_pretrained` folder (adapter_config.json + adapter_model.safetensors, keys
    `base_model.model.<path>`, no component prefix) gives the delta of the same adapter in diffusers'
    file (rank and alpha patterns included)."""
    from peft import LoraConfig, get_peft_model
    source = diffusers_transformer(diffusers.QwenImageTransformer2DModel, ckpt)
    config = LoraConfig(r=4, lora_alpha=6, target_modules=["to_q", "to_k", "img_mlp.net.2"],
                        rank_pattern={"to_k": 2}, alpha_pattern={"to_k": 3}, init_lora_weights=False)
    torch.manual_seed(3)
    peft_model = get_peft_model(source, config)
    peft_model.save_pretrained(tmp_path / "peft")
    x, t, text = _inputs()
    with torch.no_grad():
        want = peft_model(hidden_states=x, encoder_hidden_states=text, timestep=t, img_shapes=[[(1, 4, 3)]] * 2,
                          return_dict=False)[0]
    loras = ResidentLoras(built, torch.float32)
    loras.load("peft", tmp_path / "peft")
    try:
        torch.testing.assert_close(_ours(built, loras, [("peft", 1.0)]), want, atol=1e-5, rtol=1e-5)
    finally:
        loras.unload("peft")


def test_the_command_refuses_an_adapter_for_another_model_before_any_rank_starts(files, tmp_path):
    """`dtgen run --lora`: names and shapes matched against the checkpoint's headers in `prepare`."""
    from models.qwen_image.cli import COMMAND as cli
    wan = _write(tmp_path / "wan.safetensors", {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.ones(2, 32),
                                                "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.ones(64, 2)})
    for given, match in (([f"{wan}:0.5"], "another model"), ([str(files["a"]), str(files["b"])], None)):
        argv = [a for f in given for a in ("--lora", f)] + ["--output", str(tmp_path / "x.png")]
        problem, _ = cli.prepare(cli.parse_args(argv))
        assert (problem is None) if match is None else (match in problem and problem.startswith("--lora")), problem


@torch.no_grad()
def test_blocks_on_some_rows_carry_those_rows_adapters(built, loras):
    """A first-block step that runs the later blocks on some rows only (`DenoiserCall.row_blocks`)
    gives each picked row its own adapters (`ResidentLoras.picked_rows`)."""
    x, t, text = _inputs(3)
    rows = [(("a", 0.7),), (("b", 0.5),), ()]
    loras.set_rows(rows)
    together = built.model.transformer(x, t, text, 4, 3)
    picked = [2, 0]
    with loras.picked_rows(picked):
        some = built.model.transformer(x[picked], t[picked], text[picked], 4, 3)
    again = built.model.transformer(x, t, text, 4, 3)   # the whole batch's rows again after it
    loras.set_rows(None)
    assert_rel_close(some, together[picked], 1e-5, "picked rows")
    torch.testing.assert_close(again, together)


def test_a_step_cached_batch_of_different_adapters_equals_each_request_alone(ckpt, files):
    """first-block on a batch whose rows carry adapter a, adapter b and none, its threshold between
    the requests' measures at one step (read off a run without reuse), so that the later blocks run
    on some rows only, each with its own adapters."""
    pipe = _pipe(ckpt, files)
    base = T2IRequest(prompt="a red fox runs on the snow at night", negative_prompt="blurry", height=64, width=48,
                      steps=5, true_cfg_scale=4.0, seed=1, step_cache="first-block:threshold=0.001")
    reqs = [dataclasses.replace(base, loras=(("a", 1.5),)), dataclasses.replace(base, seed=2, loras=(("b", -1.0),)),
            dataclasses.replace(base, seed=3)]
    measures = [pipe.generate(r, decode=False).record["step_cache"]["first_block_diff"] for r in reqs]
    # the first step k where a threshold 0.01 away from every measure splits the requests, with every
    # earlier measure above it (so the decisions before step k are all "run in full")
    threshold = next(t for k in range(2, base.steps) for lo, hi in itertools.pairwise(sorted(m[k][0] for m in measures))
                     if hi - lo > 0.02 and (t := (lo + hi) / 2) < min(m[j][0] for m in measures for j in range(1, k)))
    reqs = [dataclasses.replace(r, step_cache=f"first-block:threshold={threshold:.4f}") for r in reqs]
    alone = [pipe.generate(r, decode=False) for r in reqs]
    steps = [tuple(r.record["step_cache"]["full_steps"]) for r in alone]
    assert len(set(steps)) > 1, steps   # the requests decide differently: blocks on some rows only
    together = pipe.generate_batch(reqs, quiet(3), decode=False, record=True)
    for i, (got, want) in enumerate(zip(together, alone)):
        assert tuple(got.record["step_cache"]["full_steps"]) == steps[i]
        assert_rel_close(got.latents, want.latents, 1e-5, f"request {i}")
