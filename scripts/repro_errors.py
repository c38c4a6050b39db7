"""Each bad call of the preprocessing ops in its own process (diagnosis of a host crash)."""
import subprocess
import sys

CASES = {
    "misaligned": "flat=torch.empty(1*2*64*128+4,device='cuda',dtype=torch.half); o.quantize_q(flat[4:].view(1,2,64,128),None,128,4,'int8',False,1.0)",
    "head_dim_100": "o.quantize_q(torch.randn(1,2,64,100,device='cuda',dtype=torch.half),None,128,4,'int8',False,1.0)",
    "float32": "o.quantize_q(torch.randn(1,2,64,128,device='cuda'),None,128,4,'int8',False,1.0)",
    "int2": "o.quantize_q(torch.randn(1,2,64,128,device='cuda',dtype=torch.half),None,128,4,'int2',False,1.0)",
    "meta_head_dim_100": "o.quantize_q(torch.randn(1,2,64,100,device='meta',dtype=torch.half),None,128,4,'int8',False,1.0)",
}
for name, code in CASES.items():
    src = f"import torch, sageattention2.ops as o\ntry:\n    {code}\nexcept RuntimeError as e:\n    print('RuntimeError:', str(e).splitlines()[0])"
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True)
    print(f"{name}: rc={r.returncode} {r.stdout.strip()[:200]} {r.stderr.strip()[-300:] if r.returncode else ''}")
