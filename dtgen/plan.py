"""Placement plans: per-phase parallel topologies written as data.

A plan names a *device grid* (named axes with sizes, laid over the ranks row-major, so the
last axis is the innermost) and, per phase, which grid axes the phase uses for tensor
parallelism (`tp`) and for sequence parallelism (`sp`), plus the attention kind. Parameter
rules (globs to `Rule`) and module output layouts (globs to `Output`) say how weights are
split and where partial results are combined.

The one idea: weights are stored once, sharded over the *storage axes*: the `tp` axes of
the phase with the fewest TP ranks. Every other phase must shard over those same axes
first (major) and then over axes that the storage phase uses for replicas. Then each rank's
shard in that phase is a sub-block ("micro") of the storage shard it already holds, and
the phase switch is a change of views. `resolve` checks exactly this, and says why when it
fails.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping


class PlanError(ValueError):
    """A plan that cannot work (for this world size, or for this model); the message says why."""

    one_line = True   # its message is the whole story: spawned ranks' launcher prints it once (dtgen.launch)


class Rule(str, Enum):
    """How one parameter is split across a phase's TP ranks."""

    REPLICATE = "replicate"
    COLUMN = "column"                      # output rows (dim 0)
    COLUMN_KV_GROUPS = "column_kv_groups"  # output rows in whole KV-head groups (fused QKV)
    PAIR = "pair"                          # fused gate/up [x1; x2]: each half split alike, micro-packed
    ROW = "row"                            # input columns (last dim); the module output is a partial sum
    VOCAB = "vocab"                        # vocabulary rows of the output head; logits gathered in order


class Output(str, Enum):
    """What a module's output is under TP, and so which collective follows it."""

    PARTIAL_SUM = "partial_sum"        # all-reduce (sum) over the TP group
    VOCAB_SHARDED = "vocab_sharded"    # all-gather over the TP group, reordered by logical TP rank


@dataclass(frozen=True)
class AttentionKind:
    """What a plan may say about one attention kind: its name and the sp axes it takes.

    The cores live in `dtgen.sp`, one per kind here (a test holds the two tables equal). The
    table is here, as plain data, so that reading or checking a plan loads no attention code
    (and no Triton), and so that `dtgen.sp` can import plans without a circle.

    sequence_parallel: whether the kind shards the sequence (needs sp axes); only 'local' does not.
    max_sp_axes / exact_sp_axes: how many grid axes its sp may name, when it has a limit
        (`axes_meaning` says what they are, for the error).
    """

    name: str
    summary: str
    sequence_parallel: bool = True
    max_sp_axes: int | None = None
    exact_sp_axes: int | None = None
    axes_meaning: str = ""


ATTENTION_KINDS: dict[str, AttentionKind] = {k.name: k for k in (
    AttentionKind("local", "no sequence parallelism", sequence_parallel=False),
    AttentionKind("ulysses", "all-to-all to head shards"),
    AttentionKind("ulysses-pipelined", "Ulysses in head groups, exchanges overlapped"),
    AttentionKind("kv-allgather", "K/V all-gathered"),
    AttentionKind("ring", "K/V ring over P2P"),
    AttentionKind("attn2d", "Attention2D rows x cols grid",
                  max_sp_axes=2, axes_meaning="rows, then cols; one axis is 1 x P"),
    AttentionKind("ulysses-ring", "ring (outer sp axis) over Ulysses (inner sp axis)",
                  max_sp_axes=2, exact_sp_axes=2, axes_meaning="ring axis, then Ulysses axis"),
    AttentionKind("ulysses-attn2d", "Attention2D 1 x P (outer sp axis) over Ulysses (inner sp axis)",
                  max_sp_axes=2, exact_sp_axes=2, axes_meaning="Attention2D axis, then Ulysses axis"),
)}


@dataclass(frozen=True)
class PhasePlan:
    """Grid axes of one phase: `tp` shards weights (major first), `sp` shards the sequence,
    `cfg` (one axis of size 2) puts the conditional and unconditional rows on disjoint
    halves, `replicate` runs the same work on every rank of its axes (a small phase, such as
    a text encoder, where computing twice costs less than moving the result). An axis plays
    one role per phase; every grid axis must play one."""

    tp: tuple[str, ...] = ()
    sp: tuple[str, ...] = ()
    attention: str = "local"
    cfg: tuple[str, ...] = ()
    replicate: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    name: str
    grid: tuple[tuple[str, int], ...]
    phases: Mapping[str, PhasePlan]
    params: Mapping[str, Rule]
    outputs: Mapping[str, Output] = field(default_factory=dict)
    summary: str = ""

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.grid)


