"""LoRA adapters on a Wan server (dtgen/serve/loras.py) over a tiny Wan2.2-A14B checkpoint: an
adapter loaded into the low-noise expert (`"expert": "transformer_2"`), another into the
high-noise one, two video jobs with different adapters as one batch, each equal to its request run
alone, and `/v1/videos` refusing an adapter that is not loaded. CPU, float32, one process."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("fastapi")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from dtgen.lora import ResidentLoras  # noqa: E402
from models.wan.model import load  # noqa: E402
from models.wan.pipeline import T2VRequest, WanT2VPipeline  # noqa: E402
from placements.wan import get_plan  # noqa: E402
from tests.support.batching import assert_rel_close  # noqa: E402
from tests.support.engine import serving  # noqa: E402
from tests.support.lora import diffusers_transformer, save_adapter  # noqa: E402
from tests.support.serve import call, wait_done  # noqa: E402

from .test_wan_lora import TARGETS_A, TARGETS_B  # noqa: E402

DEFAULTS = T2VRequest(prompt="x", negative_prompt="blurry", height=48, width=32, num_frames=9, steps=2,
                      guidance_scale=5.0, guidance_scale_2=4.0)


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    from models.wan.tiny import write_random_checkpoint
    folder = tmp_path_factory.mktemp("wan-serve-lora") / "tiny-a14b"
    folder.mkdir()
    write_random_checkpoint(folder, seed=7, two_experts=True)
    return folder


@pytest.fixture(scope="module")
def files(a14b, tmp_path_factory):
    root = tmp_path_factory.mktemp("wan-serve-lora-files")
    source = diffusers_transformer(diffusers.WanTransformer3DModel, a14b)
    a = save_adapter(diffusers.WanPipeline, source, root / "a", r=4, alpha=6, targets=TARGETS_A, seed=1)
    b = save_adapter(diffusers.WanPipeline, source, root / "b", r=2, alpha=3, targets=TARGETS_B, seed=2)
    return {"a": str(a), "b": str(b)}


def test_experts_and_a_batch_of_video_jobs_with_different_adapters(a14b, files):
    from models.wan.serving import WanServeAdapter
    loaded = load(a14b, get_plan("single"))
    pipe = WanT2VPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    pipe.loras = ResidentLoras(loaded, torch.float32)
    decoded, decode = {}, pipe.decode_latents

    def recorded(req, latents):   # each request's denoised latents, as the batch decodes them
        decoded[req.seed] = latents
        return decode(req, latents)
    pipe.decode_latents = recorded
    adapter = WanServeAdapter(pipe, 0, DEFAULTS, warmup=False)
    with serving(adapter, max_batch=2, max_loras=2) as (base, board):
        board.release()
        assert call(base, "GET", "/v1/loras")[1]["experts"] == ["transformer", "transformer_2"]
        status, low, _ = call(base, "POST", "/v1/loras", {"name": "low", "path": files["a"],
                                                          "expert": "transformer_2"})
        assert status == 201 and low["expert"] == "transformer_2", low
        assert all(m.startswith("transformer_2.") for m in low["modules"]), low["modules"]
        status, high, _ = call(base, "POST", "/v1/loras", {"name": "high", "path": files["b"]})
        assert status == 201 and all(m.startswith("transformer.") for m in high["modules"]), high
        status, answer, _ = call(base, "POST", "/v1/videos", {"prompt": "x", "loras": [{"name": "b"}]})
        assert status == 422 and answer["error"]["field"] == "loras[0].name", answer
        bodies = [{"prompt": "a fox runs", "seed": 1, "loras": [{"name": "low", "weight": 0.8}]},
                  {"prompt": "waves", "seed": 2, "loras": [{"name": "high", "weight": -0.6}, {"name": "low"}]}]
        board.hold()
        try:
            ids = [call(base, "POST", "/v1/videos", body)[1]["id"] for body in bodies]
        finally:
            board.release()
        jobs = [wait_done(base, i) for i in ids]
        assert [(j["status"], j["batch_size"]) for j in jobs] == [("succeeded", 2)] * 2, jobs
    for body in bodies:
        request = dataclasses.replace(DEFAULTS, prompt=body["prompt"], seed=body["seed"])
        loras = tuple((e["name"], e.get("weight", 1.0)) for e in body["loras"])
        alone = pipe.generate(dataclasses.replace(request, loras=loras), decode=False).latents
        plain = pipe.generate(request, decode=False).latents
        assert_rel_close(decoded[body["seed"]], alone, 1e-5, f"seed {body['seed']}")
        assert float((alone - plain).abs().max()) > 1e-2   # the adapters change the video
