"""The shared expert on a side stream at decode (dtgen/side_stream.py, `MoE.shared_beside`).

CPU: the op `dtgen::gated_mlp_beside` computes `GatedMLP`'s math (bf16 and FP8 weights; on
the CPU there is no stream, so the values are the module's exactly), both ops pass
torch.library.opcheck, and under torch.compile the join keeps the later read of the
branch's output after it and the values unchanged. GPU (marker `gpu`): a decode-sized MoE
call with the shared expert beside gives the values of the one-stream call, bit for bit
(the same eager kernels), eagerly and replayed as a hand-recorded CUDA graph; the compiled
decode with it runs in tests/hunyuan_image3/test_compile.py::test_cuda_graph_decode_matches_eager
(on by default there).
"""
import pytest
import torch

from dtgen.cuda_graph import GraphedStep
from dtgen.side_stream import join_side_stream_, run_beside
from kernels.fp8_quant import quantize_weight_channels
from kernels.moe_dispatch import experts_impl
from models.hunyuan_image3.config import HunyuanImage3Config
from models.hunyuan_image3.model import set_shared_expert_beside
from models.hunyuan_image3.tiny import tiny_config
from models.hunyuan_image3.transformer import MoE, GatedMLP, gated_mlp, gated_mlp_beside


def _mlp(fp8: bool, device="cpu", hidden=64, intermediate=48) -> GatedMLP:
    g = torch.Generator().manual_seed(0)
    mlp = GatedMLP(hidden, intermediate)
    with torch.no_grad():
        mlp.gate_and_up_proj.data = (torch.randn(1, 2 * intermediate, hidden, generator=g) / hidden ** 0.5).bfloat16()
        mlp.down_proj.data = (torch.randn(hidden, intermediate, generator=g) / intermediate ** 0.5).bfloat16()
        if fp8:
            q, s = quantize_weight_channels(mlp.gate_and_up_proj.data.float())
            mlp.use_fp8()
            mlp.gate_and_up_proj.data, mlp.gate_and_up_scale.data = q, s
            q, s = quantize_weight_channels(mlp.down_proj.data.float())
            mlp.down_proj.data, mlp.down_scale.data = q, s
    return mlp.to(device)


def _args(mlp: GatedMLP, x: torch.Tensor):
    return (x, mlp.gate_and_up_proj, mlp.down_proj, mlp.gate_and_up_scale, mlp.down_scale)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_op_computes_the_modules_math(fp8):
    mlp = _mlp(fp8)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        want = mlp(x)
        got = gated_mlp_beside(*_args(mlp, x))
        join_side_stream_(got)
    assert got.shape == want.shape == (3, 64) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert torch.equal(run_beside(gated_mlp, *_args(mlp, x)), want)


def test_ops_pass_opcheck():
    mlp = _mlp(fp8=False)
    x = torch.randn(2, 64).bfloat16()
    torch.library.opcheck(gated_mlp_beside, _args(mlp, x))
    torch.library.opcheck(join_side_stream_, (torch.randn(2, 64),))


def test_join_orders_the_read_under_compile():
    """The join is declared to mutate its argument: a compiled graph keeps it before the read
    (the add) and the values are the eager ones."""
    mlp = _mlp(fp8=False)
    x = torch.randn(1, 64).bfloat16()
    h = torch.randn(1, 64).bfloat16()

    def step(h, x):
        shared = gated_mlp_beside(*_args(mlp, x))
        join_side_stream_(shared)
        return h + shared

    with torch.no_grad():
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(h, x), step(h, x))


def _moe(device: str, fp8: bool) -> MoE:
    """The tiny config's MoE as the model holds it: bf16 experts, the router in float32."""
    cfg = HunyuanImage3Config.from_dict(tiny_config(1))
    moe = MoE(cfg, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.data = (torch.randn(p.shape, generator=g) * 0.05).to(
                torch.float32 if name.startswith("gate.") else torch.bfloat16)
        moe.shared_mlp = _mlp(fp8, hidden=cfg.hidden_size, intermediate=moe.shared_mlp.down_proj.shape[1])
    return moe.to(device)


def test_set_shared_expert_beside_reaches_every_moe():
    moe = _moe("cpu", fp8=False)
    assert moe.shared_beside
    x = torch.randn(1, 1, moe.gate.wg.weight.shape[1]).bfloat16()
    with torch.no_grad():
        want = moe(x)
        set_shared_expert_beside(torch.nn.Sequential(moe), False)
        assert not moe.shared_beside
        assert torch.equal(moe(x), want)      # the CPU has no side stream: one path


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_beside_gives_the_one_stream_values(fp8):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89+")
    moe = _moe("cuda", fp8)
    moe.experts.impl = experts_impl("auto", eager=None)      # the kernels (the eager loop syncs)
    x = torch.randn(1, 1, moe.gate.wg.weight.shape[1], device="cuda").bfloat16()
    with torch.no_grad():
        moe.shared_beside = False
        want = moe(x)
        moe.shared_beside = True
        got = moe(x)
        if fp8:    # x quantized by one Triton kernel beside, by torch ops in line: e4m3 ties may part
            assert rel(got, want) < 1e-2
        else:
            assert torch.equal(got, want)
        graphed = GraphedStep(lambda t: moe(t) * 1)
        for _ in range(3):
            assert torch.equal(graphed(x), got)
        assert graphed.recorded == 1


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())
