"""The machine code of the built extension, read without a GPU (`scripts/check_sass.py`): every
attention kernel variant, on every arch it was compiled for, runs QK and PV on the tensor-core
instructions of its types (sm_89: IMMA.16864.S4.S4 for the 4-bit kernel, IMMA.16832.S8.S8 for the
8-bit ones, QMMA.16832.F32.E4M3.E4M3 for FP8 PV, HMMA.16816.F32 for FP16 PV), and does not spill
where it is the fast path. This is how the sm_80 and sm_89 builds are checked here: no such GPU
exists.
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


def load_loop_script():
    """scripts/wgmma_loop_sass.py as a module."""
    spec = importlib.util.spec_from_file_location("wgmma_loop_sass", SCRIPT.parent / "wgmma_loop_sass.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def traced_header(tmp_path: Path, script: str) -> str:
    """csrc/attention_wgmma_kernel.cuh as scripts/<script> patches it (a copy under tmp_path);
    fails with the script's AssertionError when an anchor line has moved."""
    import subprocess

    header = SCRIPT.parents[1] / "csrc" / "attention_wgmma_kernel.cuh"
    if not header.exists():
        pytest.skip("csrc/attention_wgmma_kernel.cuh not in this checkout")
    copy = tmp_path / header.name
    copy.write_text(header.read_text())
    run = subprocess.run([sys.executable, str(SCRIPT.parent / script), str(copy)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return copy.read_text()


def known_stack(name: str, arch: str, head_dim: int, causal: bool, smooth_q: bool) -> int:
    """The largest stack frame (bytes) a variant may have. On sm_90 the FP8 and INT4 mma.sync are
    emulated (not the fast path there; the Hopper kernel is): their extra registers spill. INT8 +
    FP16 PV at head_dim 128 runs its loop at 255 registers: its Q-smoothing variants, and built
    for sm_80/sm_89 its causal ones, keep one 8-byte value in local memory (at most one reload
    per tile). Every other variant spills nothing: the sm_89 FP8 variants (the Ada fast path),
    and INT8 + FP16 PV without Q smoothing (sageattn's default for INT8) on sm_90 and, non-causal,
    everywhere."""
    if "fp8" in name and arch == "sm_90":
        return 96
    if name.endswith("<int8, input>") and head_dim == 128 and (smooth_q or (causal and arch != "sm_90")):
        return 8
    return 0


@pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not available")
def test_attention_kernels_use_tensor_cores_and_do_not_spill() -> None:
    check = load_checker()
    cuobjdump = check.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton's copy)")
    kernels = [k for k in check.read_kernels(cuobjdump, ops._C.__file__) if "attention_mma_kernel" in k.name]
    built = {arch.rstrip("a") for arch in ops.build_info().archs}
    # 3 variants x 2 dtypes x 2 head dims x causal on/off x Q smoothing on/off, on every arch.
    assert {k.arch for k in kernels} == built
    assert len(kernels) == 48 * len(built)
    variants = {check.variant(k.name) for k in kernels}
    assert variants == {f"attention_mma_kernel<{v}>" for v in ("int8, input", "int8, fp8", "int4, fp8")}
    for k in kernels:
        name = check.variant(k.name)
        for want in check.EXPECTED[name].get(k.arch, ()):
            assert any(op.startswith(want) for op in k.instructions), (k.arch, k.name, k.instructions)
        if "fp8" in name and k.arch == "sm_80":
            assert not k.instructions, (k.name, k.instructions)  # a stub: no FP8 MMA before sm_89
        head_dim, causal, smooth_q = check.mma_flags(k.name)
        assert k.stack <= known_stack(name, k.arch, head_dim, causal, smooth_q), (
            k.arch, check.demangled_short(k.name), k.stack)


@pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not available")
def test_hopper_kernel_uses_wgmma_and_does_not_spill() -> None:
    """On a build with sm_90a, every attention_wgmma instantiation runs QK on IGMMA (INT8) and PV
    on QGMMA (FP8 E4M3) and spills nothing."""
    if "sm_90a" not in ops.build_info().archs:
        pytest.skip("this build has no sm_90a code")
    check = load_checker()
    cuobjdump = check.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton's copy)")
    kernels = [k for k in check.read_kernels(cuobjdump, ops._C.__file__)
               if "attention_wgmma_kernel" in k.name and k.arch == "sm_90"]
    assert len(kernels) == 8  # 2 dtypes x 2 head dims x causal on/off
    for k in kernels:
        for want in check.EXPECTED["attention_wgmma_kernel"]["sm_90"]:
            assert any(op.startswith(want) for op in k.instructions), (k.name, k.instructions)
        # Nothing spills, in the main loop (where it would cost every tile) or around it (the
        # item's state, reloaded per item: the causal head_dim 128 variant had a 24-byte frame
        # until the masked last tile left the loop, benchmarks/RESULTS.md session 7).
        assert k.loop_spills == 0, (k.name, k.loop_spills)
        assert k.stack == 0, (k.name, k.stack)
        # ptxas's schedule of the KV loop: no long run of MUFUs with nothing beside them (x21-x42
        # in the builds that measured 3-9 % slower in session 17, 2-3 in the kept one). A new
        # compiler that reorders the loop shows here before it shows in a benchmark.
        assert k.loop_mufu_run <= 8, (k.name, k.loop_mufu_run)


def test_loop_finder_and_wgmma_loop_events() -> None:
    """check_sass.main_loop picks the innermost loop holding both products (not the outer loop,
    not a loop of one kind), and scripts/wgmma_loop_sass.py's event line says where the waits
    fall between the softmax's exponentials (merged runs, commits only for the gsb0 MMAs), and
    the longest run of back-to-back MUFUs it reports."""
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
        (0x080, "MUFU.EX2 R6, R7"),
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
    script = load_loop_script()
    assert script.events(loop) == "commit x2 | wait<=1 | EX2 | LDL | EX2 x2 | wait<=0 | STS"
    assert checker.longest_mufu_run(loop) == 2  # the LDL breaks the first run


def test_traced_kernel_script_applies_to_the_header(tmp_path: Path) -> None:
    """scripts/make_traced_kernel.py (the per-item phase trace of scripts/device_trace_wgmma.sh)
    patches csrc/attention_wgmma_kernel.cuh at anchor lines; a kernel change that moves one must
    update the script, which stops with an AssertionError otherwise (session 17's early K scale
    did, unnoticed until review)."""
    traced = traced_header(tmp_path, "make_traced_kernel.py")
    # Every stamp the trace reader expects: slots 0-15 of an item's record are written somewhere.
    for slot in range(16):
        assert f"tr[{slot}]" in traced, slot


def test_tile_traced_kernel_script_applies_to_the_header(tmp_path: Path) -> None:
    """The same for scripts/make_tile_traced_kernel.py (the per-tile trace of
    scripts/device_trace_tiles.sh): it applies, and it writes the four stamps per tile that
    scripts/trace_wgmma_tiles.py reads."""
    traced = traced_header(tmp_path, "make_tile_traced_kernel.py")
    for slot in range(4):
        assert f"tr[{slot}] = tile_trace_clock()" in traced, slot
    assert "if (false) {" in traced  # the LSE stores are gone: the buffer holds the stamps


def test_stall_cycles_reads_the_control_bits() -> None:
    """scripts/wgmma_loop_sass.py's stall_cycles on two instructions as cuobjdump prints them
    (from an sm_90a build): MUFU.EX2 with 8 stall cycles encoded, EXIT with 5."""
    script = load_loop_script()
    sass = (
        "        /*00d0*/                   MUFU.EX2.F16 R6, R0 ;                                  /* 0x0000000000067308 */\n"
        "                                                                                          /* 0x000ff00000000900 */\n"
        "        /*0140*/                   EXIT ;                                                 /* 0x000000000000794d */\n"
        "                                                                                          /* 0x000fea0003800000 */\n"
    )
    assert script.stall_cycles(sass) == {0xD0: 8, 0x140: 5}
