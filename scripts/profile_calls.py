"""A few sageattn calls for Nsight Compute to pick launches from (B4 H32 fp16 randn, HND; used by
scripts/device_ncu.sh and device_full_check.sh PROFILE_PRE=1):
the Hopper path by default, the warp-level INT8 + FP16 PV path with ``--mma``.

    ncu -k regex:quantize_kv --launch-skip 2 --launch-count 1 python3 scripts/profile_calls.py [--mma] N [D]
"""
import argparse

import torch

from sageattention2 import sageattn

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("n", type=int, nargs="?", default=4096)
parser.add_argument("d", type=int, nargs="?", default=128)
parser.add_argument("--mma", action="store_true", help="the warp-level INT8 + FP16 PV path")
parser.add_argument("--causal", action="store_true")
args = parser.parse_args()
q, k, v = (torch.randn(4, 32, args.n, args.d, device="cuda", dtype=torch.float16) for _ in range(3))
kw = dict(pv_quant="none") if args.mma else {}
for _ in range(4):
    sageattn(q, k, v, is_causal=args.causal, strict=True, **kw)
torch.cuda.synchronize()
