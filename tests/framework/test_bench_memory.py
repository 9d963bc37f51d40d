"""bench/bench_memory.py's trace replay (the GPU part of the script cannot run here). 0.01 s."""
from bench.bench_memory import REPO, peak_blocks


def test_peak_blocks_replays_a_trace_to_its_peak():
    """The peak is the moment the phase's own live allocations are largest (3 + 5 = 8 bytes,
    before the 3 is freed and a 4 arrives), and the blocks listed are those live then, largest
    first, with this repository's frames before the others; a free of a block allocated
    before the trace changes nothing."""
    ours = {"filename": f"{REPO}/models/hunyuan_image3/vae.py", "line": 7, "name": "forward"}
    torch_frame = {"filename": "/usr/lib/torch/nn/functional.py", "line": 1, "name": "conv2d"}
    trace = [{"action": "free_requested", "addr": 99, "size": 50},
             {"action": "alloc", "addr": 1, "size": 3, "frames": [torch_frame]},
             {"action": "alloc", "addr": 2, "size": 5, "frames": [torch_frame, ours]},
             {"action": "free_completed", "addr": 1, "size": 3},
             {"action": "alloc", "addr": 3, "size": 2, "frames": []}]
    out = peak_blocks(trace)
    assert out["phase_allocations_live_at_peak_bytes"] == 8
    assert [b["bytes"] for b in out["top_blocks"]] == [5, 3]
    assert out["top_blocks"][0]["frames"] == ["models/hunyuan_image3/vae.py:7 forward"]
    assert out["top_blocks"][1]["frames"] == ["/usr/lib/torch/nn/functional.py:1 conv2d"]
