"""LoRA adapters on Wan (dtgen/lora) against diffusers 0.42 + peft on the tiny default: files diffusers
writes (alpha != r, rank and alpha patterns), one adapter at 0.7, two stacked, folded into the
weights, rows of one batch carrying different adapters, every plan on gloo CPU ranks against one
process. CPU, float32."""
import dataclasses

import pytest
import torch

from dtgen.launch import RankPool
from dtgen.lora import ResidentLoras
from models.wan.model import load
from models.wan.pipeline import T2VRequest, WanT2VPipeline
from models.wan.tiny import ensure_tiny_checkpoint
from placements.wan import PLANS, get_plan
from tests.support.batching import assert_rel_close, quiet
from tests.support.lora import diffusers_transformer, diffusers_with, save_adapter

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

# Self- and cross-attention, the FFN, the time and text embedders and the output projection (the
# embedders and proj_out keep float32 under bf16; the DiT is replicated on every Wan plan).
TARGETS_A = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_k", "attn2.to_out.0",
             "ffn.net.0.proj", "ffn.net.2", "time_embedder.linear_1", "text_embedder.linear_2", "proj_out"]
TARGETS_B = ["attn1.to_q", "attn2.to_q", "attn2.to_v", "ffn.net.2", "time_proj"]
# 9 frames -> 3 latent frames, 48 x 32 px -> 3 x 2 patches: 18 tokens (SP4 pads them).
REQUEST = T2VRequest(prompt="a red fox runs on the snow", negative_prompt="blurry", height=48, width=32,
                     num_frames=9, steps=2, guidance_scale=5.0, seed=11)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("wan-lora"))


@pytest.fixture(scope="module")
def files(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-lora-files")
    source = diffusers_transformer(diffusers.WanTransformer3DModel, ckpt)
    a = save_adapter(diffusers.WanPipeline, source, root / "a", r=4, alpha=6, targets=TARGETS_A, seed=1,
                     rank_pattern={"ffn.net.2": 2}, alpha_pattern={"ffn.net.2": 5})
    b = save_adapter(diffusers.WanPipeline, source, root / "b", r=2, alpha=3, targets=TARGETS_B, seed=2)
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def built(ckpt):
    return load(ckpt, get_plan("single"))


@pytest.fixture(scope="module")
def loras(built, files):
    loras = ResidentLoras(built, torch.float32)
    for name, path in files.items():
        loras.load(name, path)
    return loras


def _inputs(batch: int = 2):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 16, 3, 6, 4, generator=g), torch.tensor([900.0, 310.0, 500.0][:batch]),
            torch.randn(batch, 7, 32, generator=g))


@torch.no_grad()
def _ours(model, loras, adapters):
    loras.set_default(tuple(adapters))
    try:
        return model.transformer(*_inputs())
    finally:
        loras.set_default(())


def _reference(ckpt, files, adapters):
    ref = diffusers_with(diffusers.WanPipeline, diffusers_transformer(diffusers.WanTransformer3DModel, ckpt),
                         [(files[n], w) for n, w in adapters])
    with torch.no_grad():
        return ref, ref(*_inputs(), return_dict=False)[0]


