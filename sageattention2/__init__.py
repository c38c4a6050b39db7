"""SageAttention2: quantized attention (INT8/INT4 QK^T, FP8 PV) for PyTorch.

``sageattn`` is a drop-in replacement for ``torch.nn.functional.scaled_dot_product_attention``,
``sageattn_varlen`` takes packed sequences as ``flash_attn_varlen_func`` does;
``explain(...)`` says what it runs for a call and why, ``kernel_plan()`` what it runs on a device;
``python -m sageattention2 info`` reports the build.
"""
from ._version import __version__
from .api import Explanation, SageAttentionFallbackWarning, explain, kernel_plan, sageattn
from ._varlen import sageattn_varlen

__all__ = ["Explanation", "SageAttentionFallbackWarning", "__version__", "explain", "kernel_plan",
           "sageattn", "sageattn_varlen"]
