import torch, sys
from torch.profiler import profile, ProfilerActivity
from sageattention2 import sageattn
n = int(sys.argv[1])
q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.float16) for _ in range(3))
for _ in range(3): sageattn(q, k, v, pv_quant="none", strict=True)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(5): sageattn(q, k, v, pv_quant="none", strict=True)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
