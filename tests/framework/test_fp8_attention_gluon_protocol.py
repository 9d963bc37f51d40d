"""kernels.fp8_attention_gluon's barrier protocol, modelled on the CPU: every ring slot, barrier phase
and wgmma group of `_producer` and `_consumer`, run in random interleavings at odd shapes.

The partitions are generators of operations that mirror `_producer` and `_consumer` line by line (a
change to the kernel's waits, arrivals or MMA waits must be made here too); a scheduler runs them in
random orders, with TMA completions and wgmma retirements as asynchronous events at random times.
A run fails on:
- a deadlock (nothing can run, work left);
- a parity alias: a wait that passes before the phase it needs has completed, or that blocks after
  the barrier has gone a phase past it (the hardware would wait a whole extra phase, or forever);
- a TMA write into a ring slot that an unretired wgmma still reads, or an MMA that reads a slot not
  holding the block it expects (at issue and at retirement);
- a break of the ping-pong order (the two warpgroups' MMA turns strictly alternating).
Hardware facts it encodes: an mbarrier phase completes when its pending arrivals and its tx count
reach zero; `try_wait.parity(P)` returns once the current phase's parity differs from P (a fresh
barrier's "phase -1" counts as complete); `arrive.expect_tx` is one arrival that adds its bytes
first; a warpgroup's release is one arrival (the PTX Triton 3.6 emits for `mbarrier.arrive` in a
4-warp partition: a bar.sync of its 128 threads, then one arrive predicated on its thread 0);
`wgmma.wait_group(N)` returns once every group but the N newest has retired.
The model is checked against broken variants of the protocol, each of which it must catch.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest


class ProtocolError(Exception):
    pass


@dataclass
class Barrier:
    name: str
    count: int
    pending: int = 0
    tx: int = 0
    completed: int = 0           # phases completed so far

    def __post_init__(self):
        self.pending = self.count

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def arrive(self, tx_bytes=0):
        if self.pending <= 0:
            raise ProtocolError(f"{self.name}: arrival beyond its count")
        self.tx += tx_bytes
        self.pending -= 1
        self._maybe_complete()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        if self.tx < 0:
            raise ProtocolError(f"{self.name}: more TMA bytes than expected")
        self._maybe_complete()

    def passes(self, parity):
        return (self.completed & 1) != parity


@dataclass
class Group:                       # one committed wgmma group
    reads: list                    # (slot key, block) pairs
    retired: bool = False


@dataclass
class State:
    bars: dict = field(default_factory=dict)
    slots: dict = field(default_factory=dict)       # slot key -> block held, or ("writing", block)
    groups: dict = field(default_factory=dict)      # warpgroup -> [Group]
    tma: list = field(default_factory=list)         # in-flight copies: (slot key, block, barrier, bytes)
    turn_log: list = field(default_factory=list)
    turn_holder: object = None


def producer(n_blocks, num_stages, consumers, q_bytes=1, k_bytes=2, v_bytes=2):
    """`_producer`."""
    for w in range(consumers):
        yield ("expect", f"q{w}", q_bytes)
        yield ("tma", ("q", w), 0, f"q{w}", q_bytes)
    for j in range(n_blocks):
        stage = j % num_stages
        empty_phase = ((j // num_stages) & 1) ^ 1
        needed = j // num_stages - 1           # the phase of the slot's release of block j - NUM_STAGES
        yield ("wait", f"k_empty{stage}", empty_phase, needed)
        yield ("expect", f"k_ready{stage}", k_bytes)
        yield ("tma", ("k", stage), j, f"k_ready{stage}", k_bytes)
        yield ("wait", f"v_empty{stage}", empty_phase, needed)
        yield ("expect", f"v_ready{stage}", v_bytes)
        yield ("tma", ("v", stage), j, f"v_ready{stage}", v_bytes)


def _take_turn(wg, t, pingpong):
    if pingpong:
        # warpgroup 0's t-th turn needs warpgroup 1's turn t - 1 passed (phase t - 1 of turns0);
        # warpgroup 1's needs warpgroup 0's turn t (phase t of turns1)
        yield ("wait", f"turns{wg}", (t + 1 - wg) & 1, t - 1 if wg == 0 else t)
        yield ("turn_begin", wg, t)


def _pass_turn(wg, pingpong):
    if pingpong:
        yield ("turn_end", wg)
        yield ("arrive", f"turns{1 - wg}")


def consumer(wg, n_blocks, num_stages, pingpong):
    """`_consumer`."""
    yield ("wait", f"q{wg}", 0, 0)
    yield ("wait", "k_ready0", 0, 0)
    yield from _take_turn(wg, 0, pingpong)
    yield ("mma", wg, [(("q", wg), 0), (("k", 0), 0)])
    yield from _pass_turn(wg, pingpong)
    yield ("mma_wait", wg, 0)
    yield ("arrive", "k_empty0")
    for j in range(1, n_blocks):
        stage, prev = j % num_stages, (j - 1) % num_stages
        yield ("wait", f"k_ready{stage}", (j // num_stages) & 1, j // num_stages)
        yield from _take_turn(wg, j, pingpong)
        yield ("mma", wg, [(("q", wg), 0), (("k", stage), j)])
        yield ("wait", f"v_ready{prev}", ((j - 1) // num_stages) & 1, (j - 1) // num_stages)
        yield ("mma", wg, [(("v", prev), j - 1)])
        yield from _pass_turn(wg, pingpong)
        yield ("mma_wait", wg, 1)
        yield ("arrive", f"k_empty{stage}")
        yield ("mma_wait", wg, 0)
        yield ("arrive", f"v_empty{prev}")
    last = (n_blocks - 1) % num_stages
    yield ("wait", f"v_ready{last}", ((n_blocks - 1) // num_stages) & 1, (n_blocks - 1) // num_stages)
    yield from _take_turn(wg, n_blocks, pingpong)
    yield ("mma", wg, [(("v", last), n_blocks - 1)])
    yield from _pass_turn(wg, pingpong)
    yield ("mma_wait", wg, 0)
    yield ("arrive", f"v_empty{last}")


def make_barriers(num_stages, consumers):
    """The kernel's mbarrier.init counts."""
    bars = [Barrier(f"q{w}", 1) for w in range(consumers)]
    for i in range(num_stages):
        bars += [Barrier(f"k_ready{i}", 1), Barrier(f"v_ready{i}", 1),
                 Barrier(f"k_empty{i}", consumers), Barrier(f"v_empty{i}", consumers)]
    bars += [Barrier(f"turns{w}", 1) for w in range(2)]
    return {b.name: b for b in bars}


