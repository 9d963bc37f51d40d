"""bench/bench_memory.py: a tiny CPU run (the GPU runs of the script cannot run here)."""


def test_tiny_run_writes_a_row_per_repeat_and_refuses_two_kv_policies(tmp_path):
    """`--repeats 2` writes a row per request (`repeat` 0 and 1) from one pool per config; a
    config of levers (`lean_ar`'s but its bf16 VAE) runs `--kv-caches keep-ar` and chunks the
    VAE, two KV policies in one config are refused. The tiny architecture on the CPU, T2I only:
    a few seconds. (Not the bf16 VAE: bf16 convolutions on a CPU without bf16 units run about
    100x slower than float32, measured 3.7 s against 0.03 s for one 128-channel 64x64 conv,
    which made this test run for many minutes; the levers' plumbing is what it checks.)"""
    import json

    import pytest

    from bench import bench_memory
    out = tmp_path / "memory.json"
    bench_memory.CONFIGS["lean_ar_fp32"] = ("keep_ar_kv", "vae_chunks")
    bench_memory.CONFIGS["both_kv"] = ("release_kv", "keep_ar_kv")
    try:
        assert bench_memory.main(["--tiny", "--configs", "lean_ar_fp32", "--runs", "t2i", "--repeats", "2",
                                  "--out", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert [(r["config"], r["repeat"]) for r in rows] == [("lean_ar_fp32", 0), ("lean_ar_fp32", 1)]
        assert rows[0]["levers"] == ["keep_ar_kv", "vae_chunks"]
        assert all(r["timings_ms"]["ar_decode_per_token"] > 0 for r in rows)
        with pytest.raises(SystemExit, match="two KV-cache policies"):
            bench_memory.main(["--tiny", "--configs", "both_kv"])
    finally:
        del bench_memory.CONFIGS["lean_ar_fp32"], bench_memory.CONFIGS["both_kv"]
    with pytest.raises(SystemExit, match="--repeats must be at least 1"):
        bench_memory.main(["--tiny", "--repeats", "0"])
