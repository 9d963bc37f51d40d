"""The profile's split of each region: compute, communication, waiting for a slower rank, idle."""
from types import SimpleNamespace

import pytest
import torch

from dtgen.profiling import REGION_PREFIX, PhaseProfiler, region_stats, split_waiting

CUDA = torch.autograd.DeviceType.CUDA
CPU = torch.autograd.DeviceType.CPU


def _event(name, start, end, device=CUDA, annotation=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           is_user_annotation=annotation, self_cpu_time_total=end - start)


def _trace(nccl_durations, offset=0.0):
    """Two regions (microseconds): [0, 100) and [100, 300), with kernels and host rows."""
    events = [_event(REGION_PREFIX + "step", 0, 100, CPU), _event(REGION_PREFIX + "step", 100, 300, CPU),
              # host-side rows and the GPU copy of the annotation: never counted
              _event("record_param_comms", 10, 90, CPU), _event(REGION_PREFIX + "step", 0, 100, CUDA, True),
              # region 1: compute 10-40, NCCL 30-60 (10 of it under compute), compute 70-80
              _event("gemm", 10, 40), _event("ncclDevKernel_AllReduce", 30, 30 + nccl_durations[0]),
              _event("norm", 70, 80),
              # region 2: one NCCL kernel alone
              _event("ncclDevKernel_AllGather", 120 + offset, 120 + offset + nccl_durations[1])]
    return events


def test_region_split_counts_kernels_once_and_hidden_communication_as_compute():
    first, second = region_stats(_trace([30, 50]), [("step", 1), ("step", 2)])
    assert first.wall_us == 100 and first.compute_us == 40       # 10-40 and 70-80
    assert first.comm_us == 20                                     # 40-60: NCCL alone
    assert first.idle_us == 40 and first.nccl == [30]
    assert second.units == 2 and second.compute_us == 0 and second.comm_us == 50 and second.idle_us == 150


def test_waiting_is_the_excess_over_the_fastest_rank():
    mine = region_stats(_trace([30, 50]), [("step", 1), ("step", 1)])
    other = region_stats(_trace([12, 5]), [("step", 1), ("step", 1)])   # arrived last: waited least
    split_waiting([mine, other])
    assert mine[0].wait_us == pytest.approx(18) and mine[1].wait_us == pytest.approx(45)
    assert other[0].wait_us == 0 and other[1].wait_us == 0
    # only the exposed part can be waiting: never more than the region's communication time
    assert mine[0].wait_us <= mine[0].comm_us


def test_mismatched_kernel_lists_leave_waiting_unknown():
    mine = region_stats(_trace([30, 50]), [("step", 1), ("step", 1)])
    other = region_stats(_trace([30, 50])[:-1], [("step", 1), ("step", 1)])
    split_waiting([mine, other])
    assert mine[1].wait_us is None


def test_summary_rows_are_per_unit(tmp_path):
    profiler = PhaseProfiler(tmp_path)
    profiler.regions["denoise"] = region_stats(_trace([30, 50]), [("step", 1), ("step", 2)])
    rows = profiler.summary_rows()["denoise"]
    assert len(rows) == 1 and rows[0]["units"] == 3
    assert rows[0]["wall_ms"] == pytest.approx(0.3) and rows[0]["per_unit_ms"]["wall_ms"] == pytest.approx(0.1)
    assert rows[0]["per_unit_ms"]["communication_ms"] == pytest.approx(0.07 / 3, abs=1e-4)
