"""NaN and Inf stay NaN (issue 34, item 5): a NaN or Inf in q, k or v makes every output element
that SDPA's makes NaN (or Inf) non-finite, on every kernel family, and leaves the heads it cannot
reach finite. The Q and K quantizers' group maxima propagate NaN (ptx::max_nan): a NaN in a group makes
its scale NaN, and every score it touches NaN; V's NaN travels as E4M3's own NaN code (or as
itself, with PV in the input dtype)."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import mma_fp8_on_device, sageattn_no_fallback

pytestmark = pytest.mark.gpu

# sageattn's options that select each kernel family (the kernel forced: short calls would
# otherwise be exact SDPA's under a crossover table; the tests run without one anyway).
FAMILIES: dict[str, dict[str, Any]] = {
    "wgmma int8+fp8": {"qk_quant": "int8"},
    "wgmma int8+input": {"qk_quant": "int8", "pv_quant": "none"},
    "mma int8+input": {"qk_quant": "int8", "pv_quant": "none", "smooth_q": "head"},
    "mma int8+fp8": {"qk_quant": "int8", "pv_quant": "fp8"},
    "mma int4+fp8": {"qk_quant": "int4"},
}


def poisoned(where: str, value: float, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """B2 H4 (KV heads 2) N 300 D 128 bf16 with one ``value`` in head 1 of batch item 0 (of
    query 5, or key 7: channel 3 of V's)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 300, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    if where == "q":
        q[0, 1, 5, 10] = value
    elif where == "k":
        k[0, 1, 7, 10] = value
    else:
        v[0, 1, 7, 3] = value
    return q, k, v


def skip_unless_runs(family: str) -> None:
    from sageattention2 import _plan

    target = _plan.target_of(torch.device("cuda"))
    if family.startswith("wgmma") and not target.wgmma:
        pytest.skip("no Hopper kernel here")
    if family.endswith("fp8") and family.startswith("mma") and not mma_fp8_on_device():
        pytest.skip("no FP8 attention_mma code for this GPU")


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_and_inf_stay_nan(attention_kernel: None, family: str, where: str, value: float,
                              causal: bool) -> None:
    skip_unless_runs(family)
    q, k, v = poisoned(where, value)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out = sageattn_no_fallback(q, k, v, is_causal=causal, enable_gqa=True, **FAMILIES[family])
    poisoned_by_sdpa = ~torch.isfinite(want)  # NaN, or Inf where V holds one
    assert poisoned_by_sdpa.any()  # the poison reaches something
    missed = int(torch.isfinite(out)[poisoned_by_sdpa].sum())
    assert missed == 0, f"{missed} of {int(poisoned_by_sdpa.sum())} elements that SDPA makes " \
                        "NaN or Inf are finite"
    # What it cannot reach: the other batch item, and the heads it is not in (q: query head 1;
    # k, v: KV head 1, which query heads 2 and 3 read).
    assert torch.isfinite(out[1]).all()
    unreached = [0, 2, 3] if where == "q" else [0, 1]
    assert torch.isfinite(out[0, unreached]).all()
