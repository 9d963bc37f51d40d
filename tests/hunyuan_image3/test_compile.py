"""Compiled phases: one graph per phase and shape, no graph breaks, no recompiles, same outputs.

Most tests use dynamo's `eager` / `aot_eager` backends, which check what dynamo captures
(fullgraph, collectives and custom ops inside the graph) without paying for code generation;
one single-process test runs inductor end to end (on the GPU stack: the `gpu` tests).
"""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dtgen.compile import CompileOptions, graph_breaks, unique_graphs
from dtgen.profiling import PhaseProfiler
from models.hunyuan_image3.loading import load
from models.hunyuan_image3.pipeline import PROFILE_ROWS, HunyuanT2IPipeline
from models.hunyuan_image3.requests import T2IRequest
from models.hunyuan_image3.tiny import tiny_config
from placements.hunyuan_image3 import get_plan

REQUEST = dict(prompt="a lighthouse", steps=3, max_new_tokens=3, temperature=0.0, image_size="256x256", seed=3)
# prefill, decode (1 token; <boi><img_size> go through it too), denoise step 0, cached denoise step
GRAPHS_PER_RUN = 4


def _pipe(ckpt, plan, rank=0, world=1, backend=None, device="cpu", dtype=torch.float32, regions=False, layers=None):
    """layers: the tiny model at that depth with random weights (ckpt unused), else the checkpoint."""
    random_config = tiny_config(layers) if layers else None
    loaded = load(None if layers else ckpt, get_plan(plan), rank, world, dtype=dtype, device=device,
                  random_config=random_config)
    options = CompileOptions(enabled=backend is not None, backend=backend or "inductor", regions=regions)
    return loaded, HunyuanT2IPipeline(loaded.model, loaded.tokenizer, loaded.controller, device,
                                      is_main=rank == 0, compile_options=options)


def _compiled_run(ckpt, plan, rank, world, backend, device="cpu", dtype=torch.float32, regions=False, layers=None):
    """Eager result, then a compiled warm-up, then compiled runs that must not recompile."""
    torch._dynamo.reset()
    counters.clear()
    loaded, eager = _pipe(ckpt, plan, rank, world, device=device, dtype=dtype, layers=layers)
    reference = eager.generate(T2IRequest(**REQUEST))
    # Replay the reference's tokens: in bf16 a near-tie could otherwise send the compiled run
    # down another token path, and its logits would no longer be comparable.
    replay = T2IRequest(**REQUEST, forced_tokens=tuple(reference.tokens), forced_ratio=reference.ratio_index)
    _, pipe = _pipe(ckpt, plan, rank, world, backend, device=device, dtype=dtype, regions=regions, layers=layers)
    first = pipe.generate(replay)
    graphs = unique_graphs()
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(2):  # alternate phases, then run again: nothing may recompile
            pipe.controller.activate("denoise")
            pipe.controller.activate("ar")
        again = pipe.generate(replay)
    def rel(xs, ys):  # largest deviation relative to the largest reference value
        return max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(xs, ys))
    diff = rel(again.record["velocity"], reference.record["velocity"])
    logit_diff = rel(again.record["ar_logits"], reference.record["ar_logits"])
    first_diff = rel(again.record["velocity"][:1], reference.record["velocity"][:1])
    return {"graphs": graphs, "after": unique_graphs(), "breaks": graph_breaks(), "diff": diff,
            "first_diff": first_diff,
            "logit_diff": logit_diff, "tokens": (reference.tokens, first.tokens, again.tokens),
            "repeat_equal": all(torch.equal(a, b) for a, b in zip(first.record["velocity"], again.record["velocity"])),
            "decode_recordings": pipe._graphed_decode.recorded if pipe._graphed_decode is not None else None}


def _check(r, tol):
    assert r["breaks"] == {}, r["breaks"]
    assert r["graphs"] == GRAPHS_PER_RUN and r["after"] == r["graphs"]
    assert r["tokens"][0] == r["tokens"][1] == r["tokens"][2]
    assert r["diff"] < tol and r["logit_diff"] < tol
    assert r["repeat_equal"]