def diffusion_plan(name: str, grid: tuple[tuple[str, int], ...], denoise: PhasePlan, summary: str, *,
                   params: Mapping[str, Rule], outputs: Mapping[str, Output] | None = None,
                   encode: PhasePlan | None = None, decode: PhasePlan | None = None) -> Plan:
    """A plan of an encode -> denoise -> decode model's three phases. Unless the plan says
    otherwise, every rank encodes the (same) prompt, so no rank waits for another's text
    encoder and nothing moves afterwards; the VAE is replicated too (the pipeline splits its
    decode spatially over a process group of its own, not by the plan)."""
    every = PhasePlan(replicate=tuple(axis for axis, _ in grid))
    return Plan(name=name, grid=grid, phases={"encode": encode or every, "denoise": denoise, "decode": decode or every},
                params=params, outputs=outputs or {}, summary=summary)


def find_plan(plans: Mapping[str, Plan], name: str, model: str) -> Plan:
    """`plans[name]` (a placements module's PLANS), or one line naming the model's plans."""
    if name not in plans:
        raise PlanError(f"unknown {model} plan {name!r}; known: {sorted(plans)}")
    return plans[name]


# --------------------------------------------------------------------------------------
# Resolution: what a plan means for the ranks
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseLayout:
    """One phase's layout, for every rank (physical ranks are 0..world-1)."""

    name: str
    tp_size: int
    sp_size: int
    cfg_size: int
    attention: str
    micros_per_rank: int                 # micro packs each rank's phase shard spans
    mesh_shape: tuple[int, ...]          # identity-ordered mesh over the grid
    mesh_dim_names: tuple[str, ...]      # one per role ('tp', 'sp'), in grid order
    tp_rank: tuple[int, ...]             # logical TP rank of every physical rank
    sp_rank: tuple[int, ...]             # SP rank (position in its ascending SP group)
    tp_groups: tuple[tuple[int, ...], ...]  # physical ranks, ascending, one tuple per group
    sp_groups: tuple[tuple[int, ...], ...]
    cfg_rank: tuple[int, ...]
    cfg_groups: tuple[tuple[int, ...], ...]
    # Each sequence axis on its own (for kinds that split SP further, e.g. Attention2D
    # rows x cols): axis name -> its groups, in the order the plan lists the sp axes.
    sp_axis_groups: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()

    def micro_group(self, rank: int, storage_tp: int) -> int:
        """Which block of `micros_per_rank` micros of its storage shard `rank` uses."""
        return self.tp_rank[rank] % (self.tp_size // storage_tp)

    def tp_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.tp_groups if rank in g)

    def sp_group_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.sp_groups if rank in g)


@dataclass(frozen=True)
class ResolvedPlan:
    plan: Plan
    world_size: int
    storage_axes: tuple[str, ...]
    storage_tp: int                  # S: storage shards
    num_micros: int                  # micro packs per storage shard
    storage_rank: tuple[int, ...]    # storage shard of every physical rank
    phases: Mapping[str, PhaseLayout]


def _coords(rank: int, grid: tuple[tuple[str, int], ...]) -> dict[str, int]:
    out = {}
    for name, size in reversed(grid):
        out[name] = rank % size
        rank //= size
    return out


def _flat(coords: dict[str, int], axes: tuple[str, ...], sizes: dict[str, int]) -> int:
    index = 0
    for a in axes:
        index = index * sizes[a] + coords[a]
    return index


