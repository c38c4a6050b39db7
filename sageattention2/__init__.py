"""SageAttention2: quantized attention (INT8/INT4 QK^T, FP8 PV) for PyTorch.

``sageattn`` is a drop-in replacement for ``torch.nn.functional.scaled_dot_product_attention``,
``sageattn_varlen`` takes packed sequences as ``flash_attn_varlen_func`` does;
``explain(...)`` says what it runs for a call and why, ``kernel_plan()`` what it runs on a device;
``calibrate(model, run, budget)`` and ``apply_plan(model, plan)`` choose each attention call
site's variant from measurements (``sageattention2.adaptive``);
``python -m sageattention2 info`` reports the build.
"""
from ._version import __version__
from .api import Explanation, SageAttentionFallbackWarning, explain, kernel_plan, sageattn
from ._varlen import sageattn_varlen
from .adaptive import Plan, apply_plan, calibrate

__all__ = ["Explanation", "Plan", "SageAttentionFallbackWarning", "__version__", "apply_plan",
           "calibrate", "explain", "kernel_plan", "sageattn", "sageattn_varlen"]