def test_single_process_inductor(tiny_checkpoint):
    """Inductor end to end on the CPU: every phase step one graph, no break, no recompile,
    eager's outputs. One layer (random weights): nothing here depends on depth (the region
    tests below cover it), and a whole-step compile's time grows with it (from an empty
    cache here: 126 s at one layer against 178 s at the checkpoint's two). inductor fuses
    and reorders float32 math: a few ulps of drift."""
    _check(_compiled_run(tiny_checkpoint, "single", 0, 1, "inductor", layers=1), 1e-4)


def test_sampled_decode_compiles_and_draws_the_eager_tokens(tiny_checkpoint):
    """temperature > 0: top-k / top-p and the Gumbel draw run inside the compiled steps
    (no host sync there), and the same seed draws the same tokens as eager."""
    torch._dynamo.reset()
    request = T2IRequest(**{**REQUEST, "temperature": 0.9, "top_k": 50, "top_p": 0.9, "max_new_tokens": 6,
                            "steps": 1}, ignore_stop=True)
    _, eager = _pipe(tiny_checkpoint, "single")
    _, compiled = _pipe(tiny_checkpoint, "single", backend="aot_eager")
    tokens = eager.generate(request).tokens
    assert len(tokens) == 6 and len(set(tokens)) > 1     # sampled, not one repeated argmax
    assert compiled.generate(request).tokens == tokens
    assert graph_breaks() == {}


def test_profile_writes_table_trace_and_chart(tiny_checkpoint, tmp_path):
    _, pipe = _pipe(tiny_checkpoint, "single")
    profiler = PhaseProfiler(tmp_path, rank=0, table_rows=PROFILE_ROWS)
    result = pipe.generate(T2IRequest(**REQUEST), profiler)
    summary = profiler.write(result.timings_ms, {"graphs": 0, "graph_breaks": 0, "recompiles_after_warmup": 0})
    for phase in ("ar", "denoise", "vae"):
        assert (tmp_path / f"trace_{phase}_rank0.json").stat().st_size > 0
        assert summary["top_kernels"][phase]
    table = (tmp_path / "profile_rank0.txt").read_text()
    for label in ("AR prefill", "AR decode", "phase switch", "denoise", "VAE decode", "total"):
        assert label in table
    from PIL import Image
    assert Image.open(tmp_path / "profile_rank0.png").size[0] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,regions", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
                         ids=["float32-whole", "float32-regions", "bfloat16-regions"])
def test_cuda_graph_decode_matches_eager(tiny_checkpoint, dtype, regions):
    """One GPU: the decode step as inductor's CUDA graph (whole steps) or recorded by hand
    around the compiled layer (regions, dtgen/cuda_graph.py) gives the eager logits and
    velocities; nothing recompiles or records again on the second request.

    The smallest runs that show it: whole steps on a 1-layer tiny model (random weights), in
    float32 (the tight check); regions on the 2-layer tiny checkpoint (one compiled layer
    shared by both), in float32 and bf16. A whole-step compile costs ~60 s a dtype here, and
    nothing in the CUDA-graph mechanism depends on the dtype: the bf16 compiled-vs-eager
    numerics are checked with regions (the same inductor on the same layer code), and bf16
    whole steps with a CUDA-graph decode run in `make test-gpu2` (every 2-rank plan)."""
    torch.backends.cuda.matmul.allow_tf32 = False   # float32 means float32 (as the example sets it)
    torch.backends.cudnn.allow_tf32 = False
    r = _compiled_run(tiny_checkpoint, "single", 0, 1, "inductor", device="cuda", dtype=dtype, regions=regions,
                      layers=None if regions else 1)
    # regions: one recording for the request's decode shape, kept by the second request
    assert r["decode_recordings"] == (1 if regions else None), r["decode_recordings"]
    assert r["breaks"] == {}, r["breaks"]
    assert r["after"] == r["graphs"], (r["graphs"], r["after"])
    skips = counters["inductor"].get("cudagraph_skips", 0)
    assert skips == 0, dict(counters["inductor"])
    assert r["repeat_equal"]
    if dtype == torch.float32:
        assert r["logit_diff"] < 1e-4 and r["diff"] < 1e-4, (r["logit_diff"], r["diff"])
    else:
        # bf16: inductor keeps fused intermediates in fp32 where eager rounds each op to bf16
        # (2^-8 relative). One step's velocity and the logits stay within 6% of their largest
        # value (measured on an H200: 1.3% and 4.0%); later steps start from latents that already differ, so only the fp32 run
        # checks them tightly.
        assert r["logit_diff"] < 6e-2 and r["first_diff"] < 6e-2, (r["logit_diff"], r["first_diff"])


