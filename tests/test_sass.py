"""The machine code of the built extension, read without a GPU (`scripts/check_sass.py`): every
attention kernel variant, on every arch it was compiled for, runs QK and PV on the tensor-core
instructions of its types (sm_89: IMMA.16864.S4.S4 for the 4-bit kernel, IMMA.16832.S8.S8 for the
8-bit ones, QMMA.16832.F32.E4M3.E4M3 for FP8 PV, HMMA.16816.F32 for FP16 PV), and does not spill
where it is the fast path. This is how the sm_80 and sm_89 builds are checked here: no such GPU
exists. Also, on CPU: the check's loop finder, and its --compare mode (two builds' kernels) on
synthetic kernel records.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from sageattention2 import ops

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_sass.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("check_sass", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not available")
def test_attention_kernels_use_tensor_cores_and_do_not_spill() -> None:
    check = load_checker()
    cuobjdump = check.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton's copy)")
    kernels = [k for k in check.read_kernels(cuobjdump, ops._C.__file__) if "attention_mma_kernel" in k.name]
    built = {arch.rstrip("a") for arch in ops.build_info().archs}
    # 3 variants x 2 dtypes x 2 head dims x causal on/off x Q smoothing on/off, on every arch;
    # and the packed variants of INT8 QK without Q smoothing (2 PV x 2 dtypes x 2 x 2).
    assert {k.arch for k in kernels} == built
    assert len(kernels) == (48 + 16) * len(built)
    assert sum(check.mma_packed(k.name) for k in kernels) == 16 * len(built)
    variants = {check.variant(k.name) for k in kernels}
    assert variants == {f"attention_mma_kernel<{v}>" for v in ("int8, input", "int8, fp8", "int4, fp8")}
    for k in kernels:
        name = check.variant(k.name)
        for want in check.EXPECTED[name].get(k.arch, ()):
            assert any(op.startswith(want) for op in k.instructions), (k.arch, k.name, k.instructions)
        if "fp8" in name and k.arch in ("sm_80", "sm_86"):
            assert not k.instructions, (k.name, k.instructions)  # a stub: no FP8 MMA before sm_89
        head_dim, causal, smooth_q = check.mma_flags(k.name)
        assert k.stack <= check.known_stack(name, k.arch, head_dim, causal, smooth_q, check.mma_packed(k.name)), (
            k.arch, check.demangled_short(k.name), k.stack)


@pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not available")
def test_hopper_kernel_uses_wgmma_and_does_not_spill() -> None:
    """On a build with sm_90a, every attention_wgmma instantiation runs QK on IGMMA (INT8) and PV
    on QGMMA (FP8 E4M3) or, in the accurate tier, HGMMA (fp16/bf16), and spills nothing."""
    if "sm_90a" not in ops.build_info().archs:
        pytest.skip("this build has no sm_90a code")
    check = load_checker()
    cuobjdump = check.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton's copy)")
    kernels = [k for k in check.read_kernels(cuobjdump, ops._C.__file__)
               if "attention_wgmma_kernel" in k.name and k.arch == "sm_90"]
    # 2 PV tiers x 2 dtypes x head_dim 64, 128 x causal on/off, head_dim 256 with FP8 PV, and each
    # again for packed items
    assert len(kernels) == 40
    assert sum(", packed>" in check.demangled_short(k.name) for k in kernels) == 20
    assert {check.variant(k.name) for k in kernels} == {"attention_wgmma_kernel<fp8>",
                                                         "attention_wgmma_kernel<input>"}
    for k in kernels:
        for want in check.EXPECTED[check.variant(k.name)]["sm_90"]:
            assert any(op.startswith(want) for op in k.instructions), (k.name, k.instructions)
        # What each variant may spill and how its exponentials may run: check.hopper_limits (head
        # dim 256's known spills, D39/D43/D44; the accurate tier's softmax beside its PV, D45).
        name = check.demangled_short(k.name)
        loop_spills, stack, mufu_run = check.hopper_limits(name)
        assert k.loop_spills <= loop_spills and k.stack <= stack, (name, k.loop_spills, k.stack)
        if ", 256, " in name:
            continue
        if mufu_run is None:
            # The accurate tier's softmax beside its own PV product (docs/DECISIONS.md#d45): every
            # exponential of the tile before the wait for PV(it - 1), whose shadow they fill.
            assert "wait<=1 | EX2 x66 | wait<=0" in k.loop_events, (name, k.loop_events)
            continue
        # ptxas's schedule of the KV loop: no long run of MUFUs with nothing beside them (x21-x42
        # in the builds that measured 3-9 % slower, 2-3 in the kept one: docs/DECISIONS.md#d12). A
        # new compiler that reorders the loop shows here before it shows in a benchmark. And
        # ptxas waits for PV(it - 1) before the first exponential (D14).
        assert k.loop_mufu_run <= mufu_run, (name, k.loop_mufu_run)
        assert "wait<=1 | wait<=0" in k.loop_events, (name, k.loop_events)


def test_loop_finder_and_loop_events() -> None:
    """check_sass.main_loop picks the innermost loop holding both products (not the outer loop,
    not a loop of one kind); its event line says where the waits fall between the softmax's
    exponentials (merged runs, commits only for the gsb0 MMAs), and longest_mufu_run the longest
    run of back-to-back MUFUs."""
    checker = load_checker()
    code = [
        (0x000, "MOV R0, RZ"),
        (0x010, "IGMMA.64x128x32.S8.S8 R92, gdesc[UR16], RZ, !UPT"),
        (0x020, "IGMMA.64x128x32.S8.S8 R92, gdesc[UR20], R92, gsb0"),
        (0x030, "QGMMA.64x136x32.F32.E4M3.E4M3 R24, R156, gdesc[UR16], R24, gsb0"),
        (0x040, "WARPGROUP.DEPBAR.LE gsb0, 0x1"),
        (0x050, "MUFU.EX2 R1, R2"),
        (0x060, "LDL R3, [R1+0x8]"),
        (0x070, "MUFU.EX2 R4, R5"),
        (0x080, "@!P3 MUFU.EX2 R6, R7"),
        (0x090, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
        (0x0a0, "@P1 STS.128 [UR10+0x4000], R164"),
        (0x0b0, "@!P0 BRA 0x10"),   # the KV loop
        (0x0c0, "IGMMA.64x128x32.S8.S8 R92, gdesc[UR16], RZ, gsb0"),
        (0x0d0, "@!P0 BRA 0xc0"),   # a loop of one product only
        (0x0e0, "@!P2 BRA 0x0"),    # the outer loop, longer
    ]
    loop = checker.main_loop(code)
    assert [a for a, _ in loop] == list(range(0x10, 0xc0, 0x10))
    assert checker.main_loop_spills(code) == 1
    assert checker.events(loop) == "commit x2 | wait<=1 | EX2 | LDL | EX2 x2 | wait<=0 | STS"
    assert checker.longest_mufu_run(loop) == 2  # the LDL breaks the first run; a predicate does not


def test_compare_reports_every_kind_of_difference() -> None:
    """check_sass.compare_kernels (--compare) on synthetic kernel records: two identical builds
    (listed in another order) do not differ; a change of registers, stack frame, shared memory,
    instruction count, or of the mix alone (one opcode for another, same count) does, on its
    arch only; so does a kernel of one build only; --allow's regex excuses a kernel; a kernel
    whose name changed only in its namespaces is paired with its counterpart, not a difference
    unless its code differs."""
    check = load_checker()

    def kernel(arch: str, name: str, registers: int = 128, stack: int = 0, shared: int = 0,
               mix: dict[str, int] | None = None) -> object:
        return check.Kernel(arch, name, registers, stack, {}, shared=shared,
                            mix=dict(mix or {"IMAD": 10, "FFMA": 5, "IMMA.16832.S8.S8": 4}))

    def build(**changes: object) -> list:
        """Three kernels; ``changes`` replace fields of the sm_89 attention one."""
        base = dict(arch="sm_89", name="ns::attention(int)")
        return [kernel("sm_80", "ns::attention(int)", registers=96), kernel("sm_89", "ns::quantize(int)"),
                kernel(**{**base, **changes})]

    def differences(after: list, allow: str | None = None) -> list:
        return check.compare_kernels(build(), after, allow)

    def failing(after: list, allow: str | None = None) -> list:
        return [(d.arch, d.name) for d in differences(after, allow) if not d.allowed]

    assert differences(list(reversed(build()))) == []
    sm89 = [("sm_89", "ns::attention(int)")]
    assert failing(build(registers=130)) == sm89
    assert failing(build(stack=8)) == sm89
    assert failing(build(shared=1024)) == sm89
    assert failing(build(mix={"IMAD": 10, "FFMA": 6, "IMMA.16832.S8.S8": 4})) == sm89  # one more
    swapped = differences(build(mix={"IMAD": 9, "IADD3": 1, "FFMA": 5, "IMMA.16832.S8.S8": 4}))
    assert [(d.arch, d.name) for d in swapped] == sm89 and not swapped[0].allowed
    assert any("IADD3" in w and "IMAD" in w for w in swapped[0].what), swapped[0].what
    # The same name on another arch is another kernel: sm_80's attention keeps its 96 registers.
    assert failing(build()[:1] + [kernel("sm_80", "ns::attention(int)", registers=97)] + build()[2:]) != []
    assert failing(build()[:2]) == sm89  # only in BEFORE
    assert failing(build() + [kernel("sm_90", "ns::new(int)")]) == [("sm_90", "ns::new(int)")]  # only in AFTER
    assert failing(build(registers=130), allow="attention") == []
    assert [d.allowed for d in differences(build(registers=130), allow="attention")] == [True]
    # A namespace move: paired, not a failure; with a code change as well: a failure.
    assert failing(build(name="ns::inner::attention(ns::inner::int)")) == []
    assert failing(build(name="ns::inner::attention(int)", registers=130)) == [
        ("sm_89", "ns::inner::attention(int)")]
