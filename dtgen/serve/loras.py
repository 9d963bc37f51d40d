"""LoRA adapters on a running server: loaded, listed and unloaded by name on every rank
(`POST /v1/loras`, `GET /v1/loras`, `DELETE /v1/loras/{name}`: routes/loras.py), and which of
them the queued and running requests hold.

- Every rank holds the same resident set (the pipeline's `dtgen.lora.ResidentLoras`). A load or
  an unload is a command the engine runs between jobs on every rank (`run_lora_command`): each
  rank tries it, every rank's outcome is gathered over the control group, and it takes effect
  only where all succeeded: a load that failed on any rank is undone on the ranks where it
  succeeded, and the adapter it would have evicted stays. So the ranks never disagree on what
  a request's `loras` name.
- Rank 0 keeps the book (`ServedLoras`): each adapter's file, what it targets, its bytes, when a
  request last named it, and how many queued or running jobs hold it. At most `max_loras` are
  resident: a load past that evicts the least recently used adapter no job holds, or is refused
  (409 naming --max-loras) when every one is held. The server's --lora adapters are resident from
  the start under their file names, held by the defaults (the request a request's missing fields
  come from), so neither evicted nor deleted.
"""
from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass

from dtgen.lora import LoraError
from dtgen.requests import RequestError

# The module a load targets by default; another name is a second denoiser of the same class
# (Wan2.2-A14B's low-noise expert "transformer_2", diffusers' `load_into_transformer_2`).
DEFAULT_TARGET = "transformer"


