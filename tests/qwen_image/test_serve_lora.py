"""LoRA adapters on a Qwen-Image server (dtgen/serve/loras.py, routes/loras.py): POST / GET /
DELETE /v1/loras, the request's `loras` field and its 422s, least-recently-used eviction and the
409 when every resident adapter is held, a load that fails (here, or on another rank) leaving the
resident set as it was, two requests with different adapters as one batch equal to each run
alone, and a 2-rank (tp2) `dtgen serve` loading an adapter on both ranks. CPU, float32, tiny."""
from __future__ import annotations

import base64
import dataclasses
import io
import threading

import pytest
import torch

pytest.importorskip("fastapi")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from dtgen.lora import ResidentLoras, read_lora  # noqa: E402
from dtgen.serve.loras import run_lora_command  # noqa: E402
from models.qwen_image.model import load  # noqa: E402
from models.qwen_image.pipeline import QwenImagePipeline, T2IRequest  # noqa: E402
from models.qwen_image.tiny import ensure_tiny_checkpoint  # noqa: E402
from placements.qwen_image import get_plan  # noqa: E402
from tests.support.batching import assert_rel_close  # noqa: E402
from tests.support.engine import serving  # noqa: E402
from tests.support.lora import diffusers_transformer, save_adapter  # noqa: E402
from tests.support.serve import call, running_server, wait_done  # noqa: E402

from .test_qwen_lora import TARGETS_A, TARGETS_B  # noqa: E402

# the server's defaults: every field a request leaves out
DEFAULTS = T2IRequest(prompt="x", width=64, height=48, steps=2, true_cfg_scale=4.0, negative_prompt="blurry")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("qwen-serve-lora"))