def _check_reads(st, reads, when):
    for key, block in reads:
        if st.slots.get(key) != block:
            raise ProtocolError(f"wgmma {when}: slot {key} holds {st.slots.get(key)}, not block {block}")


def _ready(st, op):
    kind = op[0]
    if kind == "wait":
        _, name, parity, needed = op
        bar = st.bars[name]
        if bar.passes(parity):
            if bar.completed < needed + 1:
                raise ProtocolError(f"{name}: wait(parity {parity}) passes before phase {needed} completed "
                                    f"({bar.completed} phases done)")
            return True
        if bar.completed >= needed + 1:
            raise ProtocolError(f"{name}: wait(parity {parity}) blocks though phase {needed} completed "
                                f"({bar.completed} phases done: aliased)")
        return False
    if kind == "mma_wait":
        _, wg, n = op
        live = st.groups.get(wg, [])
        return all(g.retired for g in live[:max(len(live) - n, 0)])
    return True


def _execute(st, op):
    kind = op[0]
    if kind == "expect":
        st.bars[op[1]].arrive(tx_bytes=op[2])
    elif kind == "arrive":
        st.bars[op[1]].arrive()
    elif kind == "tma":
        _, key, block, bar, nbytes = op
        for gs in st.groups.values():
            for g in gs:
                if not g.retired and any(k == key for k, _ in g.reads):
                    raise ProtocolError(f"TMA of block {block} into {key} while a wgmma still reads it")
        st.slots[key] = ("writing", block)
        st.tma.append((key, block, bar, nbytes))
    elif kind == "mma":
        _, wg, reads = op
        _check_reads(st, reads, "issue")
        if st.turn_holder is not None and st.turn_holder != wg:
            raise ProtocolError(f"warpgroup {wg} issues during warpgroup {st.turn_holder}'s turn")
        st.groups.setdefault(wg, []).append(Group(reads))
    elif kind == "turn_begin":
        if st.turn_holder is not None:
            raise ProtocolError(f"warpgroup {op[1]} takes a turn held by {st.turn_holder}")
        st.turn_holder = op[1]
        st.turn_log.append((op[1], op[2]))
    elif kind == "turn_end":
        st.turn_holder = None