class LoraRefused(Exception):
    """A LoRA route's refusal: its HTTP status, one line, and the body key or name it is about."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def target_prefixes(loras) -> dict[str, dict[str, str] | None]:
    """The modules an adapter may be loaded into (`expert` of POST /v1/loras) -> the name map
    its file is read with (None: the model's own). Besides the model's denoiser, every other
    built child module of the same class (the name map's first component swapped)."""
    prefixes = loras.prefixes
    model = loras.built.model
    base = next(iter(prefixes.values())).split(".", 1)[0]
    if not base:   # the model is its own denoiser (HunyuanImage-3's keys carry no component)
        return {DEFAULT_TARGET: None}
    targets: dict[str, dict[str, str] | None] = {base: None}
    own = getattr(model, base, None)
    for name, child in model.named_children():
        if name != base and child is not None and own is not None and type(child) is type(own):
            targets[name] = {k: name + v[len(base):] for k, v in prefixes.items()}
    return targets


def describe(adapter) -> dict:
    """What GET /v1/loras shows of a resident adapter (`dtgen.lora.resident.ResidentAdapter`,
    this rank's): its ranks, how many modules it targets and their names with block indices
    folded (`transformer_blocks.*.attn.to_q`), and this rank's bytes."""
    ranks, kinds = set(), set()
    for module, layer in adapter.layers.items():
        a, _ = next(iter(layer.views.values()))
        ranks.add(int(a.shape[0]))
        kinds.add(re.sub(r"\.\d+\.", ".*.", module))
    return {"ranks": sorted(ranks), "targets": len(adapter.layers), "modules": sorted(kinds),
            "resident_bytes": adapter.nbytes}


def _line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:500]
    return text if isinstance(e, (LoraError, OSError)) else f"{type(e).__name__}: {text}"


def run_lora_command(link, loras, command: dict) -> dict:
    """One LoRA command on this rank, in step with every other (the engine runs it between jobs):
    {"op": "load", "name", "path", "target", "evict"} or {"op": "unload", "name"}. Every rank's
    outcome is gathered (`link.gather`); the command takes effect only if all succeeded.
    Returns {"ok": True, "adapter": describe(...) (a load)} or {"ok": False, "status", "message"}
    (422: the file, from the first rank that refused it; 500: anything else)."""
    op, name = command["op"], command["name"]
    mine: dict = {"ok": True}
    try:
        if loras is None:
            raise LoraError("this server's model takes no LoRA adapters")
        if op == "load":
            prefixes = target_prefixes(loras).get(command.get("target") or DEFAULT_TARGET)
            mine["adapter"] = describe(loras.load(name, command["path"], prefixes=prefixes))
        elif op == "unload":
            if name not in loras.adapters:
                raise LoraError(f"LoRA {name!r} is not loaded on this rank")
        else:
            raise ValueError(f"unknown LoRA command {op!r}")
    except Exception as e:   # this rank's refusal; every rank hears of it below
        mine = {"ok": False, "status": 422 if isinstance(e, (LoraError, OSError)) else 500, "message": _line(e)}
    everyone = link.gather(mine)
    failed = [(rank, o) for rank, o in enumerate(everyone) if not o["ok"]]
    if failed:
        if op == "load" and mine["ok"]:
            loras.unload(name)    # loaded here, refused elsewhere: as it was
        rank, first = failed[0]
        return {"ok": False, "status": first["status"],
                "message": first["message"] if rank == 0 else f"rank {rank}: {first['message']}"}
    if op == "load" and command.get("evict"):
        loras.unload(command["evict"])
    elif op == "unload":
        loras.unload(name)
    return {"ok": True, **({"adapter": mine["adapter"]} if op == "load" else {})}


@dataclass
class Entry:
    """Rank 0's book of one resident adapter."""

    name: str
    path: str
    target: str
    adapter: dict                  # `describe`'s
    loaded_at: float               # time.time()
    last_used: float | None = None  # when a request last named it (time.time()), or never
    pinned: bool = False           # a --lora adapter: the defaults hold it

    def as_dict(self, holds: int) -> dict:
        return {"name": self.name, "path": self.path, "expert": self.target, **self.adapter,
                "loaded_at": round(self.loaded_at, 3),
                "last_used": None if self.last_used is None else round(self.last_used, 3),
                "in_use": holds, "pinned": self.pinned}


class ServedLoras:
    """Rank 0's book of the resident adapters (thread-safe: the event loop holds and loads, the
    engine thread releases a job's hold when it ends). `targets`: what a load may go into
    (`target_prefixes`' names)."""

    def __init__(self, max_loras: int, targets: tuple[str, ...] = (DEFAULT_TARGET,)):
        if not isinstance(max_loras, int) or max_loras < 1:
            raise ValueError(f"--max-loras must be an integer >= 1, got {max_loras!r}")
        self.max_loras, self.targets = max_loras, targets
        self.entries: dict[str, Entry] = {}
        self.holds: Counter = Counter()
        self._busy: dict[str, str] = {}   # name -> "loading", "evicting" or "unloading" (a command on its way)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, adapter, max_loras: int) -> "ServedLoras | None":
        """The book of a serve adapter's resident set (its `loras`), None where its model takes
        none; the adapters resident already (the server's --lora) are pinned by its defaults."""
        loras = getattr(adapter, "loras", None)
        if loras is None:
            return None
        book = cls(max_loras, tuple(target_prefixes(loras)))
        now = time.time()
        for name, resident in loras.adapters.items():
            book.entries[name] = Entry(name, resident.path, DEFAULT_TARGET, describe(resident), now, pinned=True)
        if len(book.entries) > max_loras:
            raise ValueError(f"--max-loras {max_loras}: the server starts with {len(book.entries)} --lora adapters")
        return book

    def listing(self) -> list[dict]:
        with self._lock:
            return [e.as_dict(self.holds[e.name]) for e in sorted(self.entries.values(), key=lambda e: e.name)]

    # ---- requests ----------------------------------------------------------------------
    def hold(self, adapters, field: str = "loras") -> tuple[str, ...]:
        """A queued request's adapters held until its job ends (`release`); a RequestError naming
        `loras[i].name` for one that is not resident (or on its way out)."""
        with self._lock:
            for i, (name, weight) in enumerate(adapters):
                if name not in self.entries or name in self._busy:
                    loaded = sorted(n for n in self.entries if n not in self._busy)
                    raise RequestError(f"{field}[{i}].name", f"LoRA {name!r} is not loaded (POST /v1/loras loads "
                                                             f"it); loaded: {loaded}")
                if not math.isfinite(weight):
                    raise RequestError(f"{field}[{i}].weight", f"must be a finite number, got {weight!r}")
            names = tuple(name for name, _ in adapters)
            now = time.time()
            for name in names:
                self.holds[name] += 1
                self.entries[name].last_used = now
            return names

    def release(self, names: tuple[str, ...]) -> None:
        with self._lock:
            for name in names:
                self.holds[name] -= 1
                if self.holds[name] <= 0:
                    del self.holds[name]

    # ---- loading and unloading (a command on every rank between two steps) ---------------
    def begin_load(self, name: str, path: str, target: str) -> str | None:
        """Reserve `name` for a load; the adapter to evict with it (least recently used, held by
        no job), or None. `LoraRefused`: 409 for a name in use or a full set all held, 422 for
        an unknown target."""
        with self._lock:
            if target not in self.targets:
                raise LoraRefused(422, f"must be one of {list(self.targets)} (the modules an adapter can go into), "
                                       f"got {target!r}", "expert")
            if name in self.entries or name in self._busy:
                raise LoraRefused(409, f"LoRA {name!r} is already loaded (DELETE /v1/loras/{name} first)", "name")
            resident = [e for e in self.entries.values() if e.name not in self._busy]
            loading = sum(1 for state in self._busy.values() if state == "loading")
            victim = None
            if len(resident) + loading >= self.max_loras:
                free = [e for e in resident if not self.holds[e.name] and not e.pinned]
                if not free:
                    raise LoraRefused(409, f"--max-loras {self.max_loras}: every resident adapter is held by a "
                                           "queued or running request or by the server's --lora; retry once "
                                           "they finish, or DELETE one", "name")
                victim = min(free, key=lambda e: (e.last_used or e.loaded_at, e.loaded_at)).name
                self._busy[victim] = "evicting"
            self._busy[name] = "loading"
            return victim

    def end_load(self, name: str, path: str, target: str, victim: str | None, answer: dict) -> None:
        """The load's outcome on every rank: its entry (and the victim gone), or as it was."""
        with self._lock:
            self._busy.pop(name, None)
            if victim is not None:
                self._busy.pop(victim, None)
            if answer["ok"]:
                if victim is not None:
                    self.entries.pop(victim, None)
                self.entries[name] = Entry(name, path, target, answer["adapter"], time.time())

    def begin_unload(self, name: str) -> None:
        """`LoraRefused`: 404 for a name not resident, 409 for one a job or the defaults hold."""
        with self._lock:
            if name not in self.entries or self._busy.get(name) in ("evicting", "unloading"):
                raise LoraRefused(404, f"LoRA {name!r} is not loaded; loaded: {sorted(self.entries)}", "name")
            if name in self._busy:
                raise LoraRefused(409, f"LoRA {name!r} is still loading", "name")
            if self.entries[name].pinned:
                raise LoraRefused(409, f"LoRA {name!r} is the server's --lora adapter: every request that gives no "
                                       "loras carries it", "name")
            if self.holds[name]:
                raise LoraRefused(409, f"LoRA {name!r} is held by {self.holds[name]} queued or running request(s); "
                                       "retry once they finish", "name")
            self._busy[name] = "unloading"

    def end_unload(self, name: str, answer: dict) -> None:
        with self._lock:
            self._busy.pop(name, None)
            if answer["ok"]:
                self.entries.pop(name, None)
