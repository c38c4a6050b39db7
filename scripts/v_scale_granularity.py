"""Accuracy of V's FP8 scale granularity alone (CPU, float64): softmax(QK^T) exact, V quantized
to E4M3 per channel over all tokens (the kernels now), per 128-key tile with one scalar, or per
tile and channel; rel. L1 of P V against exact attention on the ANCHORS families (B1 H8 N4096
D128) and a family with V channel outliers (4 channels x30, 4 x0.01, on bias4).

    python3 scripts/v_scale_granularity.py
"""
import torch, math
from sageattention2 import reference as ref
torch.manual_seed(0)
def e4m3(x):  # round to E4M3 with saturation
    return x.clamp(-448,448).to(torch.float8_e4m3fn).double()
for fam in ("bias0","bias4","outliers","v-outlier-channels"):
    g=torch.Generator().manual_seed(1)
    q,k,v=ref.make_input_family("bias4" if fam=="v-outlier-channels" else fam,(1,8,4096,128),generator=g)
    if fam=="v-outlier-channels":
        v=v.clone(); v[...,:4]*=30; v[...,4:8]*=0.01
    q,k,v=(t.double() for t in (q,k,v))
    p=torch.softmax(q@k.transpose(-1,-2)/math.sqrt(128),-1)
    exact=p@v
    # per-channel over all tokens (current)
    sc=v.abs().amax(2,keepdim=True)/448
    vc=e4m3(v/sc)*sc
    # per 128-key tile, one scalar over all channels
    vt=v.view(1,8,32,128,128); st=vt.abs().amax((3,4),keepdim=True)/448
    vtt=(e4m3(vt/st)*st).view_as(v)
    # per 128-key tile, per channel
    stc=vt.abs().amax(3,keepdim=True)/448
    vtc=(e4m3(vt/stc)*stc).view_as(v)
    for name,vq in (("per-channel (now)",vc),("per-tile scalar",vtt),("per-tile per-channel",vtc)):
        o=p@vq
        print(f"{fam:20s} {name:22s} relL1 {float((o-exact).abs().sum()/exact.abs().sum()):.3e}  V relL1 {float((vq-v).abs().sum()/v.abs().sum()):.3e}")
