"""dtgen.cuda_graph.GraphedStep: a step recorded as a CUDA graph by hand (the regions decode step).

The keying runs everywhere; recording and replay need a GPU (the pipeline-level check is
tests/hunyuan_image3/test_compile.py::test_cuda_graph_decode_matches_eager[regions], and on two GPUs the
`tp2+regions` job of tests/hunyuan_image3/test_multigpu.py, NCCL collectives inside the recording).
"""
import pytest
import torch

from dtgen.cuda_graph import GraphedStep, step_key


def test_step_key_tells_shapes_values_and_objects_apart():
    a, b = object(), object()
    base = step_key([torch.zeros(2, 3), 5, a])
    assert step_key([torch.ones(2, 3), 5, a]) == base            # values of tensors do not matter
    assert step_key([torch.zeros(3, 3), 5, a]) != base            # their shapes do
    assert step_key([torch.zeros(2, 3, dtype=torch.float64), 5, a]) != base
    assert step_key([torch.zeros(2, 3), 6, a]) != base            # numbers by value
    assert step_key([torch.zeros(2, 3), 5, b]) != base            # other objects by identity


def test_recording_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="CUDA tensors only"):
        GraphedStep(lambda x: x + 1)(torch.zeros(2))


class _Cache:
    def __init__(self, n):
        self.buf = torch.zeros(n, device="cuda")


def _step(x, slot, cache, scale):
    # an in-place write at a moving slot (as the decode step's KV write) and a fresh output
    cache.buf.index_copy_(0, slot, x[:1])
    return cache.buf * scale + x.sum()


@pytest.mark.gpu
def test_replays_follow_new_inputs_and_record_once_per_key():
    step = GraphedStep(_step)
    cache = _Cache(8)
    for i in range(5):
        x = torch.full((4,), float(i + 1), device="cuda")
        slot = torch.tensor([i], device="cuda")
        out = step(x, slot, cache, 2.0).clone()
        assert torch.equal(out, cache.buf * 2.0 + x.sum())
    assert step.recorded == 1
    assert torch.equal(cache.buf[:5].cpu(), torch.arange(1.0, 6.0))
    step(torch.ones(6, device="cuda"), torch.tensor([0], device="cuda"), cache, 2.0)   # a new shape
    step(torch.ones(4, device="cuda"), torch.tensor([0], device="cuda"), _Cache(8), 2.0)  # a new cache
    step(torch.ones(4, device="cuda"), torch.tensor([0], device="cuda"), cache, 3.0)   # a new static number
    assert step.recorded == 4
    step.reset()
    step(torch.ones(4, device="cuda"), torch.tensor([0], device="cuda"), cache, 2.0)
    assert step.recorded == 5
