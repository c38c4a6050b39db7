"""Reads the machine code of the built extension, arch by arch: which tensor-core instructions
each attention kernel uses, its registers, and whether it spills (stack frame > 0).

    python3 scripts/check_sass.py [path/to/_C.so] [--known-spill REGEX]

No GPU is needed: this is how the Ada (sm_89) and Ampere (sm_80) builds are checked here.
Exit code 1 when an expected instruction is missing, or a kernel has a stack frame and its name
does not match --known-spill.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Tensor-core instructions each kernel variant must contain, per arch (the PTX mma.sync and
# wgmma shapes of csrc/ptx.cuh as the hardware runs them natively). A variant is the kernel's
# name with, for the warp-level kernel, its QK codes and PV operands (template parameters).
# No expectation where the hardware has no native instruction: the FP8 variants are stubs before
# sm_89 and emulate FP8 (and INT4) mma.sync on sm_90; the Hopper kernel has code for sm_90a only.
EXPECTED: dict[str, dict[str, tuple[str, ...]]] = {
    "attention_mma_kernel<int8, input>": {
        "sm_80": ("IMMA.16832.S8.S8", "HMMA.16816.F32"),
        "sm_89": ("IMMA.16832.S8.S8", "HMMA.16816.F32"),
        "sm_90": ("IMMA.16832.S8.S8", "HMMA.16816.F32"),
    },
    "attention_mma_kernel<int8, fp8>": {
        "sm_89": ("IMMA.16832.S8.S8", "QMMA.16832.F32.E4M3.E4M3"),
        "sm_90": ("IMMA.16832.S8.S8",),
    },
    "attention_mma_kernel<int4, fp8>": {
        "sm_89": ("IMMA.16864.S4.S4", "QMMA.16832.F32.E4M3.E4M3"),
    },
    "attention_wgmma_kernel": {
        "sm_90": ("IGMMA.64x128x32.S8.S8", "QGMMA.64x"),
    },
}
KERNEL_NAMES = ("attention_mma_kernel", "attention_wgmma_kernel")
_QK_CODES = {"0": "int8", "1": "int4"}  # csrc/attention_params.h: QkCodes
_PV_OPERANDS = {"0": "input", "1": "fp8"}  # PvOperands


def variant(name: str) -> str:
    """The EXPECTED key of a (mangled) kernel name, e.g. attention_mma_kernel<int4, fp8>."""
    kernel = next(k for k in KERNEL_NAMES if k in name)
    m = re.search(r"QkCodesE(\d)ELNS_\d+PvOperandsE(\d)E", name)
    return f"{kernel}<{_QK_CODES[m.group(1)]}, {_PV_OPERANDS[m.group(2)]}>" if m else kernel


@dataclass
class Kernel:
    arch: str
    name: str
    registers: int
    stack: int
    instructions: dict[str, int]
    loop_spills: int = 0  # local loads/stores in the main loop (where a spill costs every tile)
    loop_mufu_run: int = 0  # the main loop's longest run of back-to-back MUFU instructions


_TENSOR_OPS = ("IMMA", "HMMA", "QMMA", "HGMMA", "QGMMA", "IGMMA")


def main_loop(code: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The innermost loop (a backward branch's range) that holds tensor-core instructions of two
    kinds (the QK and the PV product), or of one kind if no loop holds two; [] if none does."""
    best: tuple[int, int, list[tuple[int, str]]] | None = None  # (kinds, -span, body)
    for addr, text in code:
        m = re.search(r"BRA (?:\S+, )?(0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [(a, t) for a, t in code if int(m.group(1), 16) <= a <= addr]
        kinds = len({t.split()[0].split(".")[0] for _, t in body if t.startswith(_TENSOR_OPS)})
        if kinds == 0:
            continue
        key = (kinds, -(addr - int(m.group(1), 16)), body)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else []


def spill_instructions(code: list[tuple[int, str]]) -> int:
    """LDL/STL (predicated or not) in a stretch of code."""
    return sum(1 for _, t in code if re.match(r"(@!?P\w+\s+)?(LDL|STL)", t))


def longest_mufu_run(code: list[tuple[int, str]]) -> int:
    """The most MUFU instructions a stretch of code issues back to back. In the Hopper kernel's
    KV loop a long run (x20 and more) was the sign of a slow schedule: ptxas had put the fold's
    FFMAs after the softmax's exponentials, which then queue on the MUFU pipe with nothing
    independent beside them (benchmarks/RESULTS.md, session 17: 7 % slower at head_dim 128). The
    kept kernel's loops have runs of 2-3."""
    best = run = 0
    for _, text in code:
        op = text.split()[1] if text.startswith("@") else text.split()[0]
        run = run + 1 if op.startswith("MUFU") else 0
        best = max(best, run)
    return best


def main_loop_spills(code: list[tuple[int, str]]) -> int:
    """LDL/STL in main_loop (where a spill costs every tile)."""
    return spill_instructions(main_loop(code))


def find_cuobjdump() -> str | None:
    """cuobjdump from $CUOBJDUMP, PATH, $CUDA_HOME or the copy triton's package carries."""
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates.append(str(Path(cuda_home) / "bin" / "cuobjdump"))
    try:
        triton = importlib.import_module("triton")
        candidates.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def mma_flags(name: str) -> tuple[int, bool, bool]:
    """(head_dim, causal, smooth_q) of an attention_mma_kernel's mangled name."""
    m = re.search(r"Li(\d+)ELb([01])ELb([01])E", name)
    assert m, name
    return int(m.group(1)), m.group(2) == "1", m.group(3) == "1"


def demangled_short(name: str) -> str:
    """attention_mma_kernel<fp16, 128, causal, smooth-q, int8, fp8> from the mangled name (enough
    to read a table)."""
    m = re.search(r"(attention_\w+?_kernel)I(\d*_{0,2}\w+?)Li(\d+)ELb([01])E(Lb([01])E)?", name)
    if not m:
        return name
    dtype = "bf16" if "bfloat16" in m.group(2) else "fp16"
    short = f"{m.group(1)}<{dtype}, {m.group(3)}, {'causal' if m.group(4) == '1' else 'full'}"
    if m.group(5):
        short += ", smooth-q" if m.group(6) == "1" else ", no-smooth-q"
    codes = variant(name)
    return short + (codes[codes.index("<") + 1:-1].join([", ", ">"]) if "<" in codes else ">")


def parse_instruction(line: str) -> tuple[int, str] | None:
    """(address, instruction text without the ';') of one line of cuobjdump --dump-sass, or None
    where the line holds no instruction."""
    m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
    return (int(m.group(1), 16), m.group(2)) if m else None


def read_kernels(cuobjdump: str, library: str) -> list[Kernel]:
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", library], capture_output=True, text=True,
                           check=True).stdout
    sass = subprocess.run([cuobjdump, "--dump-sass", library], capture_output=True, text=True, check=True).stdout
    kernels: dict[tuple[str, str], Kernel] = {}
    arch = "?"
    lines = usage.splitlines()
    for i, line in enumerate(lines):
        if m := re.search(r"arch = (sm_\d+a?)", line):
            arch = m.group(1).rstrip("a")
        if m := re.match(r"\s*Function (\S+):", line):
            res = lines[i + 1]
            reg = int(re.search(r"REG:(\d+)", res).group(1))
            stack = int(re.search(r"STACK:(\d+)", res).group(1))
            kernels[(arch, m.group(1))] = Kernel(arch, m.group(1), reg, stack, {})
    arch, current = "?", None
    code: list[tuple[int, str]] = []

    def close() -> None:
        if current is not None:
            loop = main_loop(code)
            current.loop_spills = spill_instructions(loop)
            current.loop_mufu_run = longest_mufu_run(loop)

    for line in sass.splitlines():
        if m := re.search(r"arch = (sm_\d+a?)", line):
            arch = m.group(1).rstrip("a")
        if m := re.match(r"\s*Function : (\S+)", line):
            close()
            current, code = kernels.get((arch, m.group(1))), []
            continue
        if current is not None and (instruction := parse_instruction(line)):
            code.append(instruction)
        if current is not None and (m := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", line)):
            op = m.group(1)
            if op.startswith(_TENSOR_OPS):
                current.instructions[op] = current.instructions.get(op, 0) + 1
    close()
    return list(kernels.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("library", nargs="?", help="the extension .so (default: the installed one)")
    parser.add_argument("--known-spill", default=None,
                        help="regex of kernel names whose stack frame is a known, reported issue")
    args = parser.parse_args(argv)
    library = args.library or importlib.import_module("sageattention2._C").__file__
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("cuobjdump not found (set CUOBJDUMP)", file=sys.stderr)
        return 2
    kernels = [k for k in read_kernels(cuobjdump, library) if any(f in k.name for f in KERNEL_NAMES)]
    failures = []
    print(f"{'arch':<7}{'kernel':<56}{'regs':>5}{'stack':>7}{'in loop':>8}  tensor-core instructions")
    for k in sorted(kernels, key=lambda k: (k.arch, demangled_short(k.name))):
        want = EXPECTED[variant(k.name)].get(k.arch, ())
        missing = [w for w in want if not any(op.startswith(w) for op in k.instructions)]
        spill = k.stack > 0 and not (args.known_spill and re.search(args.known_spill, k.name))
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(k.instructions.items()))
        flag = (" MISSING " + ",".join(missing) if missing else "") + (" SPILLS" if spill else "")
        flag += " (known spill)" if k.stack > 0 and not spill else ""
        print(f"{k.arch:<7}{demangled_short(k.name):<56}{k.registers:>5}{k.stack:>7}{k.loop_spills:>8}  {ops}{flag}")
        if missing or spill:
            failures.append(k)
    archs = sorted({k.arch for k in kernels})
    print(f"{len(kernels)} kernels on {', '.join(archs) or 'no arch'}: "
          f"{'OK' if not failures and kernels else 'FAILED'}")
    return 0 if kernels and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
