"""The FP8 kernels side by side on one H100: the Triton kernels that run by default, the Gluon kernels
(warp-specialized, TMA-fed) and torch's library ops, at HunyuanImage-3's and Wan's shapes."""
from __future__ import annotations

from bench.report_cells import Calc, Join, Row, Runs, Section, Table, Value, Verdict
from bench.specs.runs import HOPPER_ATTENTION, HOPPER_GEMM, HOPPER_GEMV

_FP8 = "fused_fp8.channels"
_GLUON_PINGPONG = f"{_FP8}.gluon.tiles[1]"    # 128 x 128, two consumer warpgroups in ping-pong (each file's 2nd)
_ATTENTION_SHAPES = [("1.3B", "Wan 1.3B: 12 heads, 32760 x 32760"), ("14B", "Wan 14B: 40 heads, 32760 x 32760"),
                     ("hy-t2i", "HunyuanImage-3 T2I denoise: 32 / 8 heads, 4098 x 5606"),
                     ("hy-ti2i", "HunyuanImage-3 edit denoise: 32 / 8 heads, 4098 x 9702")]
_GEMV = 'results["qkv/gate_up N=6144 K=4096 fp8 M=1"].variants'


def _torch(cell) -> Join:
    return Join([cell], prefix="torch._scaled_grouped_mm: ")


def _gemm(key, fmt="{:.0f}", unit=" TFLOP/s") -> Runs:
    return Runs([(f, key) for f in HOPPER_GEMM], fmt, unit)


def _attention(shape, run) -> Runs:
    return Runs([(f, f'shapes["{shape}"].runs["{run}"].ms') for f in HOPPER_ATTENTION[shape]], "{:.3f}", " ms")


def _attention_row(shape, label) -> Row:
    floors = HOPPER_ATTENTION[shape][-1]
    return Row([f"FP8 attention, {label}", _attention(shape, "fp8-kernel"), _attention(shape, "fp8-kernel-gluon"), "",
                Join([Value(f'shapes["{shape}"].floors_ms.mma_8bit', "{:.2f} ms (MMAs)", floors),
                      Value(f'shapes["{shape}"].floors_ms.exp2_full', "{:.2f} ms (exp2)", floors)], ", "),
                Verdict(Calc(lambda triton, gluon: triton / gluon,
                             [_attention(shape, "fp8-kernel"), _attention(shape, "fp8-kernel-gluon")]), 1.3, ">=",
                        ">= 1.3x the Triton kernel")])


KERNELS = Table("hopper-h100-kernels", "The Gluon kernels beside the Triton ones and torch's", [
    "kernel", "Triton (the default)", "Gluon", "torch (same GPU, same inputs)", "floor", "target"], [
    Row(["MoE grouped GEMMs gate/up, FP8 experts (channel scales), T=2674, 64 experts, top-8, two micros of 768",
         _gemm(f"{_FP8}.gate_up[0].tflops"), _gemm(f"{_GLUON_PINGPONG}.gate_up_gemms.tflops"),
         _torch(_gemm(f"{_FP8}.scaled_grouped_mm.gate_up_gemms_fast_accum.tflops")),
         "1979 TFLOP/s (8-bit dense)",
         Verdict(_gemm(f"{_GLUON_PINGPONG}.gate_up_gemms.tflops"), 1100.0, ">=", ">= 1100 TFLOP/s")]),
    Row(["... down (Triton sums the micros in its K loop; Gluon and torch run torch's contract: 128 groups of K 768)",
         _gemm(f"{_FP8}.down[0].tflops"), _gemm(f"{_GLUON_PINGPONG}.down.tflops"),
         _torch(_gemm(f"{_FP8}.scaled_grouped_mm.down_fast_accum.tflops")),
         "", ""]),
    Row(["... the experts op whole (x gathered, quantized, both GEMMs, the finalize)",
         _gemm(f"{_FP8}.experts_op.fused.us", "{:.0f}", " us"), _gemm(f"{_FP8}.experts_op.gluon.us", "{:.0f}", " us"),
         _torch(_gemm(f"{_FP8}.experts_op.scaled_grouped_mm.us", "{:.0f}", " us")),
         "", ""]),
    *[_attention_row(shape, label) for shape, label in _ATTENTION_SHAPES],
    Row(["AR decode GEMV, e4m3, one row, 6144 x 4096 (qkv, gate/up)",
         Value(f"{_GEMV}.table.TBps.median", "{:.2f} TB/s (1 run)", HOPPER_GEMV),
         Value(f"{_GEMV}.tma_n8_8k_w4_s4_p2.TBps.median", "TMA ring, its fastest config: {:.2f} TB/s (1 run)",
               HOPPER_GEMV),
         Value(f"{_GEMV}.torch.TBps.median", "torch._scaled_mm: {:.2f} TB/s", HOPPER_GEMV),
         "3.35 TB/s (the H100's HBM3)", ">= 3.5 TB/s on an H200: not run there"]),
], note="Each kernel alone on the same inputs, in the same process, on an H100 SXM (the H200's SMs and tensor "
        "cores, with less and slower memory); a run is a process, each on the H100 the loan gave (runs differ by up to "
        "4% between machines: compare the two kernels within a run, `bench/results/` holds each). The GEMMs and the "
        "experts op are timed as CUDA-graph replays (the Gluon GEMM builds its work table and TMA descriptors on "
        "the host each call); useful TFLOP/s count the routed rows, not the row tiles' padding. The attention "
        "floors: the two MMAs at the 8-bit tensor cores' dense rate, and one exp2 a logit at the exp2 unit's rate "
        "measured in the same run (about 15 a clock an SM). The GEMV's TMA row is its sweep's fastest "
        "configuration; the Triton row is the config table's kernel.")

SECTIONS = [Section("FP8 kernels on Hopper, one H100", [KERNELS])]
