"""sageattn's argument validation (the one validator, ``_call.validate``): what each bad argument
raises, how the options resolve, the canonical views; and empty inputs, which return without
computing anything."""
from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from helpers import fallback_warnings, hnd, qkv, sdpa_in_layout, validated
from sageattention2 import sageattn

# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------

Q, K, V = qkv()
META_V = torch.empty(V.shape, device="meta")


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((Q.tolist(), K, V), {}, TypeError, r"^query must be a torch\.Tensor, got list"),
        ((Q, None, V), {}, TypeError, r"^key must be a torch\.Tensor"),
        ((Q, K, 3.0), {}, TypeError, r"^value must be a torch\.Tensor"),
        ((Q.int(), K.int(), V.int()), {}, TypeError, r"^query must be float16, bfloat16.*torch\.int32"),
        ((Q, K.double(), V), {}, TypeError,
         r"^key has dtype torch\.float64 but query has torch\.float32"),
        ((Q, K, V.half()), {}, TypeError, r"^value has dtype"),
        ((Q, K, META_V), {}, ValueError, r"^value is on meta but query is on cpu"),
        ((Q[0, 0], K[0, 0], V[0, 0]), {}, ValueError, r"^query must be 3-D or 4-D"),
        ((Q[None], K[None], V[None]), {}, ValueError, r"^query must be 3-D or 4-D.*\[B, H, N, D\]"),
        ((Q, K, V), {"tensor_layout": "NHD", "q": Q[0, 0]}, ValueError,
         r"^query must be 3-D or 4-D \(\[B, N, H, D\] or \[N, H, D\]"),
        ((Q, K[0], V), {}, ValueError, r"^key is 3-D but query is 4-D"),
        ((Q, K[:1], V[:1]), {}, ValueError, r"same batch size"),
        ((Q, K, V[:, :2]), {"enable_gqa": True}, ValueError, r"^key and value must have the same number "
                                                             r"of heads"),
        ((Q, K[:, :2], V[:, :2]), {}, ValueError, r"^query has 4 heads but key and value have 2; pass "
                                                  r"enable_gqa=True"),
        ((Q, K[:, :3], V[:, :3]), {"enable_gqa": True}, ValueError,
         r"^enable_gqa=True needs query's number of heads \(4\) to be a multiple"),
        ((Q, K[..., :8], V), {}, ValueError, r"^query and key must have the same head_dim, got 16 and 8"),
        ((Q, K, V[:, :, :5]), {}, ValueError, r"^key and value must have the same sequence length"),
        ((Q, K, V), {"tensor_layout": "BHND"}, ValueError,
         r"^tensor_layout must be one of 'HND', 'NHD'; got 'BHND'"),
        ((Q, K, V), {"tensor_layout": None}, ValueError, r"^tensor_layout must be one of"),
        ((Q, K, V), {"qk_quant": "fp8"}, ValueError,
         r"^qk_quant must be one of 'auto', 'int8', 'int4'; got 'fp8'"),
        ((Q, K, V), {"pv_quant": "e4m3"}, ValueError,
         r"^pv_quant must be one of 'auto', 'fp8', 'none'; got 'e4m3'"),
        ((Q, K, V), {"pv_quant": None}, ValueError, r"^pv_quant must be one of"),
        ((Q, K, V), {"pv_quant": False}, ValueError, r"^pv_quant must be one of .*; got False"),
        ((Q, K, V), {"smooth_q": "token"}, ValueError,
         r"^smooth_q must be True, False, 'auto', 'head' or 'block'; got 'token'"),
        ((Q, K, V), {"smooth_q": 1}, ValueError, r"^smooth_q must be"),
        ((Q, K, V), {"is_causal": True, "attn_mask": torch.ones(9, 9, dtype=torch.bool)},
         ValueError, r"^attn_mask and is_causal=True are mutually exclusive"),
        ((Q, K, V), {"dropout_p": 1.0}, ValueError, r"^dropout_p must be in \[0, 1\), got 1.0"),
        ((Q, K, V), {"dropout_p": -0.1}, ValueError, r"^dropout_p must be in \[0, 1\)"),
        ((Q, K, V), {"dropout_p": math.nan}, ValueError, r"^dropout_p must be in \[0, 1\)"),
        ((Q, K, V), {"dropout_p": "0.1"}, TypeError, r"^dropout_p must be a real number"),
        ((Q, K, V), {"scale": "1"}, TypeError, r"^scale must be a real number"),
        ((Q, K, V), {"scale": math.inf}, ValueError, r"^scale must be finite or None"),
        ((Q, K, V), {"attn_mask": [[True]]}, TypeError, r"^attn_mask must be a torch\.Tensor or "
                                                        r"None"),
        ((Q, K, V), {"attn_mask": torch.ones(9, 9, dtype=torch.int64)}, TypeError,
         r"^attn_mask must be bool, float32 or query's dtype"),
        ((Q, K, V), {"attn_mask": torch.ones(9, 9, device="meta")}, ValueError,
         r"^attn_mask is on meta but query is on cpu"),
        ((Q, K, V), {"attn_mask": torch.ones(9, 8, dtype=torch.bool)}, ValueError,
         r"^attn_mask of shape \(9, 8\) does not broadcast to the attention shape \(2, 4, 9, 9\)"),
        ((Q, K, V), {"attn_mask": torch.ones(3, 4, 9, 9, dtype=torch.bool)}, ValueError,
         r"^attn_mask of shape"),
        ((Q[0], K[0], V[0]), {"attn_mask": torch.ones(1, 4, 9, 9, dtype=torch.bool)}, ValueError,
         r"^attn_mask of shape \(1, 4, 9, 9\) does not broadcast to the attention shape "
         r"\(4, 9, 9\)"),
        ((Q, K, V), {"is_causal": 1}, TypeError, r"^is_causal must be a bool, got int"),
        ((Q, K, V), {"enable_gqa": "yes"}, TypeError, r"^enable_gqa must be a bool"),
        ((Q, K, V), {"smooth_k": None}, TypeError, r"^smooth_k must be a bool"),
        ((Q, K, V), {"smooth_v": 0}, ValueError, r"^smooth_v must be True, False or 'auto'; got 0"),
        ((Q, K, V), {"smooth_v": "on"}, ValueError, r"^smooth_v must be True, False or 'auto'"),
        ((Q, K, V), {"return_lse": "no"}, TypeError, r"^return_lse must be a bool"),
        ((Q, K, V), {"strict": 1.0}, TypeError, r"^strict must be a bool"),
    ],
)
def test_invalid_arguments(args: tuple[Any, ...], kwargs: dict[str, Any],
                           error: type[Exception], match: str) -> None:
    kwargs = dict(kwargs)
    if "q" in kwargs:  # replace q positionally
        args = (kwargs.pop("q"), *args[1:])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(error, match=match):
            sageattn(*args, **kwargs)
    assert not fallback_warnings(record)  # validation happens before any fallback


