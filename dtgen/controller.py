"""The phase controller: one resident copy of the weights, one set of views per phase.

Everything a phase needs is built once, up front: for every parameter a view of its
resident tensor (and the DTensor that describes it over the phase's mesh), the output
collectives its placements imply, and its attention core. `activate(phase)` first makes
every rank agree on the phase, then swaps those prebuilt objects in. It allocates no
parameter memory and copies nothing; `SwitchAudit` measures that instead of assuming it.
"""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from .collectives import all_gather, all_gather_eager, all_gather_ordered, all_reduce_sum
from .plan import Output, Rule
from .sequence import SequenceLayout
from .sp import cache_kv_heads, make_core
from .storage import ResidentStorage
from .topology import PhaseGroups, Topology


class PhaseMismatchError(RuntimeError):
    """Ranks asked for different phases (raised on every rank)."""


@dataclass
class PhaseRuntime:
    """What code running inside a phase may ask about it (passed in, never global)."""

    name: str
    groups: PhaseGroups
    seq: SequenceLayout

    @property
    def tp_size(self) -> int:
        return self.groups.tp_size

    @property
    def sp_size(self) -> int:
        return self.groups.sp_size

    @property
    def cfg_size(self) -> int:
        return self.groups.cfg_size

    @property
    def cfg_rank(self) -> int:
        return self.groups.cfg_rank

    def gather_cfg(self, x: torch.Tensor) -> torch.Tensor:
        """CFG-parallel phases: this rank's branch rows, concatenated with the other half's
        along dim 0 in CFG-rank order (0: conditional, 1: unconditional)."""
        if self.cfg_size == 1:
            return x
        return all_gather(x, 0, self.groups.cfg_group)

    def cache_kv_heads(self, q_heads_local: int, kv_heads_local: int) -> int:
        """KV heads per rank that this phase's attention core writes into a KV cache."""
        layout = self.groups.layout
        return cache_kv_heads(layout.attention, layout, q_heads_local, kv_heads_local)


@dataclass
class SwitchReport:
    ms: float = 0.0
    # of `ms`: waiting on the control group for every rank to ask for the same phase (a rank
    # still finishing the last phase's host work shows up here, not in the binding)
    agree_ms: float = 0.0
    param_bytes_before: int = 0
    param_bytes_after: int = 0
    allocated_bytes_delta: int = 0
    weights_copied: int = 0
    collectives: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("ms", "agree_ms", "param_bytes_before", "param_bytes_after",
                                              "allocated_bytes_delta", "weights_copied", "collectives")}


