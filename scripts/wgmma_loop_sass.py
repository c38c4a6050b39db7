"""The Hopper kernel's KV loop as ptxas scheduled it, from one instantiation compiled here (no GPU):
instructions per trip, local-memory spills, and the order of the loop's wgmma commits, waits and
softmax exponentials. This is how the session-16 finding was read: ptxas places a
`WARPGROUP.DEPBAR` (wgmma.wait_group) before the first instruction that touches a register the
in-flight wgmma uses, even one the program never reads again, so where the wait for PV(it - 1)
lands says which registers ptxas reused (benchmarks/RESULTS.md, session 16).

    python3 scripts/wgmma_loop_sass.py [--head-dim 128] [--causal] [--dtype fp16|bf16] [--csrc DIR] [--show]

NVCC_EXTRA="-DNAME ..." adds nvcc flags (e.g. a macro that switches an experimental variant).

Prints e.g. "commit x2 | wait<=1 | EX2 x64 | wait<=0": here the softmax's 64 MUFU.EX2 run
between the wait for S(it) and the wait for PV(it - 1), i.e. overlapped with the PV. Also the
loop's encoded stall cycles per trip (stall_cycles), and with --show each instruction's.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_sass  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


DTYPES = {"fp16": ("cuda_fp16.h", "__half"), "bf16": ("cuda_bf16.h", "__nv_bfloat16")}


def compile_loop(csrc: Path, head_dim: int, causal: bool, dtype: str = "fp16",
                 stalls: dict[int, int] | None = None) -> tuple[str, list[tuple[int, str]]]:
    """ptxas's resource line and the main loop's (address, instruction) list; `stalls`, if
    given, receives each instruction's encoded stall cycles by address (stall_cycles)."""
    torch_include = Path(importlib.import_module("torch").__file__).parent / "include"
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "one.cu"
        header, ctype = DTYPES[dtype]
        unit.write_text(
            f"#include <{header}>\n#include \"attention_wgmma_kernel.cuh\"\nnamespace sageattention2 {{\n"
            f"template __global__ void attention_wgmma_kernel<{ctype}, {head_dim}, {str(causal).lower()}>("
            "const __grid_constant__ AttentionWgmmaParams, const __grid_constant__ CUtensorMap, "
            "const __grid_constant__ CUtensorMap);\n}\n")
        obj = Path(tmp) / "one.o"
        build = subprocess.run(
            ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-arch=sm_90a", "-Xptxas", "-v",
             "-I", str(csrc), "-I", str(torch_include), *os.environ.get("NVCC_EXTRA", "").split(),
             "-c", str(unit), "-o", str(obj)],
            capture_output=True, text=True)
        if build.returncode != 0:
            sys.exit(build.stderr[-4000:])
        usage = " ".join(line.split("ptxas info    : ")[-1] for line in build.stderr.splitlines()
                         if "registers" in line or "spill" in line)
        cuobjdump = check_sass.find_cuobjdump()
        if cuobjdump is None:
            sys.exit("cuobjdump not found (set CUOBJDUMP)")
        sass = subprocess.run([cuobjdump, "--dump-sass", str(obj)], capture_output=True, text=True,
                              check=True).stdout
    code = [i for line in sass.splitlines() if (i := check_sass.parse_instruction(line))]
    if stalls is not None:
        stalls.update(stall_cycles(sass))
    return usage, check_sass.main_loop(code)


def stall_cycles(sass: str) -> dict[int, int]:
    """Each instruction's stall count by address: the cycles ptxas makes the warp wait before its
    next instruction, bits 105-108 of the 128-bit Volta-and-later encoding (the control bits of
    the second 64-bit word cuobjdump prints). Their sum over the KV loop is the loop's fixed
    latency per trip for one warp, before any scoreboard wait (MUFU, shuffles, barriers, wgmma):
    the \"wait\" stall reason that dominates the kernel (benchmarks/RESULTS.md, sessions 15, 18)."""
    return {int(m.group(1), 16): (int(m.group(2), 16) >> 41) & 0xF
            for m in re.finditer(r"/\*([0-9a-f]+)\*/[^\n]*;\s*/\* 0x[0-9a-f]+ \*/\s*\n\s*/\* (0x[0-9a-f]+) \*/", sass)}


def events(loop: list[tuple[int, str]]) -> str:
    """The loop's wgmma commits, waits, MUFU.EX2, shared stores and spills, runs merged."""
    out: list[list] = []
    for _, text in loop:
        op = text.split()[1] if text.startswith("@") else text.split()[0]
        if op.split(".")[0] in ("IGMMA", "QGMMA", "HGMMA"):
            name = "commit" if "gsb0" in text else None
        elif op.startswith("WARPGROUP.DEPBAR"):
            name = "wait<=" + str(int(text.split(",")[-1].strip(), 16))
        elif op.startswith("MUFU.EX2"):
            name = "EX2"
        elif op.split(".")[0] in ("LDL", "STL", "STS"):
            name = op.split(".")[0]
        else:
            name = None
        if name is None:
            continue
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return " | ".join(n if c == 1 else f"{n} x{c}" for n, c in out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="fp16", choices=tuple(DTYPES), help="the input dtype T")
    parser.add_argument("--csrc", type=Path, default=REPO / "csrc", help="the headers to compile")
    parser.add_argument("--show", action="store_true", help="print the loop's instructions too")
    args = parser.parse_args(argv)
    stalls: dict[int, int] = {}
    usage, loop = compile_loop(args.csrc, args.head_dim, args.causal, args.dtype, stalls)
    spills = check_sass.spill_instructions(loop)
    print(f"head_dim {args.head_dim} causal {args.causal} {args.dtype}: {usage}")
    print(f"KV loop: {len(loop)} instructions per trip, {spills} spill instructions, "
          f"longest MUFU run {check_sass.longest_mufu_run(loop)}, "
          f"{sum(stalls.get(a, 0) for a, _ in loop)} encoded stall cycles")
    print(events(loop))
    if args.show:
        print("\n".join(f"{a:#07x}  s{stalls.get(a, 0):<2d} {t}" for a, t in loop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