@pytest.mark.parametrize("adapters", [[("a", 0.7)], [("a", 0.7), ("b", -0.5)]], ids=["one-at-0.7", "two-stacked"])
def test_transformer_with_adapters_matches_diffusers(ckpt, files, built, loras, adapters):
    _, want = _reference(ckpt, files, adapters)
    got = _ours(built.model, loras, adapters)
    assert float((want - _ours(built.model, loras, [])).abs().max()) > 1e-2   # far beyond the tolerance
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_folded_adapter_matches_diffusers_fused_and_unfused(ckpt, files, built, loras):
    ref, unfused = _reference(ckpt, files, [("a", 0.7)])
    ref.fuse_lora(adapter_names=["a0"])
    with torch.no_grad():
        fused = ref(*_inputs(), return_dict=False)[0]
        merged = load(ckpt, get_plan("single"))
        ResidentLoras(merged, torch.float32).merge(files["a"], 0.7)
        got = merged.model.transformer(*_inputs())
    torch.testing.assert_close(fused, unfused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, _ours(built.model, loras, [("a", 0.7)]), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rows_with_different_adapters_equal_each_row_alone(built, loras):
    x, t, text = _inputs(3)
    rows = [(("a", 0.7),), (("b", 0.5), ("a", -0.2)), ()]
    loras.set_rows(rows)
    together = built.model.transformer(x, t, text)
    for i, row in enumerate(rows):
        loras.set_rows([row])
        alone = built.model.transformer(x[i:i + 1], t[i:i + 1], text[i:i + 1])
        assert_rel_close(together[i:i + 1], alone, 1e-5, f"row {i}")
    loras.set_rows(None)


@torch.no_grad()
def test_a_compiled_region_is_not_compiled_again_for_other_weights_rows_or_blocks(built, loras):
    """The hooks read tensors made by `set_rows` from the module they run on, not the rows' names and
    weights nor the module's name: the DiT's block compiled as one region for every block (the GPU's
    compile mode; dynamo's tracing alone, fullgraph) takes one graph for no adapter, one for every
    row alike and one for rows that differ, and none for other weights, the same adapters on other
    rows or another block."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    dit = built.model.transformer
    assert dit.num_blocks == 2
    plain = dit.run_block
    dit.run_block = torch.compile(plain, backend="eager", fullgraph=True)
    x, t, text = _inputs(2)
    graphs = []
    try:
        for rows in [None, [(("a", 0.7),)] * 2, [(("a", -0.3),)] * 2, [(("a", 0.7),), (("b", 0.5),)],
                     [(("b", 0.1),), (("a", 0.4),)], [(("a", 0.2),), (("b", -1.0),)], [(("a", 0.7),)] * 2]:
            loras.set_rows(rows)
            before = counters["stats"]["unique_graphs"]
            got = dit(x, t, text)
            graphs.append(counters["stats"]["unique_graphs"] - before)
            dit.run_block = plain
            assert_rel_close(got, dit(x, t, text), 1e-5, f"rows {rows}")
            dit.run_block = torch.compile(plain, backend="eager", fullgraph=True)
    finally:
        dit.run_block = plain
        loras.set_rows(None)
    assert graphs == [1, 1, 0, 1, 0, 0, 0], graphs


def _pipe(ckpt, files, plan="single", rank=0, world=1):
    loaded = load(ckpt, get_plan(plan), rank, world)
    pipe = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0)
    pipe.loras = ResidentLoras(loaded, torch.float32)
    for name, path in files.items():
        pipe.loras.load(name, path)
    return pipe


def _batch():
    """Two requests as rows of one batch: one with two adapters stacked, one with none (Wan runs
    both CFG branches as rows of one call: 4 rows)."""
    return [dataclasses.replace(REQUEST, loras=(("a", 0.7), ("b", 0.5)), seed=6), dataclasses.replace(REQUEST, seed=7)]


def job_plan(ctx, ckpt, files, plan):
    pipe = _pipe(ckpt, files, plan, ctx.rank, ctx.world_size)
    return [r.latents for r in pipe.generate_batch(_batch(), quiet(2), decode=False)]


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_every_plan_and_a_mixed_batch_match_one_process(ckpt, files, world):
    """Every plan (the SP kinds and CFG2; the DiT is replicated, so each pair is whole): the batch of
    a request with two adapters and one with none equals each request alone on one process."""
    single = _pipe(ckpt, files)
    batch = _batch()
    alone = [single.generate(r, decode=False).latents for r in batch]
    base = single.generate(dataclasses.replace(batch[0], loras=()), decode=False).latents
    assert float((alone[0] - base).abs().max()) > 1e-2   # the adapters move the result far beyond the tolerance
    for got, one in zip(single.generate_batch(batch, quiet(2), decode=False), alone):
        assert_rel_close(got.latents, one, 1e-5, "single, batch")
    with RankPool(world, timeout_s=240) as pool:
        for plan in [n for n, p in PLANS.items() if p.world_size == world]:
            for rank, got in enumerate(pool.run(job_plan, ckpt, files, plan)):
                for g, one in zip(got, alone, strict=True):
                    assert_rel_close(g, one, 1e-5, f"plan {plan}, rank {rank}")


def test_an_adapter_for_the_low_noise_expert(tmp_path, files):
    """Wan2.2-A14B: the same file loaded under LORA_PREFIXES_EXPERT_2 goes into `transformer_2` (what
    diffusers' `load_into_transformer_2` does) and leaves the high-noise expert as it was."""
    from models.wan.model import LORA_PREFIXES_EXPERT_2
    from models.wan.tiny import write_random_checkpoint
    from safetensors.torch import load_file
    folder = tmp_path / "a14b"
    folder.mkdir()
    write_random_checkpoint(folder, seed=7, two_experts=True)
    built = load(folder, get_plan("single"))
    cls = diffusers.WanTransformer3DModel
    ref = cls.from_config(cls.load_config(folder / "transformer_2"))
    ref.load_state_dict(load_file(folder / "transformer_2" / "diffusion_pytorch_model.safetensors"))
    ref = diffusers_with(diffusers.WanPipeline, ref.eval(), [(files["a"], 0.7)])
    loras = ResidentLoras(built, torch.float32)
    with torch.no_grad():
        high = built.model.transformer(*_inputs())
        loras.load("a", files["a"], prefixes=LORA_PREFIXES_EXPERT_2)
        assert all(m.startswith("transformer_2.") for m in loras.adapters["a"].layers)
        loras.set_default((("a", 0.7),))
        torch.testing.assert_close(built.model.transformer_2(*_inputs()), ref(*_inputs(), return_dict=False)[0],
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(built.model.transformer(*_inputs()), high, atol=0, rtol=0)