@pytest.fixture(scope="module")
def files(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-serve-lora-files")
    source = diffusers_transformer(diffusers.QwenImageTransformer2DModel, ckpt)
    a = save_adapter(diffusers.QwenImagePipeline, source, root / "a", r=4, alpha=6, targets=TARGETS_A, seed=1)
    b = save_adapter(diffusers.QwenImagePipeline, source, root / "b", r=2, alpha=5, targets=TARGETS_B, seed=2)
    bad = root / "bad.safetensors"
    bad.write_text("not a safetensors file")
    return {"a": str(a), "b": str(b), "bad": str(bad)}


@pytest.fixture(scope="module")
def pipe(ckpt):
    loaded = load(ckpt, get_plan("single"))
    pipe = QwenImagePipeline(loaded.model, loaded.tokenizer, loaded.controller, "cpu")
    pipe.loras = ResidentLoras(loaded, torch.float32)
    return pipe


@pytest.fixture(scope="module")
def server(pipe):
    """One in-process server (--max-batch 2, --max-loras 2), its board released; a test that
    needs jobs to wait holds it and releases it again."""
    from models.qwen_image.serving import QwenServeAdapter
    adapter = QwenServeAdapter(pipe, 0, DEFAULTS, warmup=False)
    with serving(adapter, max_batch=2, max_loras=2) as (base, board):
        board.release()
        yield base, board


@pytest.fixture
def empty(server, pipe):
    """The server with no adapter resident, before and after the test."""
    base, board = server

    def clear():
        board.release()
        for entry in call(base, "GET", "/v1/loras")[1]["data"]:
            assert call(base, "DELETE", f"/v1/loras/{entry['name']}")[0] == 200
        assert not pipe.loras.adapters
    clear()
    yield base, board
    clear()


def _load(base, name, path, **more):
    return call(base, "POST", "/v1/loras", {"name": name, "path": path, **more})


def _names(base):
    return [e["name"] for e in call(base, "GET", "/v1/loras")[1]["data"]]


def _pixels(answer) -> torch.Tensor:
    import numpy as np
    from PIL import Image
    png = Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"])))
    return torch.from_numpy(np.asarray(png.convert("RGB")).copy()).int()


def test_load_list_and_delete_adapters(empty, files, pipe):
    base, _ = empty
    status, listed, _ = call(base, "GET", "/v1/loras")
    assert status == 200 and listed == {"data": [], "max_loras": 2, "experts": ["transformer"]}, listed
    status, answer, _ = _load(base, "a", files["a"])
    assert status == 201 and answer["name"] == "a" and answer["evicted"] is None, answer
    assert answer["ranks"] == [4] and answer["targets"] == len(read_lora(files["a"]).layers)
    assert answer["resident_bytes"] > 0 and answer["last_used"] is None, answer
    assert "transformer.transformer_blocks.*.attn.to_q" in answer["modules"], answer
    assert sorted(pipe.loras.adapters) == ["a"]
    status, answer, _ = _load(base, "a", files["b"])
    assert status == 409 and answer["error"]["field"] == "name" and "already loaded" in answer["error"]["message"]
    status, answer, _ = call(base, "POST", "/v1/images/generations", {"prompt": "x", "loras": [{"name": "a"}]})
    assert status == 200, answer
    assert call(base, "GET", "/v1/loras")[1]["data"][0]["last_used"] is not None
    status, answer, _ = call(base, "DELETE", "/v1/loras/a")
    assert status == 200 and answer == {"name": "a", "deleted": True} and not pipe.loras.adapters
    status, answer, _ = call(base, "DELETE", "/v1/loras/a")
    assert status == 404 and "'a' is not loaded" in answer["error"]["message"], answer


@pytest.mark.parametrize("body, status, field, message", [
    ({"path": "x"}, 422, "name", "is required"),
    ({"name": "c"}, 422, "path", "is required"),
    ({"name": 3, "path": "x"}, 422, "name", "must be a non-empty string"),
    ({"name": "c", "path": "x", "scale": 1}, 422, "scale", "unknown key; accepted: name, path, expert"),
    ({"name": "c", "path": "x", "expert": "transformer_2"}, 422, "expert", "must be one of ['transformer']"),
    ({"name": "c", "path": "/nowhere/a.safetensors"}, 422, "path", "/nowhere/a.safetensors"),
    ({"name": "c", "path": "BAD"}, 422, "path", "bad.safetensors"),
])
def test_a_bad_load_is_refused_in_one_line_and_leaves_the_residents(empty, files, pipe, body, status, field, message):
    base, _ = empty
    assert _load(base, "a", files["a"])[0] == 201
    before = dict(pipe.loras.adapters)
    body = {k: files["bad"] if v == "BAD" else v for k, v in body.items()}
    got, answer, _ = call(base, "POST", "/v1/loras", body)
    assert got == status and answer["error"]["field"] == field and message in answer["error"]["message"], answer
    assert "\n" not in answer["error"]["message"]
    assert pipe.loras.adapters == before and _names(base) == ["a"]


@pytest.mark.parametrize("loras, field, message", [
    ([{"name": "zzz"}], "loras[0].name", "LoRA 'zzz' is not loaded (POST /v1/loras loads it); loaded: ['a']"),
    ([{"name": "a", "weight": "high"}], "loras[0].weight", "must be a finite number"),
    ([{"name": "a"}, {"name": "a"}], "loras[1].name", "given twice"),
    ({"name": "a"}, "loras", "must be a list"),
])
def test_a_request_naming_an_adapter_that_is_not_loaded_gets_422(empty, files, loras, field, message):
    base, _ = empty
    assert _load(base, "a", files["a"])[0] == 201
    for route in ("/v1/images/generations", "/v1/jobs"):
        status, answer, _ = call(base, "POST", route, {"prompt": "x", "loras": loras})
        assert status == 422 and answer["error"]["field"] == field and message in answer["error"]["message"], answer


def test_the_least_recently_used_adapter_is_evicted_unless_held(empty, files, pipe):
    base, board = empty
    assert _load(base, "a", files["a"])[0] == 201 and _load(base, "b", files["b"])[0] == 201
    assert call(base, "POST", "/v1/images/generations", {"prompt": "x", "loras": [{"name": "a"}]})[0] == 200
    status, answer, _ = _load(base, "c", files["a"])   # b: never used since it loaded, a: just now
    assert status == 201 and answer["evicted"] == "b", answer
    assert sorted(pipe.loras.adapters) == ["a", "c"] and sorted(_names(base)) == ["a", "c"]
    board.hold()   # two queued jobs hold a and c: nothing can be evicted, nor deleted
    try:
        jobs = [call(base, "POST", "/v1/jobs", {"prompt": "x", "loras": [{"name": n}]})[1]["id"] for n in ("a", "c")]
        status, answer, _ = _load(base, "d", files["b"])
        assert status == 409 and "--max-loras 2" in answer["error"]["message"], answer
        status, answer, _ = call(base, "DELETE", "/v1/loras/c")
        assert status == 409 and "held by 1 queued or running request" in answer["error"]["message"], answer
        assert sorted(pipe.loras.adapters) == ["a", "c"]
    finally:
        board.release()
    assert [wait_done(base, j)["status"] for j in jobs] == ["succeeded"] * 2
    status, answer, _ = _load(base, "d", files["b"])   # c was named last: a goes
    assert status == 201 and answer["evicted"] == "a", answer
    assert sorted(pipe.loras.adapters) == ["c", "d"]


class _Link:
    """A control link whose other rank answers `theirs` (a load that fails on rank 1 only)."""
    world_size = 2

    def __init__(self, theirs: dict):
        self.theirs = theirs

    def gather(self, mine):
        return [mine, self.theirs]


def test_a_load_that_fails_on_another_rank_is_undone_here(pipe, files):
    assert not pipe.loras.adapters
    try:
        pipe.loras.load("a", files["a"])
        failed = {"ok": False, "status": 422, "message": "LoRA b: no such file"}
        answer = run_lora_command(_Link(failed), pipe.loras, {"op": "load", "name": "b", "path": files["b"],
                                                               "evict": "a"})
        assert answer == {"ok": False, "status": 422, "message": "rank 1: LoRA b: no such file"}
        assert sorted(pipe.loras.adapters) == ["a"]   # b undone, a (the one it would evict) kept
        answer = run_lora_command(_Link({"ok": True}), pipe.loras, {"op": "load", "name": "b", "path": files["b"],
                                                                    "evict": "a"})
        assert answer["ok"] and sorted(pipe.loras.adapters) == ["b"]
    finally:
        for name in list(pipe.loras.adapters):
            pipe.loras.unload(name)


def test_two_requests_with_different_adapters_run_as_one_batch_each_as_alone(empty, files, pipe):
    """Two concurrent requests of one bucket, each with its own adapters, run as one batch (both
    jobs batch_size 2): each one's latents (and image) are those of its request run alone, and
    far from the same request without adapters."""
    base, board = empty
    assert _load(base, "a", files["a"])[0] == 201 and _load(base, "b", files["b"])[0] == 201
    bodies = [{"prompt": "a red fox", "seed": 3, "loras": [{"name": "a", "weight": 0.7}]},
              {"prompt": "a cat", "seed": 4, "loras": [{"name": "b", "weight": -0.5}, {"name": "a", "weight": 0.2}]}]
    answers, decoded, decode = {}, {}, pipe.decode_latents

    def recorded(req, latents):   # each request's denoised latents, as the batch decodes them
        decoded[req.seed] = latents
        return decode(req, latents)
    pipe.decode_latents = recorded
    board.hold()
    try:
        def post(body):
            answers[body["seed"]] = call(base, "POST", "/v1/images/generations", body)
        threads = [threading.Thread(target=post, args=(body,)) for body in bodies]
        for t in threads:
            t.start()
        board.wait_queued(2)
        jobs = board.queued()
    finally:
        board.release()
        for t in threads:
            t.join(120)
        del pipe.decode_latents
    assert [job.as_dict()["batch_size"] for job in jobs] == [2, 2], [job.as_dict() for job in jobs]
    for body in bodies:
        status, answer, _ = answers[body["seed"]]
        assert status == 200 and answer["dtgen"]["denoise_batch"] == 2, answer
        loras = tuple((e["name"], e["weight"]) for e in body["loras"])
        request = dataclasses.replace(DEFAULTS, prompt=body["prompt"], seed=body["seed"])
        alone = pipe.generate(dataclasses.replace(request, loras=loras))
        plain = pipe.generate(request, decode=False).latents
        assert_rel_close(decoded[body["seed"]], alone.latents, 1e-5, f"seed {body['seed']}")
        assert float((alone.latents - plain).abs().max()) > 1e-2   # the adapters change the result
        assert int((_pixels(answer) - alone.image.int()).abs().max()) <= 1


def test_a_two_rank_server_loads_an_adapter_on_both_ranks(tmp_path, files, pipe):
    """`dtgen serve --world-size 2 --plan tp2`: the adapter loads on both ranks (its sharded bytes
    on rank 0 below the one-process ones), a request with it equals one process's image, a bad
    file is refused on both and the resident set stays."""
    single = pipe.loras.load("a", files["a"]).nbytes
    try:
        want = pipe.generate(dataclasses.replace(DEFAULTS, prompt="a red fox", seed=5,
                                                 loras=(("a", 0.8),))).image.int()
    finally:
        pipe.loras.unload("a")
    with running_server(tmp_path / "server.log", "--model", "qwen-image", "--world-size", "2", "--plan", "tp2",
                        "--steps", "2", "--true-cfg-scale", "4", "--negative-prompt", "blurry", "--ping", "0.2",
                        "--max-loras", "1", module="dtgen serve") as (base, _):
        status, answer, _ = _load(base, "a", files["a"])
        assert status == 201 and 0 < answer["resident_bytes"] < single, answer
        status, answer, _ = _load(base, "bad", files["bad"])
        assert status == 422 and answer["error"]["field"] == "path", answer
        assert _names(base) == ["a"]
        status, answer, _ = call(base, "POST", "/v1/images/generations",
                                 {"prompt": "a red fox", "seed": 5, "loras": [{"name": "a", "weight": 0.8}]})
        assert status == 200, answer
        assert int((_pixels(answer) - want).abs().max()) <= 1
        status, answer, _ = _load(base, "b", files["b"])   # --max-loras 1: a (unheld) evicted on both ranks
        assert status == 201 and answer["evicted"] == "a", answer
        status, answer, _ = call(base, "POST", "/v1/images/generations", {"prompt": "x", "loras": [{"name": "b"}]})
        assert status == 200, answer


def test_the_servers_lora_adapters_are_pinned_defaults(pipe, files, capsys):
    """`dtgen serve --lora FILE`: FILE resident under its path from the start, the default of a
    request's `loras`, never evicted or deleted; more --lora files than --max-loras, or
    --max-loras 0, refused in one line before anything loads."""
    from dtgen.cli import serve_main
    from dtgen.serve.loras import LoraRefused, ServedLoras
    from models.qwen_image.serving import QwenServeAdapter
    assert not pipe.loras.adapters
    pipe.loras.load(files["a"], files["a"])
    try:
        adapter = QwenServeAdapter(pipe, 0, dataclasses.replace(DEFAULTS, loras=((files["a"], 0.5),)), warmup=False)
        assert adapter.parse({"prompt": "x"}).loras == ((files["a"], 0.5),)
        assert adapter.parse({"prompt": "x", "loras": []}).loras == ()
        book = ServedLoras.of(adapter, 1)
        [entry] = book.listing()
        assert entry["name"] == files["a"] and entry["pinned"] and entry["ranks"] == [4]
        for attempt in (lambda: book.begin_unload(files["a"]), lambda: book.begin_load("b", files["b"], "transformer")):
            with pytest.raises(LoraRefused) as e:
                attempt()
            assert e.value.status == 409, e.value.message
    finally:
        pipe.loras.unload(files["a"])
    for argv, line in ((["--max-loras", "0"], "--max-loras must be >= 1, got 0"),
                       (["--lora", files["a"], "--lora", files["b"], "--max-loras", "1"],
                        "--max-loras 1: 2 --lora adapters are resident from the start")):
        capsys.readouterr()
        assert serve_main(["--model", "qwen-image", *argv]) == 2
        assert capsys.readouterr().err.strip() == f"error: {line}"
