"""The Gluon FP8 attention kernel's clock trace, one Hopper GPU: where each consumer warpgroup waits in a
key block, and whether one warpgroup's softmax overlaps the other's MMAs.

    python -m bench kernels fp8-attention-trace [--out F] [--programs 8] [--iters 16] [--repeats 5]

The operands are bench.bench_fp8_attention's (its --kernels-only rows): Wan 1.3B's self-attention
(12 heads, 32760 queries and keys, head_dim 128), random bf16 Q, K + 1, V (seed 0) through
`quantize_qkv`. For ping-pong on, off, and with half of P's exp2 on the FMA units (poly_exp2=2),
the kernel runs untraced and traced (timed: CUDA events,
median of --repeats after a warm-up: the stamps cost each warp about 56 instructions a key block, some
10% of the loop's issue slots; the traced output is compared with the untraced one bit for bit), and
the last traced run's `%clock64` stamps (kernels/fp8_attention_gluon.py, TRACE_POINTS) are read for
the first --programs programs (pid0 * programs_y + pid1) and the first --iters key blocks. Stamps
are warp 0's of each warpgroup, from the SM's clock (one clock for the program's warpgroups).

Printed per variant, in SM clock cycles, medians over the traced programs and key blocks 2 .. iters-1:
- k_wait: the top of the block to its K tile landing (the producer's TMA behind; a barrier of the
  warpgroup's 4 warps comes before the wait in the compiled code, untraced too);
- turn_wait: K there, to this warpgroup's MMA turn (ping-pong: the other is issuing);
- issue: the turn held, to both MMAs (Q K^T of this block, P V of the previous) issued and the turn
  passed (a barrier of the warpgroup's 4 warps, then an arrive), the wait on the V tile included
  (`qk_issue`, `v_wait`, `pv_issue` in the JSON);
- qk_wait: to `warpgroup_mma_wait(1)` returning (the logits ready; P V may still run);
- softmax: the K slot released (`k_release`: a barrier of the warpgroup's 4 warps, then an arrive) and
  the online softmax of the logits (`softmax_math`: max, exp2, row sums);
- pv_wait: to `warpgroup_mma_wait(0)` returning (P V done);
- pack_rescale: the V slot released (`v_release`, as the K slot), then P packed to e4m3 words and the
  accumulator rescaled (`pack_math`), to the end of the block;
- iteration: the top of the block to its end; period: top to the next block's top.
Then the overlap of the two warpgroups over the span both were traced: of each one's softmax cycles,
the share during which the other was in its softmax too (the two compete for the exp2 unit), in its
MMAs (issue, qk_wait or pv_wait: the tensor cores busy for it), or elsewhere (k/turn wait, pack);
and of each one's issue window, the share during which the other ran its softmax. Then an ASCII
timeline of one program's two warpgroups and its producer over 6 key blocks (cycle offsets from
the program's first stamp), and last a table of the phases beside the untraced and traced times.
The JSON holds every stamp (`raw`: [program][role][block][point], roles WG0, WG1, producer; the
last block row: smid, start, finish) and every summary number.
"""
from __future__ import annotations

import statistics
import sys

from kernels.fp8_attention_gluon import PRODUCER_POINTS, TRACE_META, TRACE_POINTS

MODULE = "bench.bench_fp8_attention_trace"
SHAPE = "1.3B"
_P = {name: i for i, name in enumerate(TRACE_POINTS)}
# phase -> (from point, to point) of a consumer's key block
PHASES = {"k_wait": ("top", "k_ready"), "turn_wait": ("k_ready", "turn_held"), "issue": ("turn_held", "turn_passed"),
          "qk_issue": ("turn_held", "qk_issued"), "v_wait": ("qk_issued", "v_ready"),
          "pv_issue": ("v_ready", "turn_passed"), "qk_wait": ("turn_passed", "logits_ready"),
          "softmax": ("logits_ready", "softmax_done"), "k_release": ("logits_ready", "k_released"),
          "softmax_math": ("k_released", "softmax_done"), "pv_wait": ("softmax_done", "pv_done"),
          "pack_rescale": ("pv_done", "end"), "v_release": ("pv_done", "v_released"),
          "pack_math": ("v_released", "end"), "iteration": ("top", "end")}
