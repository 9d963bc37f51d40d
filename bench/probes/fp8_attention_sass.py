"""The FP8 attention kernel's machine code for Hopper, compiled here without a GPU: registers a
thread and the instructions of its main loop, by opcode.

    python -m bench.probes.fp8_attention_sass [--tiles default,long-keys] [--out F]

Compiles `kernels.fp8_attention._fp8_attention_kernel` for sm_90 (TMA descriptors, head_dim 128)
with the installed triton (the GPU machines run triton 3.6: put a triton 3.6 wheel first on
PYTHONPATH to see what they run), disassembles the cubin with the nvdisasm triton ships, and
reads registers and local (spill) bytes with its cuobjdump, and takes the main loop as the shortest backward branch whose body holds both of the loop's MMAs
(the INT8 Q K^T, IGMMA, and the FP8 P V, QGMMA). One pass of that loop is one program's step
over 128 keys: its instruction count is what each of the program's warps issues a step (all
four warps run the same code), the figure docs/design.md sets against the tensor cores' time.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def _sass_lines(sass: str):
    """[(label or None, opcode, operands)] in program order; labels mark the next instruction."""
    out, pending = [], None
    for line in sass.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            pending = m.group(1)
            continue
        m = _LINE.match(line)
        if m:
            out.append((pending, m.group(2), m.group(3)))
            pending = None
    return out


def main_loop(sass: str) -> list[str]:
    """The opcodes of the shortest backward-branch body that holds both an IGMMA and a QGMMA
    (longer ones are the wait loops ptxas puts after the code, branching back into it)."""
    lines = _sass_lines(sass)
    where = {label: i for i, (label, _, _) in enumerate(lines) if label}
    best: list[str] = []
    for i, (_, op, rest) in enumerate(lines):
        target = re.search(r"`\((\.L_x_\d+)\)", rest)
        if op.startswith("BRA") and target and where.get(target.group(1), i + 1) <= i:
            body = [o for _, o, _ in lines[where[target.group(1)]:i + 1]]
            names = {o.split(".")[0] for o in body}
            if {"IGMMA", "QGMMA"} <= names and (not best or len(body) < len(best)):
                best = body
    return best


def compile_kernel(tiles, head_dim: int = 128):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import fp8_attention as fa
    consts = dict(HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, SCALE_M=128, SCALE_N=128,
                  PV_FP8=True, TMA=True, MAGIC=tiles.magic, ROUND_FIRST=False)
    pointers = {"q_ptr": "*i8", "qs_ptr": "*fp32", "k_ptr": "*i8", "ks_ptr": "*fp32", "vt_ptr": "*fp8e4nv",
                "vs_ptr": "*fp32", "o_ptr": "*bf16"}
    names = list(inspect.signature(fa._fp8_attention_kernel.fn).parameters)
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    signature.update(q_desc=f"tensordesc<i8[{tiles.block_m}, {head_dim}]>",
                     k_desc=f"tensordesc<i8[{tiles.block_n}, {head_dim}]>",
                     vt_desc=f"tensordesc<fp8e4nv[{head_dim}, {tiles.block_n}]>")
    source = ASTSource(fa._fp8_attention_kernel, signature,
                       constexprs={(names.index(k),): v for k, v in consts.items()})
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if tiles.maxnreg:
        options["maxnreg"] = tiles.maxnreg
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options), triton


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.fp8_attention_sass", description=__doc__.split("\n")[0])
    p.add_argument("--tiles", default="default,long-keys", help="comma list of 'default' and 'long-keys'")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from kernels import fp8_attention as fa
    if fa.INTERPRETED:
        print("unset TRITON_INTERPRET: this compiles the kernel for sm_90", file=sys.stderr)
        return 2
    choices = {"default": fa.DEFAULT_TILES, "long-keys": fa.LONG_KEY_TILES}
    unknown = [t for t in args.tiles.split(",") if t not in choices]
    if unknown:
        p.error(f"--tiles: unknown {unknown}; known {sorted(choices)}")
    result = {"what": "FP8 attention kernel, sm_90 SASS compiled offline: registers and the main loop's instructions",
              "command": "python -m bench.probes.fp8_attention_sass " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "device": "none (compiled for sm_90)", "tiles": {}}
    for name in args.tiles.split(","):
        kernel, triton = compile_kernel(choices[name])
        result["triton"] = triton.__version__
        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                                  check=True).stdout
            usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                                   text=True, check=True).stdout
        registers, local = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL"))
        loop = main_loop(sass)
        ops = collections.Counter(o.split(".")[0] for o in loop)
        result["tiles"][name] = {"tiles": repr(choices[name]), "registers": registers, "local_bytes": local,
                                 "loop_instructions": len(loop), "loop_by_opcode": dict(ops.most_common())}
        print(f"{name:10s} {registers} registers, {local} local (spill) bytes; main loop {len(loop)} instructions "
              f"a warp: " + ", ".join(f"{o} {n}" for o, n in ops.most_common(8)), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
