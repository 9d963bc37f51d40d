"""Qwen-Image's plans (TP2, Ulysses SP2, CFG2, each with the VAE decode split over both ranks)
on 2 gloo CPU ranks against one process, on the tiny default. CPU, float32."""
import torch
import torch.distributed as dist

from dtgen.launch import RankPool
from dtgen.plan import Rule, match_rules, resolve
from models.qwen_image.model import load
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest
from models.qwen_image.tiny import ensure_tiny_checkpoint
from placements.qwen_image import PLANS, get_plan

# 48 x 80 px -> 3 x 5 patches: 15 image rows; text rows 21 and 9 (after the template): with SP2
# every stream needs its padding row.
REQUEST = T2IRequest(prompt="a red fox runs on the snow at night", negative_prompt="blurry", height=48, width=80,
                     steps=3, true_cfg_scale=4.0, seed=5)
# A step cache on every plan: first-block decides from data (block 0's residual, summed over the
# SP ranks; on this random model its measures are 0.88-0.92 at steps 1-3, 1.13 at step 4: far
# from 0.95 on either side), taylorseer from a schedule; 5 steps so that both reuse some.
CACHED = [T2IRequest(**{**REQUEST.__dict__, "steps": 5, "step_cache": spec})
          for spec in ("first-block:threshold=0.95", "taylorseer:interval=2,disable_before=1,order=1")]
TWO_RANKS = [name for name, plan in PLANS.items() if plan.world_size == 2]


def _pipe(ckpt, plan="single", rank=0, world=1):
    loaded = load(ckpt, get_plan(plan), rank, world)
    group = dist.group.WORLD if world > 1 else None
    return QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu", is_main=rank == 0,
                             vae_group=group)


def job_plan(ctx, ckpt, plan):
    pipe = _pipe(ckpt, plan, ctx.rank, ctx.world_size)
    result = pipe.generate(REQUEST, record=True)
    cached = [pipe.generate(req, decode=False) for req in CACHED]
    return {"latents": result.latents, "noise": result.record["noise"], "image": result.image,
            "copied": pipe.controller.last_switch.weights_copied,
            "storage": pipe.controller.storage.nbytes,
            "cached": [(r.latents, r.record["step_cache"]["full_steps"]) for r in cached]}


@torch.no_grad()
def test_the_split_points_are_embeds_rows(tmp_path_factory):
    """QwenImageTransformer.seq_splits (dtgen/seq_split.py) names fields `embed` returns, each
    split along its rows (15 image rows, 9 text rows, RoPE tables alike), in the joint
    attention's order [text, image]; the time embedding stays whole."""
    dit = load(ensure_tiny_checkpoint(tmp_path_factory.mktemp("qwen-splits")), get_plan("single")).model.transformer
    g = torch.Generator().manual_seed(0)
    e = dit.embed(torch.randn(1, 15, 64, generator=g), torch.tensor([0.5]), torch.randn(1, 9, 32, generator=g), 3, 5)
    splits = dit.seq_splits
    rows = {"img": 15, "txt": 9, "rope_img": 15, "rope_txt": 9}
    assert set(splits.inputs) == set(rows) and splits.attention == ("txt", "img")
    for name, how in splits.inputs.items():
        value = getattr(e, name)
        assert all(v.shape[how.dim] == rows[name] for v in (value if isinstance(value, tuple) else (value,))), name


def test_every_plan_matches_one_process(tmp_path_factory):
    ckpt = ensure_tiny_checkpoint(tmp_path_factory.mktemp("qwen-plans"))
    single = _pipe(ckpt)
    want = single.generate(REQUEST, record=True)
    want_cached = [single.generate(req, decode=False) for req in CACHED]
    for r in want_cached:   # the caches reuse steps here (else the check says nothing)
        assert 0 < len(r.record["step_cache"]["cached_steps"]), r.record["step_cache"]
    assert TWO_RANKS == ["tp2", "ulysses2", "cfg2"]
    params = dict(single.model.named_parameters())
    rules = match_rules(PLANS["tp2"], list(params))
    full_bytes = single.controller.storage.nbytes
    tp2_bytes = full_bytes - sum(p.nbytes for n, p in params.items() if rules[n] != Rule.REPLICATE) // 2
    with RankPool(2, timeout_s=240) as pool:
        for plan in TWO_RANKS:
            resolve(PLANS[plan], 2)
            for rank, got in enumerate(pool.run(job_plan, ckpt, plan)):
                where = f"plan {plan}, rank {rank}"
                assert got["copied"] == 0, where
                # TP2 holds half of every split weight (the rest whole), the others everything.
                assert got["storage"] == (tp2_bytes if plan == "tp2" else full_bytes), where
                for a, b in zip(got["noise"], want.record["noise"], strict=True):
                    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=where)
                torch.testing.assert_close(got["latents"], want.latents, atol=2e-5, rtol=1e-5, msg=where)
                if rank == 0:   # the split VAE decode gathers the image there
                    assert (got["image"].float() - want.image.float()).abs().max() <= 1, where
                else:
                    assert got["image"] is None, where
                for (latents, full), ref in zip(got["cached"], want_cached, strict=True):
                    assert full == ref.record["step_cache"]["full_steps"], where
                    torch.testing.assert_close(latents, ref.latents, atol=2e-5, rtol=1e-5, msg=where)
