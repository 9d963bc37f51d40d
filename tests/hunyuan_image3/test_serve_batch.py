"""DiT step batching through the real server (one CPU process, the tiny model, real HTTP on
127.0.0.1): with `--max-batch 3`, jobs of one denoise bucket that wait together run as one
batch (the job and its answer say how many ran together, and so does /metrics), a job of
another bucket does not join them, and a batched job's image equals the same request's alone.
About 40 s: the server's start and warm-up, five jobs (each a 3-10 s VAE decode here)."""
from __future__ import annotations

import base64
import io
import time
from dataclasses import replace

import pytest

from tests.support.serve import call, running_server, wait_done

pytest.importorskip("fastapi")


def _pixels(b64: str):
    import numpy as np
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64)))).astype(int)


def test_same_bucket_jobs_run_as_one_batch_and_other_buckets_apart(tmp_path):
    # 'a cat sat' and 'a fox in the' pad to one 16-row text bucket; steps differ for the last.
    b = {"prompt": "a cat sat", "size": "256x256", "num_inference_steps": 2, "seed": 2, "guidance_scale": 3.0}
    c = {"prompt": "a fox in the", "size": "256x256", "num_inference_steps": 2, "seed": 3}
    d = {"prompt": "a cat sat", "size": "256x256", "num_inference_steps": 3, "seed": 4}
    with running_server(tmp_path / "server.log", "--max-batch", "3", "--prompt-bucket", "16", "--steps", "2",
                        "--ping", "0.2") as (base, _):
        status, first, _ = call(base, "POST", "/v1/jobs", {**c, "num_inference_steps": 4, "seed": 1})
        assert status == 202, first
        end = time.monotonic() + 60
        while call(base, "GET", f"/v1/jobs/{first['id']}")[1]["status"] == "queued":   # the others wait behind it
            assert time.monotonic() < end
            time.sleep(0.02)
        ids = [call(base, "POST", "/v1/jobs", body)[1]["id"] for body in (b, c, d)]
        jobs = [wait_done(base, i) for i in [first["id"], *ids]]
        assert [j["status"] for j in jobs] == ["succeeded"] * 4, jobs
        assert [j["batch_size"] for j in jobs] == [1, 2, 2, 1], jobs
        metrics = call(base, "GET", "/metrics")[1]
        assert 'dtgen_job_batch_size_bucket{le="1.0"} 2.0' in metrics and "dtgen_job_batch_size_count 4.0" in metrics
        # The same request alone (nothing else waits now): the same image, up to a level.
        status, alone, _ = call(base, "POST", "/v1/images/generations", b)
        assert status == 200 and alone["dtgen"]["denoise_batch"] == 1, alone
        batched = jobs[1]["result"]["data"][0]["b64_json"]
        assert abs(_pixels(batched) - _pixels(alone["data"][0]["b64_json"])).max() <= 1


@pytest.mark.parametrize("argv, line", [
    (["--max-batch", "0"], "error: --max-batch must be >= 1, got 0"),
])
def test_bad_max_batch_is_one_line_naming_the_flag(argv, line, capsys):
    from dtgen.cli import serve_main as main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(line) and len(err.splitlines()) == 1, err


def test_a_model_whose_spec_names_no_batch_refuses_max_batch_over_one():
    """Every listed model batches; a spec whose buckets name nothing a batch shares runs one
    request at a time, and --max-batch > 1 is then one line naming the flag."""
    from types import SimpleNamespace

    from dtgen.cli import _server_problem
    args = SimpleNamespace(port=8000, max_queued=16, ping=1.0, end_timeout=10.0, max_upload_mb=32.0, deadline=None,
                           max_batch=2, max_loras=None)
    assert _server_problem(args, SimpleNamespace(batches=False, title="TinyDiT")) == \
        "--max-batch 2: TinyDiT's server runs one request at a time (its spec names nothing a batch shares); " \
        "use --max-batch 1"
    args.max_batch = None
    assert _server_problem(args, SimpleNamespace(batches=False, title="TinyDiT")) is None and args.max_batch == 1


def test_the_batch_key_is_the_specs_bucket():
    """A request's batch key is its bucket as models/hunyuan_image3/spec.py declares it: the
    size, the denoise text (<bos>, the prompt, max_new_tokens) padded to --prompt-bucket
    rows (0: its exact rows), then the steps, the shift, the CFG mode and the step cache; then
    its LoRA adapters (the pipeline runs one adapter set a batch)."""
    from types import SimpleNamespace

    from models.hunyuan_image3.requests import T2IRequest
    from models.hunyuan_image3.serving import HunyuanServeAdapter

    def key(req, bucket):
        tok = SimpleNamespace(encode=lambda text: text.split())
        return HunyuanServeAdapter.batch_key(SimpleNamespace(pipe=SimpleNamespace(tok=tok, prompt_bucket=bucket)), req)

    req = T2IRequest(prompt_ids=tuple(range(10)), max_new_tokens=5, image_size="1024x768", steps=8, cfg_mode="batch")
    assert key(req, 16) == ("t2i", "1024x768", 16, 8, 3.0, "batch", None, ())   # 1 + 10 + 5 rows: a bucket of 16
    assert key(replace(req, max_new_tokens=6), 16)[2] == 32 and key(replace(req, max_new_tokens=6), 0)[2] == 17
    assert key(T2IRequest(prompt="a red fox", max_new_tokens=2), 0)[1:3] == ("auto", 6)
    assert key(replace(req, step_cache="taylor"), 16) != key(req, 16) != key(replace(req, steps=9), 16)
    assert key(replace(req, loras=(("style", 0.8),)), 16) != key(req, 16)