class SwitchAudit(TorchDispatchMode):
    """Records every tensor op dispatched during a switch, and which new tensors outlive it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self._created: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.overloadpacket.__name__)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t._base is None:
                self._created.append(weakref.ref(t))
        return out

    def surviving_bytes(self) -> int:
        """Bytes of tensors created during the switch that are still alive."""
        alive = (r() for r in self._created)
        return sum(t.untyped_storage().nbytes() for t in alive if t is not None)


def _placements(rule: Rule, ndim: int, micro_packed: bool, mesh_dim_names: tuple[str, ...], tp_size: int):
    if rule == Rule.REPLICATE or tp_size == 1:
        shard = Replicate()
    elif rule == Rule.ROW and not micro_packed:
        shard = Shard(ndim - 1)
    else:
        shard = Shard(0)
    return [shard if d == "tp" else Replicate() for d in mesh_dim_names]


class PhaseController:
    def __init__(self, model: nn.Module, storage: ResidentStorage, topology: Topology,
                 outputs: dict[str, Output], attention_modules: list[str]):
        self.model = model
        self.storage = storage
        self.topology = topology
        modules = dict(model.named_modules())
        self._param_slots = {}
        for name in storage.tensors:
            owner, _, attr = name.rpartition(".")
            self._param_slots[name] = (modules[owner], attr)
        self._attention_modules = [modules[n] for n in attention_modules]
        self._default_cores = [m.core for m in self._attention_modules]

        S = topology.resolved.storage_tp
        rank = topology.rank
        self.params: dict[str, dict[str, nn.Parameter]] = {}
        self.dtensors: dict[str, dict[str, DTensor]] = {}
        self._hooks: dict[str, list] = {}
        self._deferred_bias: dict[str, list[nn.Module]] = {}   # row-split linears whose hook adds the bias
        self._cores: dict[str, list[nn.Module]] = {}
        self.runtimes: dict[str, PhaseRuntime] = {}
        for phase, groups in topology.phases.items():
            layout = groups.layout
            micros, group = layout.micros_per_rank, layout.micro_group(rank, S)
            self.params[phase] = {}
            self.dtensors[phase] = {}
            for name, spec in storage.specs.items():
                view = storage.phase_view(name, micros, group)
                self.params[phase][name] = nn.Parameter(view, requires_grad=False)
                if groups.mesh is not None:
                    placements = _placements(spec.rule, view.dim(), spec.micro_packed, layout.mesh_dim_names,
                                             layout.tp_size)
                    self.dtensors[phase][name] = DTensor.from_local(view, groups.mesh, placements, run_check=False)
            self._hooks[phase] = self._output_hooks(groups, outputs, modules)
            self._deferred_bias[phase] = [m for m, fn in self._hooks[phase] if fn.func is _reduce_then_bias_hook]
            self._cores[phase] = [make_core(layout.attention, c, groups) for c in self._default_cores]
            self.runtimes[phase] = PhaseRuntime(phase, groups,
                                                SequenceLayout(groups.sp_group, groups.sp_size, groups.sp_rank))
        self.active: str | None = None
        self._handles: list = []
        self.last_switch: SwitchReport | None = None

    @staticmethod
    def _output_hooks(groups: PhaseGroups, outputs: dict[str, Output], modules) -> list:
        if groups.tp_size == 1:
            return []
        hooks = []
        for name, layout in outputs.items():
            module = modules[name]
            if (layout == Output.PARTIAL_SUM and hasattr(module, "defer_bias")
                    and isinstance(getattr(module, "bias", None), torch.Tensor)):
                # Every rank adding the bias to its partial sum would add it TP times (build
                # refuses a partial-sum module that adds its bias itself).
                fn = partial(_reduce_then_bias_hook, group=groups.tp_group)
            elif layout == Output.PARTIAL_SUM:
                fn = partial(_reduce_hook, group=groups.tp_group)
            else:
                fn = partial(_vocab_hook, group=groups.tp_group, order=groups.tp_gather_order)
            hooks.append((modules[name], fn))
        return hooks

    # ---- switching ------------------------------------------------------------------
    def agree(self, what: str, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all), over the control group; raises
        `PhaseMismatchError` on every rank if one does not arrive within the control timeout."""
        if self.topology.world_size == 1:
            return [list(values)]
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = torch.empty(self.topology.world_size * len(values), dtype=torch.int64)
        start = time.perf_counter()
        try:
            all_gather_eager(everyone, mine, self.topology.control)
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or ["?"])[0]
            timeout = self.topology.control_timeout_s
            why = (f"not every rank arrived within {timeout:.0f} s (a rank is stuck or failed)"
                   if time.perf_counter() - start >= 0.9 * timeout else "a rank left (it failed; see its output)")
            raise PhaseMismatchError(f"{what}: {why}: {first}") from None
        return everyone.view(self.topology.world_size, len(values)).tolist()

    def _agree(self, phase: str) -> None:
        names = list(self.runtimes)
        if self.topology.world_size == 1:
            if phase not in names:
                raise PhaseMismatchError(f"unknown phase {phase!r}; this plan has {names}")
            return
        asked = [row[0] for row in self.agree(f"phase agreement for '{phase}'",
                                              [names.index(phase) if phase in names else -1])]
        if len(set(asked)) != 1 or asked[0] < 0:
            who = ", ".join(f"rank {r}: {names[i] if i >= 0 else 'an unknown phase'!s}" for r, i in enumerate(asked))
            raise PhaseMismatchError(f"ranks disagree on the phase to enter ({who}); plan phases: {names}")

    def activate(self, phase: str) -> PhaseRuntime:
        before = self.param_bytes()
        cuda = torch.cuda.is_available() and self.topology.device_type == "cuda"
        mem0 = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        self._agree(phase)
        agree_ms = (time.perf_counter() - t0) * 1e3
        # The binding itself runs under the audit: every op it dispatches is recorded.
        audit = SwitchAudit()
        with audit:
            for name, param in self.params[phase].items():
                module, attr = self._param_slots[name]
                module._parameters[attr] = param
            for h in self._handles:
                h.remove()
            self._handles = [m.register_forward_hook(fn) for m, fn in self._hooks[phase]]
            deferring = {id(m) for m in self._deferred_bias[phase]}
            for module in (m for ms in self._deferred_bias.values() for m in ms):
                module.defer_bias = id(module) in deferring
            for module, core in zip(self._attention_modules, self._cores[phase]):
                module.core = core
        ms = (time.perf_counter() - t0) * 1e3
        self.active = phase
        collectives = [op for op in audit.ops if "gather" in op or "reduce" in op or "all_to_all" in op]
        if self.topology.world_size > 1:
            collectives.insert(0, "all_gather (phase agreement: one int64 per rank, gloo control group)")
        self.last_switch = SwitchReport(
            ms=ms, agree_ms=agree_ms, param_bytes_before=before, param_bytes_after=self.param_bytes(),
            allocated_bytes_delta=(torch.cuda.memory_allocated() - mem0) if cuda else audit.surviving_bytes(),
            weights_copied=self.weights_outside_storage() + sum(op.startswith("copy") for op in audit.ops),
            collectives=collectives, ops=audit.ops)
        return self.runtimes[phase]

    @contextmanager
    def phase(self, name: str):
        yield self.activate(name)

    # ---- accounting -----------------------------------------------------------------
    def param_bytes(self) -> int:
        """Bytes of distinct storage behind the model's current parameters."""
        seen = {}
        for p in self.model.parameters():
            st = p.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def weights_outside_storage(self) -> int:
        """Parameters whose data does not lie inside their resident tensor (0 after any switch)."""
        bad = 0
        for name, (module, attr) in self._param_slots.items():
            p = getattr(module, attr)
            r = self.storage.tensors[name]
            lo, hi = r.data_ptr(), r.data_ptr() + r.numel() * r.element_size()
            if p.numel() and not (lo <= p.data_ptr() < hi):
                bad += 1
        return bad


def _reduce_hook(module, args, output, *, group):
    return all_reduce_sum(output, group)


def _reduce_then_bias_hook(module, args, output, *, group):
    """A row-split linear's partial sum, summed, then its bias (left out of each rank's matmul)."""
    return all_reduce_sum(output, group) + module.bias


def _vocab_hook(module, args, output, *, group, order):
    return all_gather_ordered(output, -1, group, order)