def _groups(world: int, grid, vary: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Rank sets that differ only along `vary` (ascending physical order)."""
    fixed = [a for a, _ in grid if a not in vary]
    groups: dict[tuple, list[int]] = {}
    for r in range(world):
        c = _coords(r, grid)
        groups.setdefault(tuple(c[a] for a in fixed), []).append(r)
    return tuple(tuple(g) for g in groups.values())


def _mesh_for_roles(plan: Plan, phase: str, roles: dict[str, tuple[str, ...]]):
    """Merge each role's grid axes into one mesh dim; the axes must be adjacent in the grid."""
    axis_order = [a for a, _ in plan.grid]
    sizes = dict(plan.grid)
    shape, names = [], []
    i = 0
    while i < len(axis_order):
        axis = axis_order[i]
        role = next((r for r, axes in roles.items() if axis in axes), None)
        if role is None:
            raise PlanError(f"plan '{plan.name}', phase '{phase}': grid axis '{axis}' has no role (tp or sp)")
        members = set(roles[role])
        span = 1
        j = i
        while j < len(axis_order) and axis_order[j] in members:
            span *= sizes[axis_order[j]]
            j += 1
        if j - i != len(members):
            raise PlanError(f"plan '{plan.name}', phase '{phase}': the {role} axes {roles[role]} must be adjacent "
                            f"in the grid {axis_order} so that one identity-ordered mesh dim can hold them")
        shape.append(span)
        names.append(role)
        i = j
    return tuple(shape), tuple(names)


def resolve(plan: Plan, world_size: int) -> ResolvedPlan:
    """Check a plan against the world size and the nesting rule; compute every rank's layout."""
    if plan.world_size != world_size:
        raise PlanError(f"plan '{plan.name}' is laid out for {plan.world_size} ranks "
                        f"(grid {dict(plan.grid)}), but the world size is {world_size}")
    sizes = dict(plan.grid)
    if len(sizes) != len(plan.grid):
        raise PlanError(f"plan '{plan.name}': grid axis names repeat: {[a for a, _ in plan.grid]}")
    if not plan.phases:
        raise PlanError(f"plan '{plan.name}' has no phases")
    for name, ph in plan.phases.items():
        used = ph.tp + ph.sp + ph.cfg + ph.replicate
        unknown = [a for a in used if a not in sizes]
        if unknown:
            raise PlanError(f"plan '{plan.name}', phase '{name}': axes {unknown} are not in the grid {list(sizes)}")
        if len(set(used)) != len(used):
            raise PlanError(f"plan '{plan.name}', phase '{name}': an axis is used twice in tp={ph.tp} sp={ph.sp} "
                            f"cfg={ph.cfg} replicate={ph.replicate}")
        if ph.cfg and math.prod(sizes[a] for a in ph.cfg) != 2:
            raise PlanError(f"plan '{plan.name}', phase '{name}': the cfg axes {ph.cfg} must hold exactly 2 ranks "
                            f"(conditional and unconditional), got {math.prod(sizes[a] for a in ph.cfg)}")
        kind = ATTENTION_KINDS.get(ph.attention)
        if kind is None:
            raise PlanError(f"plan '{plan.name}', phase '{name}': unknown attention kind {ph.attention!r}; "
                            f"known: {tuple(ATTENTION_KINDS)}")
        if kind.sequence_parallel != bool(ph.sp):
            raise PlanError(f"plan '{plan.name}', phase '{name}': attention {ph.attention!r} "
                            + ("needs sequence-parallel axes (sp)" if kind.sequence_parallel
                               else f"cannot shard the sequence over {ph.sp}; pick a sequence-parallel kind"))
        if kind.max_sp_axes is not None and len(ph.sp) > kind.max_sp_axes:
            raise PlanError(f"plan '{plan.name}', phase '{name}': attention {ph.attention!r} takes at most "
                            f"{kind.max_sp_axes} sp axes ({kind.axes_meaning}), got {len(ph.sp)}: {ph.sp}")
        if kind.exact_sp_axes is not None and len(ph.sp) != kind.exact_sp_axes:
            raise PlanError(f"plan '{plan.name}', phase '{name}': attention {ph.attention!r} needs exactly "
                            f"{kind.exact_sp_axes} sp axes ({kind.axes_meaning}), got {ph.sp}")

    tp_size = {n: math.prod(sizes[a] for a in ph.tp) for n, ph in plan.phases.items()}
    storage_phase = min(plan.phases, key=lambda n: tp_size[n])
    storage_axes = plan.phases[storage_phase].tp
    S = tp_size[storage_phase]
    copies = world_size // S
    for name, ph in plan.phases.items():
        if ph.tp[:len(storage_axes)] != storage_axes:
            raise PlanError(
                f"plan '{plan.name}': phase '{name}' shards weights over {ph.tp}, but storage is sharded over "
                f"{storage_axes} (the TP axes of '{storage_phase}'). Every phase must shard over the storage axes "
                f"first, so that its shard on each rank is a sub-view of the storage shard that rank holds")
        extra = ph.tp[len(storage_axes):]
        replicas = math.prod(sizes[a] for a in extra)
        idle = [a for a in sizes if a not in ph.tp + ph.sp + ph.cfg + ph.replicate]
        if idle:
            raise PlanError(
                f"plan '{plan.name}', phase '{name}': grid axes {idle} have no role. Each storage shard has "
                f"{copies} copies (world {world_size} / storage TP {S}); this phase uses TP_phase / TP_storage = "
                f"{tp_size[name]} / {S} = {replicas} of them as micro shards and needs the rest on sequence or "
                f"CFG axes, but {idle} would only hold duplicates (name them in `replicate` if the phase should "
                f"run the same work on every rank)")
    num_micros = math.lcm(*(tp_size[n] // S for n in plan.phases))

    storage_rank = tuple(_flat(_coords(r, plan.grid), storage_axes, sizes) for r in range(world_size))
    phases = {}
    for name, ph in plan.phases.items():
        roles = {role: axes for role, axes in (("cfg", ph.cfg), ("sp", ph.sp), ("tp", ph.tp), ("replicate", ph.replicate))
                 if axes}
        shape, dim_names = _mesh_for_roles(plan, name, roles) if roles else ((), ())
        tp_rank = tuple(_flat(_coords(r, plan.grid), ph.tp, sizes) for r in range(world_size))
        sp_groups = _groups(world_size, plan.grid, ph.sp)
        sp_rank = tuple(next(g for g in sp_groups if r in g).index(r) for r in range(world_size))
        cfg_groups = _groups(world_size, plan.grid, ph.cfg)
        cfg_rank = tuple(next(g for g in cfg_groups if r in g).index(r) for r in range(world_size))
        phases[name] = PhaseLayout(
            name=name, tp_size=tp_size[name], sp_size=math.prod(sizes[a] for a in ph.sp),
            cfg_size=math.prod(sizes[a] for a in ph.cfg), cfg_rank=cfg_rank, cfg_groups=cfg_groups,
            attention=ph.attention, micros_per_rank=num_micros // (tp_size[name] // S),
            mesh_shape=shape, mesh_dim_names=dim_names, tp_rank=tp_rank, sp_rank=sp_rank,
            tp_groups=_groups(world_size, plan.grid, ph.tp), sp_groups=sp_groups,
            sp_axis_groups=tuple((a, _groups(world_size, plan.grid, (a,))) for a in ph.sp) if len(ph.sp) > 1 else ())
    return ResolvedPlan(plan, world_size, storage_axes, S, num_micros, storage_rank, phases)


# --------------------------------------------------------------------------------------
# Matching rules to a model
# --------------------------------------------------------------------------------------
def match_rules(plan: Plan, param_names: list[str], unbuilt: tuple[str, ...] = ()) -> dict[str, Rule]:
    """Exactly one rule per parameter; every glob must match something, except the globs of
    modules this model was built without (`unbuilt`: name prefixes, e.g. an encoder only
    image editing uses)."""
    matched: dict[str, list[str]] = {n: [] for n in param_names}
    unused = []
    for glob in plan.params:
        hits = [n for n in param_names if fnmatch.fnmatchcase(n, glob)]
        if not hits and not glob.startswith(unbuilt):
            unused.append(glob)
        for n in hits:
            matched[n].append(glob)
    if unused:
        raise PlanError(f"plan '{plan.name}': parameter globs {unused} match no parameter of the model")
    uncovered = [n for n, g in matched.items() if not g]
    if uncovered:
        raise PlanError(f"plan '{plan.name}': no rule covers parameters {uncovered[:8]}"
                        + (f" (+{len(uncovered) - 8} more)" if len(uncovered) > 8 else ""))
    ambiguous = {n: g for n, g in matched.items() if len(g) > 1}
    if ambiguous:
        n, g = next(iter(ambiguous.items()))
        raise PlanError(f"plan '{plan.name}': parameter {n!r} matches several rules {g}; make the globs disjoint")
    return {n: plan.params[g[0]] for n, g in matched.items()}


def match_outputs(plan: Plan, module_names: list[str]) -> dict[str, Output]:
    out = {}
    for glob, layout in plan.outputs.items():
        hits = [n for n in module_names if fnmatch.fnmatchcase(n, glob)]
        if not hits:
            raise PlanError(f"plan '{plan.name}': output glob {glob!r} matches no module of the model")
        for n in hits:
            out[n] = layout
    return out
