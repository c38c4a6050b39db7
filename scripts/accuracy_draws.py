"""The accuracy-over-draws table shared by scripts/k_mean_sampling.py and
scripts/v_scale_accuracy.py: the ANCHORS families (B1 H8 N4096 D128 fp16) on the ANCHORS draw
(manual_seed(0), in its order) and on further draws (seeds 1001, 1002, ...), each variant's
rel. L1 / CosSim against float64 attention per draw, then the mean rel. L1 over the draws. One
draw is a noisy verdict; the mean is not."""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from sageattention2 import reference as ref

FAMILIES = ("bias0", "bias4", "outliers")
Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def print_draws(variants: Mapping[str, Variant], draws: int,
                official: Optional[Mapping[tuple[str, bool], tuple[float, float]]] = None) -> None:
    """``variants``: label -> f(q, k, v, causal) giving the output; ``official``: (family,
    causal) -> (CosSim, rel. L1), printed as a last column."""
    extra = " official |" if official else ""
    print("| draw | family | causal | " + " | ".join(variants) + " |" + extra)
    print("|---|---|---|" + "---|" * (len(variants) + bool(official)))
    sums: dict[tuple[str, bool, str], list[float]] = {}
    for draw in range(draws + 1):
        torch.manual_seed(0 if draw == 0 else 1000 + draw)
        families = {name: ref.make_input_family(name, (1, 8, 4096, 128), torch.float16, "cuda")
                    for name in FAMILIES}
        for name, (q, k, v) in families.items():
            for causal in (False, True):
                want = ref.exact_attention(q, k, v, is_causal=causal)
                cells = []
                for label, run in variants.items():
                    out = run(q, k, v, causal)
                    l1, cos = ref.relative_l1(out, want), ref.cosine_similarity(out, want)
                    sums.setdefault((name, causal, label), []).append(l1)
                    cells.append(f"{l1:.5f} / {cos:.6f}")
                if official:
                    cos, l1 = official[name, causal]
                    cells.append(f"{l1:.4f} / {cos:.6f}")
                print(f"| {'ANCHORS' if draw == 0 else draw} | {name} | {causal} | " + " | ".join(cells) + " |",
                      flush=True)
    print(f"\nmean rel. L1 over {draws + 1} draws")
    print("| family | causal | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for name in FAMILIES:
        for causal in (False, True):
            cells = [f"{sum(sums[name, causal, label]) / len(sums[name, causal, label]):.5f}" for label in variants]
            print(f"| {name} | {causal} | " + " | ".join(cells) + " |")
