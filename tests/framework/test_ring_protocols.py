"""The mbarrier protocols of the Gluon Hopper kernels, modelled in Python and run over random interleavings.

Gluon cannot run on the CPU, so this checks the kernels' synchronization as written (the order of their
waits, arrivals, TMA copies and wgmma waits, and the CTA barriers Triton 3.6 emits around them, read in
their PTX) on a model of the hardware:
- an mbarrier completes a phase when its pending arrivals and its transaction bytes both reach 0;
  `wait(parity)` passes while the phase of that parity is the latest completed one (a fresh barrier's
  phase "-1" counts as completed, so waiting parity 1 on it passes at once);
- a TMA copy lands some time after it is issued and completes its box's full bytes (partly out of
  bounds too: Hopper counts the whole box);
- a wgmma group retires any time after it is issued, at the latest at `warpgroup_mma_wait(N)` of its
  own warpgroup (N newer groups may stay in flight);
- an `mbarrier.arrive` of a partition of several warpgroups is one arrival, after a CTA barrier
  (bar.sync) of the partition.
Each wait states which completion it means; the model fails where the parity lets it pass on another one
(parity aliasing), where a copy overwrites a stage a reader has not finished with, where an MMA reads a
stage before its bytes landed, where a copy is still in flight at exit, or where no actor can move
(deadlock). Broken variants of each protocol (no order barrier, no partition barrier, a wrong parity)
must fail, so the model can tell.
"""
import itertools
import random

import pytest


class ProtocolError(AssertionError):
    pass


class MBarrier:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.completed = count, count, 0, 0

    def arrive(self, tx=0):
        self.tx += tx
        self.pending -= 1
        if self.pending < 0:
            raise ProtocolError("more arrivals than the barrier's count in one phase")
        self._maybe_complete()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count


class Machine:
    """Stages of a shared ring (content per operand), MMA groups in flight per warpgroup, TMA copies in
    flight, CTA barriers, and a seeded random scheduler."""

    def __init__(self, seed, readers=()):
        self.rng = random.Random(seed)
        self.content = {}              # (stage, operand) -> step whose bytes landed (None: being written)
        self.in_flight = {}            # warpgroup -> [(stage, step)] oldest first
        self.copies = []               # (barrier, stage, operand, step, nbytes)
        self.readers = readers         # warps that read each stage through registers (the GEMV)
        self.last_read = {}            # (stage, warp) -> step
        self.filled = {}               # stage -> step of its last copy issued
        self.bars = {}                 # CTA barrier name -> (generation, arrived)
        self.moves = 0

    def tma(self, bar, stage, operand, step, nbytes):
        for group in self.in_flight.values():
            if any(s == stage for s, _ in group):
                raise ProtocolError(f"a copy into stage {stage} while an MMA still reads it")
        if self.filled.get(stage, step) != step:   # a new block (not another box of the same one)
            for warp in self.readers:
                if self.last_read.get((stage, warp)) != self.filled[stage]:
                    raise ProtocolError(f"a copy into slot {stage} before warp {warp} read step {self.filled[stage]}")
        self.filled[stage] = step
        self.content[(stage, operand)] = None
        self.copies.append((bar, stage, operand, step, nbytes))

    def land(self, index):
        bar, stage, operand, step, nbytes = self.copies.pop(index)
        self.content[(stage, operand)] = step
        bar.complete_tx(nbytes)

    def check_landed(self, stage, step, operands):
        for operand in operands:
            if self.content.get((stage, operand)) != step:
                raise ProtocolError(f"step {step} read stage {stage} holding {self.content.get((stage, operand))}")

    def run(self, actors):
        """actors: generators yielding ops; runs them in a random interleaving to the end."""
        actors = dict(enumerate(actors))
        blocked_on = {}
        while actors or self.copies:
            self.moves += 1
            moves = [("actor", a) for a in actors if self._ready(blocked_on.get(a))]
            moves += [("land", i) for i in range(len(self.copies))]
            moves += [("retire", wg) for wg, group in self.in_flight.items() if group]
            if not moves:
                raise ProtocolError(f"deadlock: {sorted(str(op[:3]) for op in blocked_on.values())}")
            kind, key = self.rng.choice(moves)
            if kind == "land":
                self.land(key)
            elif kind == "retire":
                self.in_flight[key].pop(0)
            else:
                op = blocked_on.pop(key, None)
                if op is not None:
                    self._pass(op)
                self._step(actors, key, blocked_on)
            if not actors and self.copies:
                raise ProtocolError("a TMA copy still in flight when the program ends")

    def _step(self, actors, key, blocked_on):
        while True:
            try:
                op = next(actors[key])
            except StopIteration:
                del actors[key]
                return
            if op[0] in ("wait", "bar"):
                if op[0] == "bar":
                    name, size = op[1], op[2]
                    gen, arrived = self.bars.get(name, (0, 0))
                    arrived += 1
                    self.bars[name] = (gen + 1, 0) if arrived == size else (gen, arrived)
                    op = ("bar", name, gen)
                blocked_on[key] = op
                return
            self._do(op)

    def _ready(self, op):
        if op is None:
            return True
        if op[0] == "wait":
            return (op[1].completed & 1) != op[2]
        return self.bars[op[1]][0] > op[2]

    def _pass(self, op):
        if op[0] == "wait" and op[1].completed != op[3] + 1:
            raise ProtocolError(f"parity aliasing: a wait for completion {op[3]} passed at {op[1].completed}")

    def _do(self, op):
        kind = op[0]
        if kind == "arrive":
            op[1].arrive()
        elif kind == "expect":
            op[1].arrive(tx=op[2])
        elif kind == "tma":
            self.tma(*op[1:])
        elif kind == "mma":
            _, wg, stage, step = op
            self.check_landed(stage, step, ("a", "b"))
            self.in_flight.setdefault(wg, []).append((stage, step))
        elif kind == "mma_wait":
            _, wg, keep = op
            group = self.in_flight.setdefault(wg, [])
            del group[:max(0, len(group) - keep)]
        elif kind == "read":
            _, stage, step, warp, parts = op
            self.check_landed(stage, step, range(parts))
            self.last_read[(stage, warp)] = step
        else:
            raise ValueError(kind)