TABLE_PHASES = ("k_wait", "turn_wait", "issue", "qk_wait", "softmax", "pv_wait", "pack_rescale", "iteration", "period")
# The consecutive phases a block is cut into (the timeline's and the overlap's), with the timeline's letters.
SEGMENTS = {"k_wait": "k", "turn_wait": "t", "issue": "I", "qk_wait": "q", "softmax": "S", "pv_wait": "p",
            "pack_rescale": "r"}
MMA_PHASES = ("issue", "qk_wait", "pv_wait")
TIMELINE_BLOCKS = 6
TIMELINE_WIDTH = 112


def consumer_blocks(trace, program: int, role: int, first: int = 2):
    """The key blocks first .. iters-1 of a consumer warpgroup whose stamps are all there (nonzero):
    [(block, [stamp of each TRACE_POINTS])]."""
    rows = trace[program][role][:-1]
    return [(j, rows[j]) for j in range(first, len(rows)) if all(rows[j])]


def phase_cycles(trace, programs: int, first: int = 2) -> dict:
    """{"WG0"/"WG1": {phase: [cycles of each traced block of each program]}} (PHASES and `period`)."""
    out = {}
    for role in (0, 1):
        cycles = {name: [] for name in [*PHASES, "period"]}
        for p in range(programs):
            blocks = consumer_blocks(trace, p, role, first)
            for (j, stamps), nxt in zip(blocks, blocks[1:] + [None]):
                for name, (a, b) in PHASES.items():
                    cycles[name].append(stamps[_P[b]] - stamps[_P[a]])
                if nxt is not None and nxt[0] == j + 1:
                    cycles["period"].append(nxt[1][_P["top"]] - stamps[_P["top"]])
        out[f"WG{role}"] = cycles
    return out


def medians(cycles: dict) -> dict:
    return {wg: {name: (statistics.median(v) if v else None) for name, v in phases.items()}
            for wg, phases in cycles.items()}


def segments(trace, program: int, role: int, first: int = 2):
    """[(start, end, phase)] of a consumer's traced blocks, cut at its stamps into SEGMENTS."""
    out = []
    for _, stamps in consumer_blocks(trace, program, role, first):
        for name in SEGMENTS:
            a, b = PHASES[name]
            out.append((stamps[_P[a]], stamps[_P[b]], name))
    return out


def overlap(trace, program: int, first: int = 2) -> dict | None:
    """Cycles during which WG0 is in phase a and WG1 in phase b ({"a|b": cycles}), over the span both
    warpgroups' traced blocks cover; None where one has no traced block."""
    seg0, seg1 = segments(trace, program, 0, first), segments(trace, program, 1, first)
    if not seg0 or not seg1:
        return None
    lo, hi = max(seg0[0][0], seg1[0][0]), min(seg0[-1][1], seg1[-1][1])
    both = {}
    for a0, b0, n0 in seg0:
        for a1, b1, n1 in seg1:
            cycles = min(b0, b1, hi) - max(a0, a1, lo)
            if cycles > 0:
                both[f"{n0}|{n1}"] = both.get(f"{n0}|{n1}", 0) + cycles
    return both


def overlap_shares(pairs: list[dict]) -> dict:
    """From `overlap`s summed over programs: of each warpgroup's softmax cycles, the shares during which
    the other is in softmax / in its MMAs / elsewhere; of each one's issue cycles, the share during
    which the other runs its softmax."""
    total: dict[str, int] = {}
    for pair in pairs:
        for key, cycles in pair.items():
            total[key] = total.get(key, 0) + cycles
    out = {"cycles": total}
    for me, other in ((0, 1), (1, 0)):
        def of(mine, theirs):
            return sum(c for key, c in total.items()
                       if key.split("|")[me] in mine and key.split("|")[other] in theirs)
        every = tuple(SEGMENTS)
        softmax = of(("softmax",), every)
        issue = of(("issue",), every)
        out[f"WG{me}"] = {
            "softmax_cycles": softmax,
            "softmax_while_other_softmax": of(("softmax",), ("softmax",)) / softmax if softmax else None,
            "softmax_while_other_mma": of(("softmax",), MMA_PHASES) / softmax if softmax else None,
            "softmax_while_other_elsewhere": (of(("softmax",), tuple(s for s in every if s not in MMA_PHASES
                                                                      and s != "softmax")) / softmax
                                              if softmax else None),
            "issue_cycles": issue,
            "issue_while_other_softmax": of(("issue",), ("softmax",)) / issue if issue else None}
    return out


