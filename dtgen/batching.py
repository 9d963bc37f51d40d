"""Requests that share steps: which members of a batch are still in it, and why the others left.

A pipeline that runs several requests as rows of one batch (HunyuanImage-3's denoise steps)
reports every step boundary once for the whole batch, through a `BatchHook`:

    hook(phase, done, total, members) -> {member: exception}

`members` are the batch indices of the requests at that step (every active one in a shared
denoise step; one request during its own AR phase); the answer names the requests that
leave the batch now, each with why (its cancel, its deadline, its own error at that step,
a peer rank's error), and may name any active member, not only those at the step: a
request cancelled while another one's AR runs leaves at once. The members that stay go on
as if the others had never been there (their rows are dropped at that boundary).

`per_member(progresses)` makes a hook from one `progress(phase, done, total)` per request
(raising to stop, the single-request contract); a server's engine gives one that agrees on
one flag per request across ranks (`dtgen.serve.engine.BatchStepProgress`).
`BatchMembers` keeps a batch's state on one rank. Nothing here knows about ranks.
"""
from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int, int], None]
BatchHook = Callable[[str, int, int, list[int]], dict[int, BaseException]]


def per_member(progresses: list[Progress]) -> BatchHook:
    """A hook calling each member's own progress at its steps; one that raises leaves."""

    def hook(phase: str, done: int, total: int, members: list[int]) -> dict[int, BaseException]:
        left = {}
        for m in members:
            try:
                progresses[m](phase, done, total)
            except Exception as e:
                left[m] = e
        return left

    return hook


class MemberLeft(Exception):
    """Raised inside one member's own phase (its AR) when it left the batch at a boundary."""

    def __init__(self, member: int):
        super().__init__(f"batch member {member} left")
        self.member = member


class BatchMembers:
    """Which members of a batch of `size` requests are still in it (`active`, in batch order)
    and why each other one left (`left[m]`: the exception that ends it)."""

    def __init__(self, size: int, hook: BatchHook):
        if size < 1:
            raise ValueError(f"a batch needs at least one request, got {size}")
        self.hook = hook
        self.active: list[int] = list(range(size))
        self.left: dict[int, BaseException] = {}

    def boundary(self, phase: str, done: int, total: int, members: list[int]) -> list[int]:
        """A step boundary of `members`; returns the members that left now (any active one)."""
        gone = []
        for m, why in self.hook(phase, done, total, list(members)).items():
            if m in self.active:
                self.active.remove(m)
                self.left[m] = why
                gone.append(m)
        return gone

    def fail(self, member: int, why: BaseException) -> None:
        """A member fails alone outside any step (a check every rank makes the same way)."""
        if member in self.active:
            self.active.remove(member)
            self.left[member] = why

    def progress_of(self, member: int) -> Progress:
        """The single-request progress of one member's own phase: raises `MemberLeft` once it left."""

        def progress(phase: str, done: int, total: int) -> None:
            self.boundary(phase, done, total, [member])
            if member not in self.active:
                raise MemberLeft(member)

        return progress
