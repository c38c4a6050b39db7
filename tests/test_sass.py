"""The machine code of the built extension, read without a GPU (`scripts/check_sass.py`): every
attention kernel, on every arch it was compiled for, runs its QK product on INT8 tensor cores
(IMMA.16832.S8.S8) and PV on FP16/BF16 tensor cores with FP32 accumulation (HMMA.16816.F32),
and does not spill. This is how the sm_80 and sm_89 builds are checked here: no such GPU exists.
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
    # 2 dtypes x 2 head dims x causal on/off, on every arch of the build.
    assert {k.arch for k in kernels} == built
    assert len(kernels) == 8 * len(built)
    for k in kernels:
        for want in check.EXPECTED["attention_mma_kernel"][k.arch]:
            assert any(op.startswith(want) for op in k.instructions), (k.arch, k.name, k.instructions)
        if "Li64E" in k.name:
            # Known (issue 3): head_dim 64 is capped at 128 registers for two CTAs per SM and
            # spills 40-48 bytes; this bound keeps it from growing unnoticed.
            assert k.stack <= 64, (k.arch, k.name, k.stack)
        else:
            assert k.stack == 0, (k.arch, k.name, k.stack)


@pytest.mark.skipif(not ops.HAS_EXTENSION, reason="compiled extension not available")
def test_hopper_kernel_uses_wgmma_and_does_not_spill() -> None:
    """On a build with sm_90a, every attention_wgmma instantiation runs QK on IGMMA (INT8) and PV
    on QGMMA (FP8 E4M3) and has no stack frame, except the known one below."""
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
        if "Li128ELb0E" in k.name:
            # Known (issue 4, benchmarks/RESULTS.md): the non-causal head_dim 128 variant spills
            # 20 bytes (a 16-byte frame) under its 240 registers; this bound keeps it from growing.
            assert k.stack <= 16, (k.name, k.stack)
        else:
            assert k.stack == 0, (k.name, k.stack)