def program_origin(trace, program: int) -> int:
    """The program's first stamp (its rows' smallest nonzero clock, smid left out)."""
    stamps = [v for role in trace[program] for row in role[:-1] for v in row if v]
    stamps += [v for role in trace[program] for v in role[-1][1:] if v]
    return min(stamps)


def timeline(trace, program: int, first: int = 2, blocks: int = TIMELINE_BLOCKS,
             width: int = TIMELINE_WIDTH) -> list[str]:
    """ASCII rows of one program over key blocks first .. first+blocks-1: WG0, WG1 (a letter a phase,
    SEGMENTS), the producer (K / V: waiting for a free K / V slot), a ruler of cycle offsets from the
    program's first stamp, and each block's stamps as offsets."""
    origin = program_origin(trace, program)
    rows = {role: [(j, s) for j, s in consumer_blocks(trace, program, role, first) if j < first + blocks]
            for role in (0, 1)}
    if not rows[0] or not rows[1]:
        return [f"program {program}: no traced block {first} .. {first + blocks - 1} in both warpgroups"]
    lo = min(rows[r][0][1][_P["top"]] for r in (0, 1))
    hi = max(rows[r][-1][1][_P["end"]] for r in (0, 1))
    step = max((hi - lo) / width, 1e-9)

    def bar(spans):
        cells = [" "] * width
        for a, b, ch in spans:
            for c in range(max(0, int((a - lo) / step)), min(width, int((b - lo) / step) + 1)):
                mid = lo + (c + 0.5) * step
                if a <= mid < b:
                    cells[c] = ch
        return "".join(cells)

    lines = []
    for role in (0, 1):
        spans = [(s[_P[PHASES[n][0]]], s[_P[PHASES[n][1]]], ch) for _, s in rows[role] for n, ch in SEGMENTS.items()]
        lines.append(f"WG{role}  |{bar(spans)}|")
    producer = trace[program][2][:-1]
    spans = [(r[0], r[1], "K") for r in producer if r[0] and r[1]] + [(r[2], r[3], "V") for r in producer
                                                                       if r[2] and r[3]]
    lines.append(f"prod |{bar(spans)}|")
    ticks = [" "] * (width + 12)
    for c in range(0, width, 28):
        label = f"^{int(lo + c * step - origin)}"
        ticks[c + 6:c + 6 + len(label)] = label
    lines.append("".join(ticks).rstrip() + f"   (cycles from the program's first stamp; a column {step:.0f})")
    lines.append("legend: k K wait, t turn wait, I MMA issue (V wait in it), q QK wait, S softmax, p PV wait, "
                 "r pack/rescale; prod K/V: waiting for a free slot")
    names = ("top", "turn_held", "turn_passed", "logits_ready", "softmax_done", "pv_done", "end")
    lines.append("block  WG  " + " ".join(f"{n:>12s}" for n in names))
    for role in (0, 1):
        for j, s in rows[role]:
            lines.append(f"{j:5d}  {role:2d}  " + " ".join(f"{s[_P[n]] - origin:12d}" for n in names))
    return lines


