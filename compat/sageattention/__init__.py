"""sageattention2's drop-in for the authors' ``sageattention`` package: their function names and
keywords, our kernels (the mapping: :mod:`sageattention2.compat`). Installed by
``pip install --no-build-isolation ./compat``; it replaces the authors' distribution of the same
name, and warns at import where the authors' package is still around."""
import os as _os

from sageattention2.compat import (COMPAT_VERSION as __version__, sageattn,
                                   sageattn_qk_int8_pv_fp16_cuda, sageattn_qk_int8_pv_fp16_triton,
                                   sageattn_qk_int8_pv_fp8_cuda, sageattn_qk_int8_pv_fp8_cuda_sm90,
                                   sageattn_varlen, warn_about_installation as _warn)

__all__ = ["sageattn", "sageattn_qk_int8_pv_fp16_cuda", "sageattn_qk_int8_pv_fp16_triton",
           "sageattn_qk_int8_pv_fp8_cuda", "sageattn_qk_int8_pv_fp8_cuda_sm90", "sageattn_varlen"]

_warn(_os.path.dirname(__file__))