def run_interleaving(n_blocks, num_stages=3, consumers=2, pingpong=True, seed=0, producer_fn=producer,
        consumer_fn=consumer, barriers_fn=make_barriers):
    """One random interleaving to the end -> the turn log; raises ProtocolError on a hazard."""
    rng = random.Random(seed)
    st = State(bars=barriers_fn(num_stages, consumers))
    procs = {"producer": producer_fn(n_blocks, num_stages, consumers)}
    for wg in range(consumers):
        procs[f"wg{wg}"] = consumer_fn(wg, n_blocks, num_stages, pingpong and consumers == 2)
    head = {name: next(p) for name, p in procs.items()}
    while head:
        choices = [("proc", name) for name, op in head.items() if _ready(st, op)]
        choices += [("tma", i) for i in range(len(st.tma))]
        choices += [("retire", wg, i) for wg, gs in st.groups.items() for i, g in enumerate(gs) if not g.retired]
        if not choices:
            raise ProtocolError(f"deadlock: blocked at {head}")
        pick = rng.choice(choices)
        if pick[0] == "proc":
            name = pick[1]
            _execute(st, head[name])
            try:
                head[name] = next(procs[name])
            except StopIteration:
                del head[name]
        elif pick[0] == "tma":
            key, block, bar, nbytes = st.tma.pop(pick[1])
            st.slots[key] = block
            st.bars[bar].complete_tx(nbytes)
        else:
            g = st.groups[pick[1]][pick[2]]
            _check_reads(st, g.reads, "retirement")
            g.retired = True
    if st.tma or any(not g.retired for gs in st.groups.values() for g in gs):
        # work left in flight at exit: a TMA nobody waited for, or an MMA nobody waited on
        raise ProtocolError("asynchronous work still in flight when every partition has exited")
    expected = [(wg, t) for t in range(n_blocks + 1) for wg in range(2)] if pingpong and consumers == 2 else []
    if st.turn_log != expected:
        raise ProtocolError(f"turn order {st.turn_log[:8]}... is not strict alternation")
    return st.turn_log


# ------------------------------------------------------------------------------ the kernel's protocol


@pytest.mark.parametrize("consumers,pingpong", [(2, True), (2, False), (1, False)])
def test_protocol_has_no_deadlock_alias_or_overwrite_at_odd_shapes(consumers, pingpong):
    """One key block (fewer blocks than stages), a few, and many (the ring wraps several times, each
    barrier runs through both parities more than once), for every ring depth the tiles take."""
    for n_blocks, num_stages in itertools.product((1, 2, 3, 4, 5, 7, 11), (2, 3, 4)):
        for seed in range(8):
            run_interleaving(n_blocks, num_stages, consumers, pingpong, seed=seed)


# ------------------------------------------------------------------------------ broken protocols it catches


def _producer_empty_parity_without_flip(n_blocks, num_stages, consumers):
    for op in producer(n_blocks, num_stages, consumers):
        yield op[:2] + (op[2] ^ 1, op[3]) if op[0] == "wait" and "empty" in op[1] else op


def _consumer_turn_parity_flipped(wg, n_blocks, num_stages, pingpong):
    for op in consumer(wg, n_blocks, num_stages, pingpong):
        yield op[:2] + (op[2] ^ 1, op[3]) if op[0] == "wait" and op[1].startswith("turns") else op


def _consumer_v_released_at_issue(wg, n_blocks, num_stages, pingpong):
    """V's slot released right after its P V is issued, before any wgmma wait."""
    ops = list(consumer(wg, n_blocks, num_stages, pingpong))
    for i, op in enumerate(ops):
        if op[0] == "arrive" and op[1].startswith("v_empty"):
            ops.pop(i)
            ops.insert(max(k for k in range(i) if ops[k][0] == "mma") + 1, op)
    yield from ops


def _consumer_no_final_wait(wg, n_blocks, num_stages, pingpong):
    """The last P V's wgmma never waited on."""
    ops = list(consumer(wg, n_blocks, num_stages, pingpong))
    del ops[len(ops) - 1 - ops[::-1].index(("mma_wait", wg, 0))]
    yield from ops


def _barriers_empty_count_one(num_stages, consumers):
    bars = make_barriers(num_stages, consumers)
    for i in range(num_stages):
        bars[f"k_empty{i}"] = Barrier(f"k_empty{i}", 1)
    return bars


@pytest.mark.parametrize("broken", [
    dict(producer_fn=_producer_empty_parity_without_flip),
    dict(consumer_fn=_consumer_turn_parity_flipped),
    dict(consumer_fn=_consumer_v_released_at_issue),
    dict(consumer_fn=_consumer_no_final_wait),
    dict(barriers_fn=_barriers_empty_count_one),
], ids=["empty-parity", "turn-parity", "v-release-at-issue", "no-final-wait", "empty-count-1"])
def test_the_model_catches_a_broken_protocol(broken):
    caught = 0
    for n_blocks, seed in itertools.product((1, 2, 3, 4, 7), range(12)):
        try:
            run_interleaving(n_blocks, 2, 2, True, seed=seed, **broken)
        except ProtocolError:
            caught += 1
    assert caught > 0