def test_step_compiler_options(monkeypatch):
    """What each step is compiled with: the decode step replays as a CUDA graph; with
    autotune the other steps let inductor tune their GEMMs; other backends get neither."""
    from dtgen.compile import StepCompiler
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    StepCompiler(CompileOptions(enabled=True, autotune=True)).wrap(len, cuda_graph=True)
    StepCompiler(CompileOptions(enabled=True, autotune=True)).wrap(len)
    StepCompiler(CompileOptions(enabled=True)).wrap(len)
    StepCompiler(CompileOptions(enabled=True, backend="aot_eager", autotune=True)).wrap(len, cuda_graph=True)
    assert seen[0]["mode"] == "reduce-overhead" and "options" not in seen[0]
    assert seen[1]["options"] == {"max_autotune_gemm": True}
    assert "options" not in seen[2] and "mode" not in seen[2]
    assert seen[3] == {"fullgraph": True, "backend": "aot_eager"}
    assert all(kwargs["fullgraph"] for kwargs in seen)


def _compiled_report(tmp_path, *args) -> dict:
    """The example's report of a compiled run (dynamo's eager backend: tracing without codegen)."""
    import json

    import torch._dynamo
    from torch._dynamo.utils import counters

    from models.hunyuan_image3.cli import main

    torch._dynamo.reset()
    counters.clear()
    report = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    assert main(["--steps", "2", "--max-new-tokens", "2", "--ignore-eos", "--image-size", "256x256", "--compile",
                 "--compile-backend", "eager", "--output", str(tmp_path / "i.png"), "--report", str(report),
                 *args]) == 0
    return json.loads(report.read_text())


def _random(layers: int, regions: bool) -> tuple[str, ...]:
    return ("--random-weights", "tiny", "--layers", str(layers)) + (("--compile-regions",) if regions else ())


def test_regional_compilation_does_not_grow_with_depth(tmp_path):
    """With --compile-regions the decoder layer is traced once for all layers: at 1 and 2
    layers the same graphs, one per call signature (prefill, decode, first and cached denoise
    step), and the same operations traced (every step runs eagerly around the layer), where
    whole-step graphs grow by a whole layer each (the benchmark in docs/performance.md)."""
    flat = [_compiled_report(tmp_path, *_random(n, regions=True))["compile"] for n in (1, 2)]
    assert flat[0]["graphs"] == flat[1]["graphs"] == GRAPHS_PER_RUN
    assert flat[0]["ops_traced"] == flat[1]["ops_traced"] > 0
    assert all(c["graph_breaks"] == 0 and c["recompiles_after_warmup"] == 0 for c in flat)