def summarize(trace, programs: int, first: int = 2) -> dict:
    """Every summary number of one variant's trace ([program][role][block][point] nested lists)."""
    cycles = phase_cycles(trace, programs, first)
    pairs = [o for o in (overlap(trace, p, first) for p in range(programs)) if o]
    producer = {name: [] for name in ("k_empty_wait", "v_empty_wait")}
    lengths, smids = [], []
    for p in range(programs):
        for row in trace[p][2][first:-1]:
            if all(row[:len(PRODUCER_POINTS)]):
                producer["k_empty_wait"].append(row[1] - row[0])
                producer["v_empty_wait"].append(row[3] - row[2])
        meta = [trace[p][r][-1] for r in (0, 1)]
        if all(m[1] and m[2] for m in meta):
            lengths.append(max(m[2] for m in meta) - min(m[1] for m in meta))
        smids.append(trace[p][0][-1][0])
    unordered = sum(1 for p in range(programs) for r in (0, 1) for _, s in consumer_blocks(trace, p, r, first)
                    if any(b < a for a, b in zip(s, s[1:])))
    return {"median_cycles": medians(cycles), "producer_median_cycles": medians({"producer": producer})["producer"],
            "overlap": overlap_shares(pairs), "program_cycles_median": statistics.median(lengths) if lengths else None,
            "smids": smids, "blocks_out_of_order": unordered, "cycles": cycles}


def variant_lines(name: str, tiles: str, trace, summary: dict) -> list[str]:
    """What the probe prints of one variant: phase medians, the producer's waits, the overlap shares and
    the first program's timeline."""
    lines = [f"\n== {name}: {tiles}"]
    med = summary["median_cycles"]
    for wg in ("WG0", "WG1"):
        lines.append(f"{wg}: " + ", ".join(f"{ph} {med[wg][ph]:.0f}" for ph in PHASES if med[wg][ph] is not None))
    prod = summary["producer_median_cycles"]
    lines.append("producer: " + ", ".join(f"{ph} {c:.0f}" for ph, c in prod.items() if c is not None)
                 + f"; SMs {summary['smids']}; blocks with stamps out of order: {summary['blocks_out_of_order']}")
    for wg in ("WG0", "WG1"):
        o = summary["overlap"].get(wg)
        if o and o["softmax_cycles"]:
            lines.append(f"{wg} softmax ({o['softmax_cycles']} cycles): the other WG in softmax "
                         f"{o['softmax_while_other_softmax']:.0%}, in its MMAs {o['softmax_while_other_mma']:.0%}, "
                         f"elsewhere {o['softmax_while_other_elsewhere']:.0%}; {wg} issue ({o['issue_cycles']} "
                         f"cycles) while the other's softmax runs {o['issue_while_other_softmax'] or 0:.0%}")
    return lines + timeline(trace, 0)


def table(results: dict) -> list[str]:
    """The last table: per variant and warpgroup, the median cycles of each phase, the overlap shares,
    and the kernel's times untraced and traced."""
    lines = [f"{'variant':12s} {'wg':3s} " + " ".join(f"{p[:9]:>9s}" for p in TABLE_PHASES)
             + f" {'smx||smx':>8s} {'smx||mma':>8s} {'iss||smx':>8s}"]
    for name, r in results.items():
        med, ov = r["summary"]["median_cycles"], r["summary"]["overlap"]
        for wg in ("WG0", "WG1"):
            cells = " ".join(f"{med[wg][p]:9.0f}" if med[wg][p] is not None else f"{'-':>9s}" for p in TABLE_PHASES)
            shares = " ".join(f"{ov[wg][k]:8.2f}" if ov.get(wg, {}).get(k) is not None else f"{'-':>8s}"
                              for k in ("softmax_while_other_softmax", "softmax_while_other_mma",
                                        "issue_while_other_softmax"))
            lines.append(f"{name:12s} {wg:3s} {cells} {shares}")
        lines.append(f"{name:12s}     untraced {r['untraced_ms']:.3f} ms, traced {r['traced_ms']:.3f} ms; a program "
                     f"{r['summary']['program_cycles_median'] or 0:.0f} cycles; traced output equal: "
                     f"{r['traced_output_equal']}")
    return lines


