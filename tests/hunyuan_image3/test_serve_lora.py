"""LoRA adapters on a HunyuanImage-3 server (dtgen/serve/loras.py): adapters loaded and deleted by
name (POST / GET / DELETE /v1/loras), a request's `loras` naming them, each request's image equal to
its request run alone through the pipeline with the same adapters, requests with different adapters
never sharing a batch (the pipeline runs one adapter set a batch, in both phases), and a request that
names an adapter no longer resident refused in one line naming `loras`. CPU, float32, the tiny model.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import threading

import pytest
import torch

pytest.importorskip("fastapi")

from dtgen.lora import ResidentLoras  # noqa: E402
from models.hunyuan_image3.loading import load  # noqa: E402
from models.hunyuan_image3.pipeline import HunyuanT2IPipeline, to_uint8  # noqa: E402
from models.hunyuan_image3.requests import T2IRequest  # noqa: E402
from placements.hunyuan_image3 import get_plan  # noqa: E402
from tests.support.engine import serving  # noqa: E402
from tests.support.serve import call  # noqa: E402

from .test_hunyuan_lora import files  # noqa: E402,F401  (the adapter files: a PEFT folder "a", a file "b")

DEFAULTS = T2IRequest(prompt="x", steps=2, max_new_tokens=2, temperature=0.0, image_size="256x256", seed=0)


@pytest.fixture(scope="module")
def pipe(tiny_checkpoint):
    loaded = load(tiny_checkpoint, get_plan("single"))
    pipe = HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    pipe.loras = ResidentLoras(loaded, torch.float32)
    return pipe


@pytest.fixture(scope="module")
def server(pipe):
    from models.hunyuan_image3.serving import HunyuanServeAdapter
    adapter = HunyuanServeAdapter(pipe, 0, DEFAULTS, warmup=False)
    with serving(adapter, max_batch=2, max_loras=2) as (base, board):
        board.release()
        yield base, board


def _pixels(answer) -> torch.Tensor:
    import numpy as np
    from PIL import Image
    png = Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))
    return torch.from_numpy(np.asarray(png.convert("RGB")).copy()).int()


def test_requests_name_loaded_adapters_and_equal_their_runs_alone(server, pipe, files):  # noqa: F811
    base, board = server
    status, listed, _ = call(base, "GET", "/v1/loras")
    assert status == 200 and listed == {"data": [], "max_loras": 2, "experts": ["transformer"]}, listed
    for name in ("a", "b"):
        status, answer, _ = call(base, "POST", "/v1/loras", {"name": name, "path": str(files[name])})
        assert status == 201 and answer["name"] == name, answer
    assert "model.layers.*.self_attn.qkv_proj" in call(base, "GET", "/v1/loras")[1]["data"][0]["modules"]
    bodies = [{"prompt": "a red fox", "seed": 3, "loras": [{"name": "a", "weight": 0.7}]},
              {"prompt": "a red fox", "seed": 3, "loras": [{"name": "b", "weight": -0.5}, {"name": "a"}]},
              {"prompt": "a red fox", "seed": 3}]
    answers = {}
    board.hold()
    try:
        def post(i):
            answers[i] = call(base, "POST", "/v1/images/generations", bodies[i])
        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        board.wait_queued(len(bodies))
        jobs = board.queued()
    finally:
        board.release()
        for t in threads:
            t.join(300)
    # one bucket, three adapter sets: three batches of one
    assert [job.as_dict()["batch_size"] for job in jobs] == [1, 1, 1], [job.as_dict() for job in jobs]
    images = []
    for i, body in enumerate(bodies):
        status, answer, _ = answers[i]
        assert status == 200, answer
        loras = tuple((e["name"], e.get("weight", 1.0)) for e in body.get("loras", ()))
        alone = pipe.generate(dataclasses.replace(DEFAULTS, prompt=body["prompt"], seed=body["seed"], loras=loras))
        assert int((_pixels(answer) - to_uint8(alone.image).int()).abs().max()) <= 1, body
        images.append(_pixels(answer))
    assert all(int((images[i] - images[2]).abs().max()) > 8 for i in (0, 1))   # the adapters change the image
    assert call(base, "DELETE", "/v1/loras/b")[0] == 200
    status, answer, _ = call(base, "POST", "/v1/images/generations", bodies[1])
    assert status == 422 and answer["error"]["field"].startswith("loras"), answer
    assert "'b'" in answer["error"]["message"] and "\n" not in answer["error"]["message"], answer
    assert sorted(pipe.loras.adapters) == ["a"]
