"""sageattention2.testing: the accuracy metrics (paper A.7) and the input families
(docs/PROTOCOL.md#input-families)."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import gen
from sageattention2.testing import cosine_similarity, make_input_family, relative_l1, rmse


def test_make_input_family():
    shape = (1, 2, 64, 32)
    q0, k0, v0 = make_input_family("bias0", shape=shape, generator=gen(0))
    assert q0.shape == shape and q0.dtype == torch.float16
    q1, _, _ = make_input_family("bias0", shape=shape, generator=gen(0))
    assert torch.equal(q0, q1)
    q4, k4, v4 = make_input_family("bias4", shape=shape, generator=gen(0))
    offset = (q4.float() - q0.float())  # a per-channel offset shared by all tokens
    assert offset.std(dim=2).max() < 0.02 and offset.abs().mean() > 1.5
    qo, ko, _ = make_input_family("outliers", shape=shape, generator=gen(0))
    big = torch.nonzero((qo != q0).any(dim=(0, 1, 2))).flatten()  # the 6 outlier channels
    assert len(big) == 6
    torch.testing.assert_close(qo[..., big].float(), 12 * q0[..., big].float(), rtol=1e-3, atol=0)
    assert torch.equal(big, torch.nonzero((ko.float().std(dim=2) > 6).all(dim=(0, 1))).flatten())
    with pytest.raises(ValueError):
        make_input_family("nope")


def test_metrics_hand_values():
    o = torch.tensor([1.0, -2.0, 3.0, 0.0])
    assert cosine_similarity(o, o) == pytest.approx(1.0, abs=1e-15)
    assert cosine_similarity(2 * o, o) == pytest.approx(1.0, abs=1e-15)
    assert cosine_similarity(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 0.0
    noisy = o + torch.tensor([0.5, 0.0, -0.5, 1.0])
    assert relative_l1(noisy, o) == pytest.approx(2.0 / 6.0)
    assert rmse(noisy, o) == pytest.approx(math.sqrt(1.5 / 4))