# ------------------------------------------------------------- kernels.moe_grouped_gemm_gluon, specialized

A_BYTES, B_BYTES = 128 * 128, 256 * 128   # a full box each, out of bounds or not


def gemm_specialized(items, k_steps, stages, consumers, warpgroups, seed, order=True, partition_barrier=True,
                     producer_parity_flip=0):
    """`_grouped_gemm_fp8_kernel` for one program owning `items` work items: the producer warp, and
    `consumers` consumer partitions of `warpgroups` warpgroups each (1 x 2: DEFAULT_TILES; 2 x 1: ping-pong)."""
    m = Machine(seed)
    ready = [MBarrier(1) for _ in range(stages)]
    empty = [MBarrier(1) for _ in range(stages)]
    order_bars = [MBarrier(1), MBarrier(1)]

    def producer():
        it = 0
        for _ in range(items):
            for _ in range(k_steps):
                s = it % stages
                yield ("wait", empty[s], ((it // stages) & 1) ^ 1 ^ producer_parity_flip, it // stages - 1)
                yield ("expect", ready[s], A_BYTES + B_BYTES)
                yield ("tma", ready[s], s, "a", it, A_BYTES)
                yield ("tma", ready[s], s, "b", it, B_BYTES)
                it += 1

    def consumer(c, wg):
        name = f"consumer{c}"
        turn = 0
        for t in range(c, items, consumers):
            it = t * k_steps
            if consumers == 2 and order:
                # consumer 0's turn n follows consumer 1's (n-1)-th arrival, consumer 1's follows consumer 0's n-th
                yield ("wait", order_bars[c], (turn & 1) ^ (1 - c), turn - 1 if c == 0 else turn)
            for k in range(k_steps):
                s = it % stages
                yield ("wait", ready[s], (it // stages) & 1, it // stages)
                yield ("mma", (c, wg), s, it)
                yield ("mma_wait", (c, wg), 1)
                if partition_barrier:
                    yield ("bar", name, warpgroups)
                if wg == 0 and k > 0:
                    yield ("arrive", empty[(it + stages - 1) % stages])
                it += 1
            if consumers == 2:
                yield ("bar", name, warpgroups)
                if wg == 0 and order:
                    yield ("arrive", order_bars[1 - c])
                turn += 1
            yield ("mma_wait", (c, wg), 0)
            if partition_barrier:
                yield ("bar", name, warpgroups)
            if wg == 0:
                yield ("arrive", empty[(it + stages - 1) % stages])

    m.run([producer()] + [consumer(c, wg) for c in range(consumers) for wg in range(warpgroups)])


# ------------------------------------------------------------------ kernels.moe_grouped_gemm_gluon, simple

def gemm_simple(items, k_steps, stages, warpgroups, seed, partition_barrier=True):
    """`_grouped_gemm_fp8_simple_kernel`: one software pipeline, loads STAGES - 1 steps ahead, issued after
    the step before's MMA retired (wait(1)) in every warpgroup."""
    m = Machine(seed)
    ready = [MBarrier(1) for _ in range(stages)]
    steps = items * k_steps

    def load(wg, p):
        if partition_barrier:
            yield ("bar", "cta", warpgroups)
        if wg == 0:
            s = p % stages
            yield ("expect", ready[s], A_BYTES + B_BYTES)
            yield ("tma", ready[s], s, "a", p, A_BYTES)
            yield ("tma", ready[s], s, "b", p, B_BYTES)

    def warpgroup(wg):
        for p in range(stages - 1):
            if p < steps:
                yield from load(wg, p)
        for c in range(steps):
            s = c % stages
            yield ("wait", ready[s], (c // stages) & 1, c // stages)
            yield ("mma", wg, s, c)
            yield ("mma_wait", wg, 1)
            if c + stages - 1 < steps:
                yield from load(wg, c + stages - 1)
            if c % k_steps == k_steps - 1:
                yield ("mma_wait", wg, 0)

    m.run([warpgroup(wg) for wg in range(warpgroups)])


# ------------------------------------------------------------------------------ kernels.decode_gemv_tma

def gemv_ring(tiles, k_chunks, stages, warps, seed, cta_barrier=True):
    """`_gemv_tma_kernel` for one program: every warp waits for block i, reads it into registers, a CTA
    barrier, one thread re-arms the slot's barrier for block i + STAGES, a CTA barrier, then each warp's
    elected thread copies its share of the block's TMA boxes (as Triton 3.6 splits a [BLOCK_N, BLOCK_K]
    block wider than the 128-byte swizzle). cta_barrier False: the broken variant, no CTA barrier
    between the reads and the refill's copies."""
    m = Machine(seed, readers=range(warps))
    ready = [MBarrier(1) for _ in range(stages)]
    total = tiles * k_chunks
    box = 1024

    def refill(warp, slot, j, barrier=True):
        if warp == 0:
            yield ("expect", ready[slot], box * warps)
        if barrier:
            yield ("bar", "cta", warps)   # Triton's, with the proxy fence, between the re-arm and the copies
        yield ("tma", ready[slot], slot, warp, j, box)

    def warp_actor(warp):
        yield ("bar", "cta", warps)   # after the barriers' init
        for s in range(stages):
            if s < total:
                yield from refill(warp, s, s)
        for i in range(total):
            slot = i % stages
            yield ("wait", ready[slot], (i // stages) & 1, i // stages)
            yield ("read", slot, i, warp, warps)
            if cta_barrier:
                yield ("bar", "cta", warps)   # gl.thread_barrier(): every warp has read the slot
            if i + stages < total:
                yield from refill(warp, slot, i + stages, cta_barrier)

    m.run([warp_actor(w) for w in range(warps)])


# ------------------------------------------------------------------------------------------- tests

SEEDS = range(6)


@pytest.mark.parametrize("consumers,warpgroups", [(1, 2), (1, 1), (2, 1)])
def test_specialized_gemm_protocol_holds_over_odd_shapes(consumers, warpgroups):
    """Programs with no items, one, an odd count; K shorter than one stage's ring, and longer; 2..6 stages."""
    for items, k_steps, stages, seed in itertools.product((0, 1, 2, 5), (1, 2, 3, 7), (2, 3, 4, 6), SEEDS):
        gemm_specialized(items, k_steps, stages, consumers, warpgroups, seed)


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_simple_gemm_protocol_holds_over_odd_shapes(warpgroups):
    for items, k_steps, stages, seed in itertools.product((0, 1, 3), (1, 2, 5), (2, 3, 4), SEEDS):
        gemm_simple(items, k_steps, stages, warpgroups, seed)


def test_gemv_ring_protocol_holds_over_odd_shapes():
    for tiles, k_chunks, stages, warps, seed in itertools.product((1, 3), (1, 2, 5), (1, 2, 4), (1, 4), SEEDS):
        gemv_ring(tiles, k_chunks, stages, warps, seed)


def fails_somewhere(run, seeds=range(40)):
    for seed in seeds:
        try:
            run(seed)
        except ProtocolError:
            return True
    return False


def test_the_model_catches_broken_protocols():
    # ping-pong without its order barrier: the second consumer waits a whole item ahead in the ring
    assert fails_somewhere(lambda seed: gemm_specialized(6, 3, 4, 2, 1, seed, order=False))
    # two warpgroups releasing a stage after only one of them retired its MMA
    assert fails_somewhere(lambda seed: gemm_specialized(3, 4, 3, 1, 2, seed, partition_barrier=False))
    assert fails_somewhere(lambda seed: gemm_simple(3, 4, 3, 2, seed, partition_barrier=False))
    # the producer's first wait on a fresh "empty" barrier at parity 0 never passes
    assert fails_somewhere(lambda seed: gemm_specialized(2, 2, 2, 1, 2, seed, producer_parity_flip=1), range(2))
    # a GEMV slot refilled while another warp still reads it
    assert fails_somewhere(lambda seed: gemv_ring(2, 3, 2, 4, seed, cta_barrier=False))
