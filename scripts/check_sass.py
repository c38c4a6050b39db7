"""Reads the machine code of a built extension (no GPU needed: this is how the Ada (sm_89) and
Ampere (sm_80) builds are checked here), in two modes:

    python3 scripts/check_sass.py [_C.so] [--known-spill REGEX] [--loops]
    python3 scripts/check_sass.py --compare BEFORE AFTER [--allow REGEX] [--archs sm_90 ...]

The check (default; the installed extension unless a path is given): per arch, which
tensor-core instructions each attention kernel uses, its registers, its stack frame and the
local loads/stores of its main loop. Exit code 1 when an expected instruction is missing, a
stack frame or a Hopper KV loop's local accesses exceed the known ones (known_stack,
hopper_limits; --known-spill REGEX allows more for kernel names it matches), or a Hopper KV loop
has a longer run of back-to-back MUFU instructions than hopper_limits allows (longest_mufu_run). --loops also prints each Hopper kernel's KV-loop event line (events).

--compare: every kernel of two builds, matched by demangled name and arch: registers, stack
frame, static shared memory, instruction count and the instruction mix (a histogram of opcodes
with their modifiers). Prints the differences and exits 1 when any kernel differs or exists in
one build only, unless its demangled name matches --allow REGEX (kernels expected to change,
or to go: e.g. --allow "quantize_q_kernel|prepare_kv_kernel" across their removal). A kernel
whose name differs only in its namespaces is paired with its counterpart ("renamed"), which is
not a difference. This is how a refactor proves that the kernels' SASS is unchanged. BEFORE
and AFTER are .so files, or .json files of kernel records written by --save-json (keep a
build's records without keeping the build).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Tensor-core instructions each kernel variant must contain, per arch (the PTX mma.sync and
# wgmma shapes of the kernels as the hardware runs them natively). A variant is the kernel's
# name with, for the warp-level kernel, its QK codes and PV operands (template parameters).
# No expectation where the hardware has no native instruction: the FP8 variants are stubs before
# sm_89 and emulate FP8 (and INT4) mma.sync on sm_90; the Hopper kernel has code for sm_90a only.
# Blackwell: consumer sm_120 runs FP8 mma.sync natively (QMMA) but INT4 emulated; datacenter
# sm_100 emulates both (its FP8 tensor cores are tcgen05's).
_INT8_FP16_PV = ("IMMA.16832.S8.S8", "HMMA.16816.F32")
EXPECTED: dict[str, dict[str, tuple[str, ...]]] = {
    "attention_mma_kernel<int8, input>": {
        arch: _INT8_FP16_PV for arch in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")},
    "attention_mma_kernel<int8, fp8>": {
        "sm_89": ("IMMA.16832.S8.S8", "QMMA.16832.F32.E4M3.E4M3"),
        "sm_90": ("IMMA.16832.S8.S8",),
        "sm_100": ("IMMA.16832.S8.S8",),
        "sm_120": ("IMMA.16832.S8.S8", "QMMA.16832.F32.E4M3.E4M3"),
    },
    "attention_mma_kernel<int4, fp8>": {
        "sm_89": ("IMMA.16864.S4.S4", "QMMA.16832.F32.E4M3.E4M3"),
        "sm_120": ("QMMA.16832.F32.E4M3.E4M3",),
    },
    "attention_wgmma_kernel<fp8>": {
        "sm_90": ("IGMMA.64x128x32.S8.S8", "QGMMA.64x"),
    },
    "attention_wgmma_kernel<input>": {  # the accurate tier: PV on fp16/bf16 HGMMA
        "sm_90": ("IGMMA.64x128x32.S8.S8", "HGMMA.64x"),
    },
}
KERNEL_NAMES = ("attention_mma_kernel", "attention_wgmma_kernel")
_QK_CODES = {"0": "int8", "1": "int4"}  # the kernels' QkCodes enum
_PV_OPERANDS = {"0": "input", "1": "fp8"}  # their PvOperands enum
# The most MUFU instructions the Hopper kernel's KV loop may issue back to back (longest_mufu_run).
MUFU_RUN_LIMIT = 8


def variant(name: str) -> str:
    """The EXPECTED key of a (mangled) kernel name, e.g. attention_mma_kernel<int4, fp8>."""
    kernel = next(k for k in KERNEL_NAMES if k in name)
    if kernel == "attention_wgmma_kernel":  # <T, head_dim, causal, fp8 PV>
        m = re.search(r"attention_wgmma_kernelI.*?Li\d+ELb[01]ELb([01])E", name)
        return f"{kernel}<{'fp8' if m is None or m.group(1) == '1' else 'input'}>"
    # The enums' mangled namespaces are left open (a namespace move changes their substitutions).
    m = re.search(r"QkCodesE(\d)E.*?PvOperandsE(\d)E", name)
    return f"{kernel}<{_QK_CODES[m.group(1)]}, {_PV_OPERANDS[m.group(2)]}>" if m else kernel


def known_stack(name: str, arch: str, head_dim: int, causal: bool, smooth_q: bool,
                packed: bool = False) -> int:
    """The largest stack frame (bytes) an attention_mma variant (``name`` its variant()) may have.
    On sm_90 the FP8 and INT4 mma.sync are emulated (not the fast path there; the Hopper kernel
    is): their extra registers spill. INT8 + FP16 PV at head_dim 128 runs its loop at 255
    registers: its Q-smoothing variants, and built for sm_80/sm_89 its causal ones, keep one
    8-byte value in local memory (at most one reload per tile); its packed variant (mma_packed,
    docs/DESIGN.md#packed-sequences), with the item's rows and counts beside, up to 56 bytes
    (causal on sm_80/sm_89; both on sm_90). Every other variant spills nothing: the sm_89 FP8
    variants (the Ada fast path), packed too, and INT8 + FP16 PV without Q smoothing (sageattn's
    default for INT8) on sm_90 and, non-causal, everywhere; the Hopper kernel.
    Blackwell (built, not run here; ptxas of CUDA 13.0): sm_100 emulates FP8 and INT4 mma.sync,
    sm_120 INT4, and those variants spill as sm_90's emulated ones; the packed INT8 + FP16 PV
    variant at head_dim 128 keeps up to 16 bytes there non-causal too; on sm_120 the FP8 fast
    path's causal Q-smoothing variant at 128 keeps 16 bytes (sageattn's INT8 default smooths no
    Q: its variant spills nothing)."""
    emulated = ("fp8" in name and arch in ("sm_90", "sm_100")) or (
        name.endswith("<int4, fp8>") and arch == "sm_120")
    if emulated:
        return 96
    if packed and name.endswith("<int8, input>") and head_dim == 128 and (
            causal or arch in ("sm_90", "sm_100", "sm_120")):
        return 56
    if name.endswith("<int8, input>") and head_dim == 128 and (smooth_q or (causal and arch != "sm_90")):
        return 8
    if name.endswith("<int8, fp8>") and arch == "sm_120" and head_dim == 128 and causal and smooth_q:
        return 16
    return 0


def hopper_limits(short_name: str) -> tuple[int, int, int | None]:
    """What a Hopper kernel variant (its demangled_short() name) may have: (local loads/stores in
    its KV loop, stack bytes, longest run of back-to-back MUFUs in the loop; None: no limit).
    - head_dim 256 (docs/DECISIONS.md#d39): O's 128 registers beside two PV chunk accumulators
      leave the item's state a few spills per item (112-152 bytes of frame) and 4 accesses per
      tile in the non-causal loop (one causal: 8 before D43, none from D43 to the item-start
      barrier per ring slot of session 37, which ptxas allocated so), faster than the
      spill-free arrangements measured; the packed variants (D44) one access per tile more. The loop runs a tile's
      GEMMs and softmax one after the other (the other warpgroup fills the tensor cores), so
      its exponentials come in one run.
    - The accurate tier at head_dim 64 non-causal (D45): its exponentials run before the wait
      for the previous PV, in runs of up to 18.
    - Everything else spills nothing, and its exponentials are interleaved (D12)."""
    if ", 256, " in short_name:
        causal, packed = ", causal, " in short_name, ", packed>" in short_name
        spills, stack = {(True, False): (1, 136), (False, False): (4, 120), (True, True): (2, 152),
                         (False, True): (5, 120)}[causal, packed]
        return spills, stack, None
    if ", 64, full, input" in short_name:
        return 0, 0, None
    return 0, 0, MUFU_RUN_LIMIT


@dataclass
class Kernel:
    arch: str
    name: str
    registers: int
    stack: int
    instructions: dict[str, int]  # tensor-core opcodes (with modifiers) and their counts
    loop_spills: int = 0  # local loads/stores in the main loop (where a spill costs every tile)
    loop_mufu_run: int = 0  # the main loop's longest run of back-to-back MUFU instructions
    shared: int = 0  # static shared memory, bytes
    mix: dict[str, int] = field(default_factory=dict)  # every opcode (with modifiers) and its count
    loop_events: str = ""  # events() of the main loop


_TENSOR_OPS = ("IMMA", "HMMA", "QMMA", "HGMMA", "QGMMA", "IGMMA")


def opcode(text: str) -> str:
    """The opcode with its modifiers of an instruction's text, without its predicate."""
    return text.split()[1] if text.startswith("@") else text.split()[0]


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
    independent beside them (7 % slower at head_dim 128: docs/DECISIONS.md#d12). The kept
    kernel's loops have runs of 2-3."""
    best = run = 0
    for _, text in code:
        run = run + 1 if opcode(text).startswith("MUFU") else 0
        best = max(best, run)
    return best


def main_loop_spills(code: list[tuple[int, str]]) -> int:
    """LDL/STL in main_loop (where a spill costs every tile)."""
    return spill_instructions(main_loop(code))


def events(loop: list[tuple[int, str]]) -> str:
    """A loop's wgmma commits, waits, MUFU.EX2, shared stores and spills, runs merged, e.g.
    "commit x2 | wait<=1 | EX2 x64 | wait<=0": the softmax's exponentials run between the wait
    for S(it) and the wait for PV(it - 1), overlapped with the PV. ptxas places a
    WARPGROUP.DEPBAR (wgmma.wait_group) before the first instruction that touches a register an
    in-flight wgmma uses, so where a wait lands says which registers ptxas reused
    (docs/DECISIONS.md#d14)."""
    out: list[list] = []
    for _, text in loop:
        op = opcode(text)
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


def mma_packed(name: str) -> bool:
    """Whether an attention_mma_kernel's mangled name is its packed-sequences variant (the last
    template argument, kPacked, true)."""
    return re.search(r"PvOperandsE\dELb1E", name) is not None


def demangled_short(name: str) -> str:
    """attention_mma_kernel<fp16, 128, causal, smooth-q, int8, fp8> from the mangled name (enough
    to read a table)."""
    m = re.search(r"(attention_\w+?_kernel)I(\d*_{0,2}\w+?)Li(\d+)ELb([01])E(Lb([01])E)?", name)
    if not m:
        return name
    dtype = "bf16" if "bfloat16" in m.group(2) else "fp16"
    short = f"{m.group(1)}<{dtype}, {m.group(3)}, {'causal' if m.group(4) == '1' else 'full'}"
    if m.group(5) and m.group(1) == "attention_mma_kernel":  # (attention_wgmma's is its PV tier: variant())
        short += ", smooth-q" if m.group(6) == "1" else ", no-smooth-q"
    codes = variant(name)
    short += codes[codes.index("<") + 1:-1].join([", ", ""]) if "<" in codes else ""
    # attention_wgmma's variant of packed items (<T, head_dim, causal, fp8 PV, packed>)
    if m.group(1) == "attention_wgmma_kernel" and re.search(r"Li\d+ELb[01]ELb[01]ELb1E", name):
        short += ", packed"
    if m.group(1) == "attention_mma_kernel" and mma_packed(name):  # (its kPacked, the last argument)
        short += ", packed"
    return short + ">"


def parse_instruction(line: str) -> tuple[int, str] | None:
    """(address, instruction text without the ';') of one line of cuobjdump --dump-sass, or None
    where the line holds no instruction."""
    m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line)
    return (int(m.group(1), 16), m.group(2)) if m else None


def read_kernels(cuobjdump: str, library: str) -> list[Kernel]:
    """Every kernel of every arch in ``library`` (arch names without the "a" of sm_90a)."""
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
            shared = int(re.search(r"SHARED:(\d+)", res).group(1))
            kernels[(arch, m.group(1))] = Kernel(arch, m.group(1), reg, stack, {}, shared=shared)
    arch, current = "?", None
    code: list[tuple[int, str]] = []

    def close() -> None:
        if current is not None:
            loop = main_loop(code)
            current.loop_spills = spill_instructions(loop)
            current.loop_mufu_run = longest_mufu_run(loop)
            current.loop_events = events(loop)
            current.mix = dict(Counter(opcode(t) for _, t in code))
            current.instructions = {op: n for op, n in current.mix.items() if op.startswith(_TENSOR_OPS)}

    for line in sass.splitlines():
        if m := re.search(r"arch = (sm_\d+a?)", line):
            arch = m.group(1).rstrip("a")
        if m := re.match(r"\s*Function : (\S+)", line):
            close()
            current, code = kernels.get((arch, m.group(1))), []
            continue
        if current is not None and (instruction := parse_instruction(line)):
            code.append(instruction)
    close()
    return list(kernels.values())


# ---------------------------------------------------------------------------------------------
# --compare
# ---------------------------------------------------------------------------------------------


@dataclass
class Difference:
    arch: str
    name: str  # demangled
    what: list[str]  # e.g. ["registers 228 -> 232", "mix +2 IMAD -1 IADD3"]; ["renamed from X"] only
    allowed: bool = False  # the name matches --allow, or the kernel was only renamed


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> demangled names (cu++filt or c++filt; the names themselves without either)."""
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def _without_namespaces(name: str) -> str:
    return re.sub(r"\b[A-Za-z_]\w*::", "", name)


def kernel_differences(before: Kernel, after: Kernel) -> list[str]:
    """What differs between two builds of one kernel: resources, instruction count and mix."""
    what = [f"{label} {getattr(before, attr)} -> {getattr(after, attr)}"
            for label, attr in (("registers", "registers"), ("stack", "stack"), ("shared", "shared"))
            if getattr(before, attr) != getattr(after, attr)]
    count_before, count_after = sum(before.mix.values()), sum(after.mix.values())
    if count_before != count_after:
        what.append(f"instructions {count_before} -> {count_after}")
    delta = Counter(after.mix)
    delta.subtract(before.mix)
    changed = sorted(((op, n) for op, n in delta.items() if n), key=lambda x: (-abs(x[1]), x[0]))
    if changed:
        shown = " ".join(f"{n:+d} {op}" for op, n in changed[:8])
        what.append(f"mix {shown}" + (f" (+{len(changed) - 8} more opcodes)" if len(changed) > 8 else ""))
    return what


def compare_kernels(before: list[Kernel], after: list[Kernel], allow: str | None = None,
                    names: dict[str, str] | None = None) -> list[Difference]:
    """The differences between two builds' kernels, matched by (arch, demangled name); ``names``
    maps mangled to demangled names (identity where absent). A kernel found in one build only
    is paired with one whose name differs only in its namespaces, if there is exactly one."""
    def key(k: Kernel) -> tuple[str, str]:
        return k.arch, (names or {}).get(k.name, k.name)

    old = {key(k): k for k in before}
    new = {key(k): k for k in after}
    pairs = [(old[k], new[k], "") for k in old.keys() & new.keys()]
    only_old = {k: old[k] for k in old.keys() - new.keys()}
    only_new = {k: new[k] for k in new.keys() - old.keys()}
    for k_old in sorted(only_old):
        loose = [k for k in only_new if k[0] == k_old[0] and _without_namespaces(k[1]) == _without_namespaces(k_old[1])]
        if len(loose) == 1:
            pairs.append((only_old.pop(k_old), only_new.pop(loose[0]), f"renamed from {k_old[1]}"))
    out = []
    for b, a, renamed in pairs:
        arch, name = key(a)
        what = kernel_differences(b, a)
        if what or renamed:
            out.append(Difference(arch, name, what + ([renamed] if renamed else []), not what))
    out += [Difference(arch, name, ["only in BEFORE"]) for arch, name in only_old]
    out += [Difference(arch, name, ["only in AFTER"]) for arch, name in only_new]
    for d in out:
        d.allowed = d.allowed or bool(allow and re.search(allow, d.name))
    return sorted(out, key=lambda d: (d.arch, d.name))


def load(path: str, cuobjdump: str | None) -> list[Kernel]:
    """The kernel records of a .so (read with cuobjdump) or of a --save-json file."""
    if path.endswith(".json"):
        with open(path) as f:
            return [Kernel(**record) for record in json.load(f)]
    if cuobjdump is None:
        sys.exit("cuobjdump not found (set CUOBJDUMP)")
    return read_kernels(cuobjdump, path)


def compare(before_path: str, after_path: str, allow: str | None, archs: list[str] | None,
            cuobjdump: str | None) -> int:
    before, after = load(before_path, cuobjdump), load(after_path, cuobjdump)
    if archs:
        before, after = ([k for k in ks if k.arch in archs] for ks in (before, after))
    names = demangle(sorted({k.name for k in before + after}))
    diffs = compare_kernels(before, after, allow, names)
    # An arch built on one side only: one line, not one per kernel.
    for side, kernels, other in (("BEFORE", before, after), ("AFTER", after, before)):
        for arch in sorted({k.arch for k in kernels} - {k.arch for k in other}):
            print(f"{arch:<7}DIFFERS  every kernel: {sum(k.arch == arch for k in kernels)} only in {side} "
                  "(the other build has no code for this arch; --archs compares the common ones)")
    lone = {k.arch for k in before} ^ {k.arch for k in after}
    for d in diffs:
        if d.arch in lone:
            continue
        renamed_only = len(d.what) == 1 and d.what[0].startswith("renamed")
        tag = "DIFFERS" if not d.allowed else "renamed" if renamed_only else "allowed"
        print(f"{d.arch:<7}{tag:<9}{d.name}")
        for line in d.what:
            print(f"{'':16}{line}")
    failed = [d for d in diffs if not d.allowed]
    archs = sorted({k.arch for k in before + after})
    print(f"{len(before)} kernels before, {len(after)} after, on {', '.join(archs) or 'no arch'}: "
          f"{len(failed)} differ" + (f", {len(diffs) - len(failed)} allowed or renamed" if len(diffs) > len(failed)
                                     else "") + f": {'FAILED' if failed else 'OK'}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------


def check(kernels: list[Kernel], known_spill: str | None, loops: bool) -> int:
    kernels = [k for k in kernels if any(f in k.name for f in KERNEL_NAMES)]
    failures = []
    print(f"{'arch':<7}{'kernel':<56}{'regs':>5}{'stack':>7}{'in loop':>8}  tensor-core instructions")
    for k in sorted(kernels, key=lambda k: (k.arch, demangled_short(k.name))):
        name = variant(k.name)
        want = EXPECTED[name].get(k.arch, ())
        missing = [w for w in want if not any(op.startswith(w) for op in k.instructions)]
        if "attention_mma_kernel" in k.name:  # (the stack frame bounds its loop's accesses)
            limit, mufu_limit = known_stack(name, k.arch, *mma_flags(k.name), mma_packed(k.name)), None
            loop_limit = k.loop_spills
        else:
            loop_limit, limit, mufu_limit = hopper_limits(demangled_short(k.name))
        spill = ((k.stack > limit or k.loop_spills > loop_limit)
                 and not (known_spill and re.search(known_spill, k.name)))
        mufu = mufu_limit is not None and k.loop_mufu_run > mufu_limit
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(k.instructions.items()))
        flag = (" MISSING " + ",".join(missing) if missing else "") + (" SPILLS" if spill else "")
        flag += " (known spill)" if k.stack > 0 and not spill else ""
        flag += f" MUFU RUN x{k.loop_mufu_run}" if mufu else ""
        print(f"{k.arch:<7}{demangled_short(k.name):<56}{k.registers:>5}{k.stack:>7}{k.loop_spills:>8}  {ops}{flag}")
        if loops and "attention_wgmma_kernel" in k.name:
            print(f"{'':12}KV loop: {k.loop_events}")
        if missing or spill or mufu:
            failures.append(k)
    archs = sorted({k.arch for k in kernels})
    print(f"{len(kernels)} kernels on {', '.join(archs) or 'no arch'}: "
          f"{'OK' if not failures and kernels else 'FAILED'}")
    return 0 if kernels and not failures else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("library", nargs="?", help="the extension .so (default: the installed one)")
    parser.add_argument("--known-spill", default=None,
                        help="regex of kernel names whose stack frame is a known, reported issue")
    parser.add_argument("--loops", action="store_true", help="print the Hopper kernels' KV-loop event lines")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="compare every kernel of two builds (.so or --save-json files)")
    parser.add_argument("--allow", default=None, help="with --compare: regex of kernel names expected to differ")
    parser.add_argument("--archs", nargs="+", help="with --compare: only these archs (e.g. sm_90 sm_89)")
    parser.add_argument("--save-json", metavar="PATH", help="also write the library's kernel records here")
    args = parser.parse_args(argv)
    cuobjdump = find_cuobjdump()
    if args.compare:
        return compare(*args.compare, args.allow, args.archs, cuobjdump)
    library = args.library or importlib.import_module("sageattention2._C").__file__
    kernels = load(library, cuobjdump)
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump([dataclasses.asdict(k) for k in kernels], f)
    return check(kernels, args.known_spill, args.loops)


if __name__ == "__main__":
    sys.exit(main())
