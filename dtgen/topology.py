"""Process groups and device meshes of every phase, created once at start-up.

Meshes are identity-ordered (the mesh tensor is arange(world) reshaped): a DeviceMesh over
a permuted rank list does not permute communication, so data and DTensor metadata would
silently disagree. Where a phase's logical TP order differs from physical order (the AR
phase of an ABAB layout), the order is carried explicitly: sums need nothing, ordered
gathers reorder by `tp_gather_order`.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .plan import PhaseLayout, ResolvedPlan


@dataclass
class PhaseGroups:
    """This rank's view of one phase's topology."""

    layout: PhaseLayout
    mesh: DeviceMesh | None
    tp_group: dist.ProcessGroup | None
    sp_group: dist.ProcessGroup | None
    tp_rank: int            # logical TP rank
    sp_rank: int
    tp_gather_order: tuple[int, ...]  # for logical rank i, the index of its chunk in a group-order gather
    # Per sequence axis (only when the phase has several): axis -> (group, size, rank in it).
    sp_axes: dict[str, tuple[dist.ProcessGroup, int, int]] = field(default_factory=dict)
    cfg_group: dist.ProcessGroup | None = None
    cfg_rank: int = 0

    @property
    def cfg_size(self) -> int:
        return self.layout.cfg_size

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def sp_size(self) -> int:
        return self.layout.sp_size


class Topology:
    """`control`: a gloo group over every rank for control-plane agreement (phase ids, run
    facts), with its own short timeout: a rank that never arrives makes the others fail in
    `control_timeout_s` seconds rather than wait out the data plane's long one."""

    def __init__(self, resolved: ResolvedPlan, rank: int, device_type: str = "cpu",
                 control_timeout_s: float = 60.0):
        self.resolved = resolved
        self.rank = rank
        self.world_size = resolved.world_size
        self.device_type = device_type
        distributed = self.world_size > 1
        if distributed and not dist.is_initialized():
            raise RuntimeError(f"plan '{resolved.plan.name}' needs {self.world_size} ranks: initialise "
                               f"torch.distributed first (torchrun, or dtgen.launch)")
        self.control_timeout_s = control_timeout_s
        self.control = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s))
                        if distributed else None)
        meshes: dict[tuple, DeviceMesh] = {}
        self._extra_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.phases: dict[str, PhaseGroups] = {}
        # Same order on every rank: phases in plan order, mesh dims in mesh order.
        for name, layout in resolved.phases.items():
            mesh = None
            if distributed:
                key = (layout.mesh_shape, layout.mesh_dim_names)
                if key not in meshes:
                    meshes[key] = DeviceMesh(device_type,
                                             torch.arange(self.world_size).reshape(layout.mesh_shape),
                                             mesh_dim_names=layout.mesh_dim_names)
                mesh = meshes[key]
            names = layout.mesh_dim_names
            tp_group = mesh.get_group("tp") if mesh is not None and "tp" in names and layout.tp_size > 1 else None
            sp_group = mesh.get_group("sp") if mesh is not None and "sp" in names and layout.sp_size > 1 else None
            members = layout.tp_group_of(rank)
            logical = [layout.tp_rank[m] for m in members]
            order = tuple(logical.index(i) for i in range(len(members)))
            sp_axes = {}
            for axis, groups in layout.sp_axis_groups:
                mine = next(g for g in groups if rank in g)
                handles = [self._new_group(g) for g in groups]  # every rank creates every group, in order
                sp_axes[axis] = (handles[groups.index(mine)], len(mine), mine.index(rank))
            cfg_group = mesh.get_group("cfg") if mesh is not None and layout.cfg_size > 1 else None
            self.phases[name] = PhaseGroups(layout, mesh, tp_group, sp_group, layout.tp_rank[rank],
                                            layout.sp_rank[rank], order, sp_axes, cfg_group, layout.cfg_rank[rank])

    def _new_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        if ranks not in self._extra_groups:
            self._extra_groups[ranks] = dist.new_group(list(ranks))
        return self._extra_groups[ranks]

    @property
    def storage_rank(self) -> int:
        return self.resolved.storage_rank[self.rank]

    def barrier(self, what: str, timeout_s: float) -> None:
        """Wait for every rank on the control group; name the ranks that did not arrive."""
        if self.control is None:
            return
        try:
            dist.monitored_barrier(self.control, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or ["?"])[0]
            raise RuntimeError(f"{what}: not every rank arrived within {timeout_s:.0f} s: {first}") from None
