"""kernels.attention_key_prefix: attention over keys [0, valid), valid a tensor.

CPU: the reference against float64 loop-by-loop math (kernels.attention_lse's naive
attention with the prefix as its mask) over odd shapes and GQA; opcheck; one node of a
fullgraph compile that serves every `valid` without recompiling; bad inputs. GPU (marker
`gpu`): the FlashAttention-2 variable-length path against the reference at a HunyuanImage-3
denoise shape per TP2 rank (16 query heads, 4 KV heads, head_dim 128, 4096 image rows over
up to 5400 keys) in bf16, batch 1 and 2, and opcheck on CUDA.

Tolerances: float32 against float64 loops 1e-5 (a wrong key count moves rows by O(0.1),
checked below); bf16 flash against the float32 reference: relative Frobenius error 1e-2
(outputs rounded once to bf16, 2^-9 per element).
"""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from kernels.attention_key_prefix import attention_key_prefix, attention_key_prefix_reference
from kernels.attention_lse import attention_lse_naive


def _qkv(B, Hq, Hkv, Sq, Sk, D, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(device, dtype)
            for shape in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D))]


def _naive(q, k, v, valid):
    mask = (torch.arange(k.shape[2]) < valid).expand(q.shape[2], -1)
    return attention_lse_naive(q, k, v, mask)[0]


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,valid", [
    (1, 4, 4, 7, 13, 8, 13), (2, 6, 2, 5, 11, 16, 1), (1, 8, 1, 9, 17, 8, 10), (2, 3, 3, 1, 4, 4, 3)])
def test_reference_matches_naive(B, Hq, Hkv, Sq, Sk, D, valid):
    q, k, v = _qkv(B, Hq, Hkv, Sq, Sk, D)
    out = attention_key_prefix(q, k, v, torch.tensor(valid))
    torch.testing.assert_close(out.double(), _naive(q, k, v, valid), rtol=1e-5, atol=1e-5)
    if valid < Sk:   # the keys past the prefix must matter in this test
        assert (attention_key_prefix(q, k, v, torch.tensor(Sk)) - out).abs().max() > 1e-2


def test_opcheck_cpu():
    q, k, v = _qkv(2, 4, 2, 5, 9, 8)
    torch.library.opcheck(torch.ops.dtgen.attention_key_prefix.default, (q, k, v, torch.tensor([6]), "auto"))


def test_one_graph_serves_every_prefix_length():
    torch._dynamo.reset()
    counters.clear()
    q, k, v = _qkv(1, 4, 2, 6, 12, 8)
    fn = torch.compile(attention_key_prefix, fullgraph=True, backend="aot_eager")
    for valid in (3, 7, 12):
        torch.testing.assert_close(fn(q, k, v, torch.tensor(valid)),
                                   attention_key_prefix_reference(q, k, v, torch.tensor(valid)))
    assert int(counters["stats"]["unique_graphs"]) == 1


@pytest.mark.parametrize("call,message", [
    (lambda q, k, v: attention_key_prefix(q, k[:, :1, :, :3], v[:, :1, :, :3], torch.tensor(2)), "does not fit"),
    (lambda q, k, v: attention_key_prefix(q, k, v, torch.tensor([2, 3])), "valid must be one"),
    (lambda q, k, v: attention_key_prefix(q, k, v, torch.tensor(2.0)), "valid must be one"),
    (lambda q, k, v: attention_key_prefix(q, k, v, torch.tensor(2), impl="cudnn"), "impl must be one of"),
    (lambda q, k, v: attention_key_prefix(q, k, v, torch.tensor(2), impl="flash"), "needs CUDA"),
])
def test_bad_inputs_raise_with_names_and_shapes(call, message):
    q, k, v = _qkv(1, 4, 2, 3, 5, 8)
    with pytest.raises((ValueError, RuntimeError), match=message):
        call(q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu marker)")
@pytest.mark.parametrize("B", [1, 2])
def test_gpu_flash_matches_reference_real_shapes(B):
    q, k, v = _qkv(B, 16, 4, 4096, 5400, 128, dtype=torch.bfloat16, device="cuda")
    for valid in (5400, 4100, 4777):
        n = torch.tensor(valid, device="cuda")
        out = attention_key_prefix(q, k, v, n, impl="flash")
        ref = attention_key_prefix_reference(q.float(), k.float(), v.float(), n)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert out.shape == ref.shape and err < 1e-2, (valid, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu marker)")
def test_gpu_opcheck():
    q, k, v = _qkv(2, 8, 2, 33, 70, 64, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.dtgen.attention_key_prefix.default,
                          (q, k, v, torch.tensor([41], device="cuda"), "auto"))