def main(argv=None) -> int:
    from bench.harness import Bench, need_cuda, time_ms
    b = Bench(MODULE, __doc__, argv)
    p = b.parser
    p.add_argument("--programs", type=int, default=8, help="programs traced (pid0 * programs_y + pid1 below it)")
    p.add_argument("--iters", type=int, default=16, help="key blocks traced a program (blocks 2 .. iters-1 summed)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each kernel")
    args = b.parse()
    if args.programs < 1:
        p.error(f"--programs must be >= 1, got {args.programs}")
    if args.iters < 4:
        p.error(f"--iters must be >= 4 (blocks 2 .. iters-1 are summarized), got {args.iters}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    import torch
    if not torch.cuda.is_available():
        return need_cuda(MODULE)
    from dataclasses import replace

    from bench.bench_fp8_attention import HEAD_DIM, SHAPES
    from kernels import fp8_attention as fa
    from kernels import fp8_attention_gluon as fg
    problem = fg.gluon_problem(torch.device("cuda"))
    if problem:
        print(f"{MODULE}: {problem}", file=sys.stderr)
        return 2
    Hq, Hkv, Sq, Sk = SHAPES[SHAPE]
    n_blocks = -(-Sk // fg.GLUON_TILES.block_n)
    programs = -(-Sq // fg.GLUON_TILES.block_m) * Hq
    if args.iters > n_blocks or args.programs > programs:
        p.error(f"--iters must be <= {n_blocks} key blocks and --programs <= {programs} programs, "
                f"got {args.iters}, {args.programs}")
    D = HEAD_DIM
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, Hq, Sq, D, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(1, Hkv, Sk, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    k = k + 1.0
    operands = fa.quantize_qkv(q, k, v)
    result = {"what": "Gluon FP8 attention: per-phase %clock64 trace of its warpgroups", "shape": SHAPE,
              "heads": Hq, "query_rows": Sq, "keys": Sk, "head_dim": D, "key_blocks": n_blocks,
              "traced_programs": args.programs, "traced_blocks": args.iters, "summarized_blocks": [2, args.iters - 1],
              "points": list(TRACE_POINTS), "producer_points": list(PRODUCER_POINTS), "meta": list(TRACE_META),
              "phases": {n: list(ab) for n, ab in PHASES.items()}, "variants": {}}
    results = {}
    variants = (("pingpong", fg.GLUON_TILES), ("no-pingpong", replace(fg.GLUON_TILES, pingpong=False)),
                ("poly-exp2-half", replace(fg.GLUON_TILES, poly_exp2=2)))
    for name, tiles in variants:
        buf = fg.trace_buffer(args.programs, args.iters, "cuda")

        def untraced(t=tiles):
            return fg.fp8_attention_gluon(*operands, Sq, Sk, Hq, q.dtype, t)

        def traced(t=tiles, buf=buf):
            return fg.launch_fp8_attention_gluon(*operands, Sq, Sk, Hq, q.dtype, t, trace=buf)[0]

        untraced_ms = time_ms(untraced, args.repeats, warmup=2)
        traced_ms = time_ms(traced, args.repeats, warmup=2)
        reference = untraced()
        buf.zero_()
        out, compiled = fg.launch_fp8_attention_gluon(*operands, Sq, Sk, Hq, q.dtype, tiles, trace=buf)
        torch.cuda.synchronize()
        raw = buf.tolist()
        summary = summarize(raw, args.programs)
        registers = {}
        try:
            compiled._init_handles()
            registers = {"registers": compiled.n_regs, "spills": compiled.n_spills}
        except AttributeError:
            pass
        r = {"tiles": repr(tiles), "untraced_ms": statistics.median(untraced_ms), "untraced_ms_all": untraced_ms,
             "traced_ms": statistics.median(traced_ms), "traced_ms_all": traced_ms,
             "traced_output_equal": bool(torch.equal(out, reference)), "traced_kernel": registers,
             "summary": summary, "raw": raw}
        results[name] = r
        print("\n".join(variant_lines(name, repr(tiles), raw, summary)), flush=True)
        result["variants"][name] = r
    b.write(result)
    print()
    print("\n".join(table(results)))
    print("cycles: medians over programs x blocks; smx||smx: share of this WG's softmax while the other's softmax "
          "runs; smx||mma: ... while the other issues or waits on MMAs; iss||smx: share of this WG's issue window "
          "while the other's softmax runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