def test_four_rank_hybrid_compiled_in_regions_matches_one_process(tiny_checkpoint, monkeypatch, tmp_path):
    """4 gloo ranks, plan hybrid (AR TP4 with its all-reduce hooks, denoise TP2 x Ulysses-2,
    the collectives inside the compiled layer), compiled: every layer passes the same guards
    (shared hooks, same core types), so the layers share their graphs (fewer than two per
    call signature: 5 measured, where layers failing each other's guards would compile one
    each); nothing recompiles after the warm-up; --check against the single-process eager
    model holds to float32 rounding (logits, latents, the decoded image); and the AR ->
    denoise switch moved no weight. (The example's 4-rank --check run, compiled or not.)"""
    monkeypatch.setenv("DTGEN_CACHE", str(tiny_checkpoint.parent))
    report = _compiled_report(tmp_path, "--compile-regions", "--world-size", "4", "--plan", "hybrid", "--check")
    deep = report["compile"]
    assert 0 < deep["graphs"] < 2 * GRAPHS_PER_RUN
    assert deep["graph_breaks"] == 0 and deep["recompiles_after_warmup"] == 0
    check = report["check"]
    assert check["max_abs_diff_logits"] < 1e-4 and check["max_abs_diff_velocity"] < 1e-4, check
    assert check["max_abs_diff_latents"] < 1e-4 and check["max_abs_diff_image"] < 1e-4, check
    switch = report["phase_switch"]
    assert switch["weights_copied"] == 0 and switch["allocated_bytes_delta"] == 0
    assert switch["param_bytes_before"] == switch["param_bytes_after"] > 0


def test_prompts_in_one_bucket_share_every_graph_and_match_exact_lengths(tiny_checkpoint):
    """Prompts pad to a bucket, in AR (rows after the prompt) and in denoise (rows between the
    text and the image head, hidden by the attention's `SlotHole`). The padding is exact: AR
    logits, tokens and every velocity equal the unpadded eager run's. Prompts of other
    lengths within the bucket reuse every graph of the first: 5 prompts of 20 to 90 tokens, one
    image size, no warm-up: the first request compiles 4 graphs, the other four none (the CPU
    bucket target of docs/performance.md)."""
    from dataclasses import replace as dc_replace

    torch._dynamo.reset()
    counters.clear()
    _, eager = _pipe(tiny_checkpoint, "single")
    assert eager.prompt_bucket == 0
    _, compiled = _pipe(tiny_checkpoint, "single", backend="eager")
    assert compiled.prompt_bucket == 256
    base = dc_replace(T2IRequest(**REQUEST), max_new_tokens=3, ignore_stop=True, steps=2)
    graphs = []
    for n in (20, 33, 47, 61, 90):
        req = dc_replace(base, prompt_ids=tuple(5 + (i * 7) % 90 for i in range(n)))
        got = compiled.generate(req)
        graphs.append(int(counters["stats"]["unique_graphs"]))
        if n in (33, 61):   # the exactness of three lengths (the shortest, the middle, the longest) will do
            continue
        want = eager.generate(req)
        assert want.tokens == got.tokens
        assert got.record["denoise_length"] == want.record["denoise_length"]
        for key in ("ar_logits", "velocity"):
            for a, b in zip(want.record[key], got.record[key], strict=True):
                torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
    assert graphs[0] == GRAPHS_PER_RUN and graphs[1:] == [graphs[0]] * 4, graphs


def test_warmup_shapes_compile_the_buckets_ahead(tmp_path):
    """--warmup-shapes compiles given buckets before any request: requests of other lengths in
    those buckets (two prompt buckets here) compile nothing. The warm-up also runs a cached
    step (a server's requests may ask for a step cache): one head graph for the image size,
    shared by both buckets."""
    report = _compiled_report(tmp_path, "--random-weights", "tiny", "--prompt-tokens", "300,40,260",
                              "--warmup-shapes", "10:256x256,400:256x256")
    assert [r["new_graphs"] for r in report["requests"]] == [0, 0, 0]
    assert report["compile"]["recompiles_after_warmup"] == 0
    assert report["compile"]["graphs"] == 2 * GRAPHS_PER_RUN + 1
    assert report["first_denoise_step_done_s"] > 0   # process start to the warm-up's first denoise step
