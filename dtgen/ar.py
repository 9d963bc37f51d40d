"""The AR decode loop, model-free: one token a step until a stop, the host reading each token one step late.

A model gives the step (feed one token at the next slot, get the step's logits and the token
sampled from them, still on the device: `step(i, fed) -> (logits, token)`); the loop here
decides what is fed (the sampled token, or a forced one replayed), when the decode ends
(`DecodeRule`) and when the host reads a token (`TokenReader`). `TokenDecode` runs one
request; `BatchDecode` runs several as rows of one batched step, each ending on its own.
Neither knows a model, a cache or a process group: every rank runs the same loop on the
same tokens, which the model's step makes identical across ranks.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm


class TokenReader:
    """Sampled token ids to the host, one step late, without stalling the device.

    `push(t)` queues a copy of the 0-d device tensor `t` into pinned memory behind the work
    that makes it; `pop()` returns the oldest queued id, waiting (on CUDA, for an event) only
    until that copy is done, not for work launched after the push. On the CPU both are plain.
    """

    def __init__(self, device: torch.device, slots: int = 4):
        self.cuda = device.type == "cuda"
        self.buffer = torch.empty(slots, dtype=torch.int64, pin_memory=self.cuda)
        self.pending: deque = deque()
        self.count = 0

    def push(self, token: torch.Tensor) -> None:
        if not self.cuda:
            self.pending.append(int(token))
            return
        slot = self.count % self.buffer.shape[0]
        self.count += 1
        self.buffer[slot:slot + 1].copy_(token.view(1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending.append((slot, done))

    def pop(self) -> int:
        item = self.pending.popleft()
        if not self.cuda:
            return item
        slot, done = item
        done.synchronize()
        return int(self.buffer[slot])


@dataclass(frozen=True)
class DecodeRule:
    """What one request's decode feeds and when it ends: at most `steps` tokens, or at the
    first token in `stops` (unless `ignore_stop`: fixed-length benchmarks). `forced`: feed
    these tokens instead of the sampled ones (a replay), `steps` of them."""

    steps: int
    stops: Collection[int]
    forced: tuple[int, ...] | None = None
    ignore_stop: bool = False


# step(i, fed [1, 1]) -> (logits, next token 0-d): decode step i of one request.
Step = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class TokenDecode:
    """One request's decode loop. Made before the loop's clock starts: it queues the prefill's
    token (`first`, 0-d on the device) to the host at once; `run` then decodes."""

    def __init__(self, first: torch.Tensor, rule: DecodeRule, device: torch.device):
        self.rule = rule
        self.next_token = first
        self.forced_ids = torch.tensor(rule.forced or [0], device=device) if rule.forced is not None else None
        self.reader = TokenReader(device)
        if rule.forced is None:
            self.reader.push(first)

    def run(self, step: Step, on_token: Callable[[int, torch.Tensor], None], show: bool = True,
            desc: str = "AR") -> list[int]:
        """The kept tokens; `on_token(i, logits)` after token i is kept (its step's logits).

        Token i is fed before the host has read it: the step is launched first, and only then
        does the host wait for token i (made by the previous step), so the next step's host
        work overlaps this step's device time. If token i is a stop, the step is dropped: the
        caller's next feed (its image head) rewrites that cache slot."""
        rule, forced = self.rule, self.rule.forced is not None
        next_token, generated = self.next_token, []
        for i in tqdm(range(rule.steps), desc=desc, disable=not show, leave=False):
            fed = self.forced_ids[i].view(1, 1) if forced else next_token.view(1, 1)
            logits, next_token = step(i, fed)
            token = rule.forced[i] if forced else self.reader.pop()
            if not forced:
                self.reader.push(next_token)
            if token in rule.stops and not rule.ignore_stop:
                break
            generated.append(token)
            on_token(i, logits)
        return generated


class BatchDecode:
    """Several requests' decode loops as rows of one batched step, each ending on its own rule.

    `step(fed, live) -> (logits [B, V], tokens [B])` advances every row one token (row b fed
    fed[b] at `positions[b]`); a row not `live` is fed `filler` and what it makes is never
    read (it rewrites one slot that the caller's next feed overwrites). The tokens come to
    the host every step: rows end at different steps, and the next feed depends on who did.
    """

    def __init__(self, first: list[int], rules: list[DecodeRule], starts: list[int], filler: int):
        n = len(rules)
        self.rules, self.filler = rules, filler
        self.current = list(first)                      # each row's next token to feed
        self.positions = list(starts)                   # each row's next slot (the step reads it)
        self.active = [r.steps > 0 for r in rules]      # rows still decoding
        self.generated: list[list[int]] = [[] for _ in range(n)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(n)]   # per kept token, its step's
        self.ended_s = [0.0] * n                        # `elapsed()` when each row ended

    def leave(self, rows) -> None:
        """Rows that sit out the remaining steps (they left the batch)."""
        for b in rows:
            self.active[b] = False

    def run(self, step: Callable, boundary: Callable[[int, list[int]], list[int]],
            elapsed: Callable[[], float]) -> int:
        """Decode until every row has ended; returns the steps run. After step i,
        `boundary(i, rows)` with the rows that kept a token there; the rows it returns leave."""
        rules, n, i = self.rules, len(self.rules), 0
        while any(self.active):
            fed = [(rules[b].forced[i] if rules[b].forced is not None else self.current[b]) if self.active[b]
                   else self.filler for b in range(n)]
            logits, tokens = step(fed, self.active)
            tokens = tokens.tolist()
            reported = []
            for b in range(n):
                if not self.active[b]:
                    continue
                if fed[b] in rules[b].stops and not rules[b].ignore_stop:
                    self.active[b] = False          # dropped: its slot is the caller's next feed's
                    self.ended_s[b] = elapsed()
                    continue
                self.generated[b].append(fed[b])
                self.logits[b].append(logits[b])
                self.current[b] = tokens[b]
                self.positions[b] += 1
                self.active[b] = len(self.generated[b]) < rules[b].steps
                reported.append(b)
                if not self.active[b]:
                    self.ended_s[b] = elapsed()
            i += 1
            self.leave(boundary(i, reported))
        return i