def test_smooth_q_qk_quant_and_pv_quant_resolution() -> None:
    q, k, v = qkv()
    assert validated(q, k, v).qk_quant == "int8"
    assert validated(q, k, v, qk_quant="int4", smooth_q=True).qk_quant == "int4"
    # "auto" stays for the kernel to decide (none on the Hopper kernel, "head" on the warp-level).
    assert [validated(q, k, v, smooth_q=m).smooth_q for m in ("auto", True, False, "head",
                                                               "block")] == [
        "auto", "head", "none", "head", "block"]
    # pv_quant "auto" stays too: FP8 or the input dtype depends on the GPU (_plan.ROUTES).
    assert [validated(q, k, v, pv_quant=m).pv_quant for m in ("auto", "fp8", "none")] == [
        "auto", "fp8", "none"]
    assert validated(q, k, v).pv_quant == "auto"


def test_canonical_views_do_not_copy() -> None:
    q, k, v = qkv(layout="NHD")
    call = validated(q, k, v, tensor_layout="NHD")
    assert call.q.shape == (2, 4, 9, 16)
    assert call.q.data_ptr() == q.data_ptr() and call.q._base is q
    call3 = validated(q[0], k[0], v[0], tensor_layout="NHD")
    assert call3.q.shape == (1, 4, 9, 16) and call3.q.data_ptr() == q.data_ptr()


# ------------------------------------------------------------------------------------------------
# Empty tensors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize(
    "shape",
    [dict(b=0), dict(hq=0), dict(nq=0), dict(nk=0), dict(nq=0, nk=0), dict(dv=0),
     dict(b=None, nk=0), dict(hq=4, hkv=2, nk=0)],
    ids=["b0", "h0", "nq0", "nk0", "nq0-nk0", "dv0", "3d-nk0", "gqa-nk0"],
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_inputs(layout: str, shape: dict[str, Any], is_causal: bool) -> None:
    q, k, v = qkv(layout=layout, **shape)
    gqa = q.shape[-3 if layout == "HND" else -2] != k.shape[-3 if layout == "HND" else -2]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out, lse = sageattn(q, k, v, is_causal=is_causal, enable_gqa=gqa, tensor_layout=layout,
                            return_lse=True, strict=True)
    assert not fallback_warnings(record)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert not out.any()  # zeros when there are no keys
    if shape.get("hq") != 0:  # SDPA itself dies of SIGFPE on CPU with zero heads (torch 2.11)
        assert torch.equal(out, sdpa_in_layout(q, k, v, layout, is_causal=is_causal,
                                               enable_gqa=gqa))
    q4 = hnd(q, layout)
    assert lse.shape == q4.shape[:-1] and lse.dtype == torch.float32
    assert torch.isneginf(lse).all()


@pytest.mark.parametrize("head_dim,want", [(64, False), (128, False), (136, True), (256, True)])
def test_smooth_v_auto_is_on_above_head_dim_128(head_dim: int, want: bool) -> None:
    """smooth_v="auto" (the default) subtracts V's mean where the Hopper kernel's one FP8 scale
    per V tile spans 256 channels (head_dim above 128, padded to 256; docs/DECISIONS.md#d42),
    not at 128 and below; True and False are kept as given, and the kernel call gets the
    resolved flag."""
    from sageattention2 import _execute, _plan

    q = torch.zeros(1, 2, 16, head_dim, dtype=torch.float16)
    call = validated(q, q, q)
    assert call.smooth_v is want
    assert _execute.KernelCall.of(call, _plan.WGMMA).smooth_v is want
    for given in (False, True):
        assert validated(q, q, q, smooth_v=given).smooth_v is given
