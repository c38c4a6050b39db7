"""The routing rules (``_plan``): which kernel serves a call and why a call falls back, on this
machine and on pretended GPUs and builds; kernel_plan; and README.md's routing table, which must
be the rules' rendering."""
from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from helpers import (DEFAULT_BUILD, MMA_FP8_KEY, MMA_KEY, OLD_BUILD, PREPROCESS_KEY, REPO,
                     SM80_BUILD, WGMMA_KEY, pretend_gpu, qkv, skip_device_rules, validated)
import sageattention2
from sageattention2 import SageAttentionFallbackWarning, _plan, kernel_plan, ops, sageattn
from sageattention2._call import AttentionCall

@pytest.mark.parametrize(
    ("dtype", "shape", "kwargs", "reason"),
    [
        (torch.float32, {}, {}, "float16 or bfloat16 inputs, got torch.float32"),
        (torch.float64, {}, {}, "got torch.float64"),
        (torch.float16, {}, {"dropout_p": 0.1}, "no dropout (dropout_p > 0)"),
        (torch.bfloat16, {}, {"attn_mask": torch.ones(9, 9, dtype=torch.bool).tril()}, "no attn_mask"),
        (torch.float16, {"d": 12}, {},
         "the attention kernels are built for head_dim 64, 128, 256 (256: the Hopper kernel with "
         "FP8 PV; other multiples of 8 below 256 are zero-padded to the next), got 12"),
        (torch.float16, {"d": 264}, {}, "built for head_dim 64, 128, 256 (256: the Hopper kernel "
                                        "with FP8 PV; other multiples of 8 below 256 are "
                                        "zero-padded to the next), got 264"),
        (torch.float16, {"d": 260}, {}, "got 260"),
        (torch.float16, {"dv": 32}, {}, "v's head_dim to be q's and k's, got 32 and 16"),
        (torch.float16, {}, {"requires_grad": True}, "require grad"),
        (torch.float16, {}, {}, None),  # head_dim 16: zero-padded to 64
        (torch.float16, {"d": 8}, {}, None),
        (torch.float16, {"d": 64}, {}, None),
        (torch.bfloat16, {"d": 96}, {}, None),
        (torch.float16, {"d": 128}, {}, None),
    ],
)
def test_unsupported_reasons(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                             shape: dict[str, Any], kwargs: dict[str, Any],
                             reason: str | None) -> None:
    """The reasons after the device rules, in order (pretending the CPU were a CUDA device)."""
    skip_device_rules(monkeypatch)
    q, k, v = qkv(dtype=dtype, **shape)
    kwargs = dict(kwargs)
    if kwargs.pop("requires_grad", False):
        q.requires_grad_()
    call = validated(q, k, v, **kwargs)
    if reason is not None:
        assert reason in str(_plan.route(call)[1])
    elif not ops.HAS_EXTENSION:
        assert "extension is not available" in str(_plan.route(call)[1])
    elif not ops.has_op("attention_mma"):
        assert "attention kernels are not built yet" in str(_plan.route(call)[1])
    else:
        assert _plan.route(call)[1] is None
    if kwargs == {} and q.requires_grad:
        with torch.no_grad():  # without grad tracking the quantized path could serve it
            assert "require grad" not in str(_plan.route(call)[1])


@pytest.mark.parametrize(
    ("head_dim", "kernel_head_dim"),
    [(8, 64), (16, 64), (32, 64), (56, 64), (64, 64), (72, 128), (80, 128), (96, 128),
     (120, 128), (128, 128), (136, None), (256, None), (12, None), (0, None), (100, None)],
)
def test_kernel_head_dim(head_dim: int, kernel_head_dim: int | None) -> None:
    """The head_dim the kernels run: the next built one (64, 128) for a multiple of 8."""
    assert _plan.kernel_head_dim(head_dim) == kernel_head_dim
    if kernel_head_dim is not None:  # up to 128 the Hopper kernel pads alike
        assert _plan.kernel_head_dim(head_dim, _plan.head_dims_of(WGMMA)) == kernel_head_dim


@pytest.mark.parametrize(("head_dim", "hopper"),
                         [(136, 256), (160, 256), (192, 256), (256, 256), (264, None), (100, None)])
def test_hopper_head_dims_above_128(head_dim: int, hopper: int | None) -> None:
    """The Hopper kernel's FP8 tier is built for 256 as well (160 and 192 padded to it); its
    accurate tier and the warp-level kernel stop at 128."""
    assert _plan.kernel_head_dim(head_dim, _plan.head_dims_of(WGMMA)) == hopper
    for choice in (WGMMA_INPUT, MMA_INT8_FP8, MMA_INT8_INPUT, MMA_INT4_FP8):
        assert _plan.kernel_head_dim(head_dim, _plan.head_dims_of(choice)) is None


def test_build_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build rules (on a device the device rules let through)."""
    skip_device_rules(monkeypatch)
    cpu = torch.device("cpu")
    if ops.HAS_EXTENSION:
        assert ops.has_op("smoothing_stats") and not ops.has_op("no_such_op")
        with monkeypatch.context() as m:
            m.setattr(ops, "has_op", lambda name: False)
            m.setattr(ops, "_OP_HANDLES", {})  # the handles ops resolved at import
            assert _plan.device_reason(cpu) == "the attention kernels are not built yet"
            q, k, v = qkv(d=64, dtype=torch.float16)
            with pytest.raises(RuntimeError, match="has no attention_mma op"):
                ops.attention_mma(q, None, k, k, None, v, None, None, None, "int8", 9, 0.125,
                                  False, False, False)
    monkeypatch.setattr(ops, "HAS_EXTENSION", False)
    assert not ops.has_op("smoothing_stats")
    assert _plan.device_reason(cpu) == "the sageattention2._C extension is not available"


# ------------------------------------------------------------------------------------------------
# Which kernel serves a call and what falls back (_plan.route), on pretended GPUs and builds
# ------------------------------------------------------------------------------------------------

WGMMA = _plan.KernelChoice("wgmma", "int8", "fp8")
WGMMA_INPUT = _plan.KernelChoice("wgmma", "int8", "input")
MMA_INT8_FP8 = _plan.KernelChoice("mma", "int8", "fp8")
MMA_INT8_INPUT = _plan.KernelChoice("mma", "int8", "input")
MMA_INT4_FP8 = _plan.KernelChoice("mma", "int4", "fp8")
INT4_NONE = "INT4 QK runs with FP8 PV only; pv_quant='none' needs qk_quant='int8'"
NO_FP8 = "FP8 PV needs an sm_89+ GPU and a build with attention_mma_fp8 code for it"
BLOCK = "smooths Q per head, not per block"
HEAD_DIM_ABOVE_128 = ("the warp-level kernel and the Hopper kernel's accurate tier run head_dim "
                      "up to 128")


def routing_cases() -> list[Any]:
    sm90, sm89, sm86, sm80 = (9, 0), (8, 9), (8, 6), (8, 0)
    cases = [
        # sm_90 with the Hopper build: INT8 + FP8 PV without Q smoothing runs on wgmma.
        (sm90, DEFAULT_BUILD, {}, WGMMA),
        (sm90, DEFAULT_BUILD, {"smooth_q": False}, WGMMA),
        (sm90, DEFAULT_BUILD, {"pv_quant": "fp8"}, WGMMA),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int8", "smooth_k": False}, WGMMA),
        (sm90, DEFAULT_BUILD, {"d": 64}, WGMMA),
        (sm90, DEFAULT_BUILD, {"d": 96}, WGMMA),  # padded to 128
        (sm90, DEFAULT_BUILD, {"d": 32, "smooth_v": True}, WGMMA),  # padded to 64
        # pv_quant="none" (the accurate tier): the Hopper kernel with 16-bit P and V.
        (sm90, DEFAULT_BUILD, {"pv_quant": "none"}, WGMMA_INPUT),
        (sm90, DEFAULT_BUILD, {"pv_quant": "none", "smooth_q": False}, WGMMA_INPUT),
        (sm90, DEFAULT_BUILD, {"pv_quant": "none", "d": 40}, WGMMA_INPUT),  # padded to 64
        (sm90, DEFAULT_BUILD, {"smooth_q": "head"}, MMA_INT8_INPUT),  # FP8 mma.sync emulated
        (sm90, DEFAULT_BUILD, {"smooth_q": True, "pv_quant": "fp8"}, MMA_INT8_FP8),
        (sm90, DEFAULT_BUILD, {"smooth_q": True, "pv_quant": "none"}, MMA_INT8_INPUT),
        (sm90, DEFAULT_BUILD, {"d": 80, "smooth_q": "head"}, MMA_INT8_INPUT),
        (sm90, DEFAULT_BUILD, {"d": 80, "smooth_q": "head", "pv_quant": "fp8"}, MMA_INT8_FP8),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int4"}, MMA_INT4_FP8),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int4", "smooth_q": False}, MMA_INT4_FP8),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int4", "pv_quant": "fp8", "d": 96}, MMA_INT4_FP8),
        (sm90, DEFAULT_BUILD, {"qk_quant": "int4", "pv_quant": "none"}, INT4_NONE),
        (sm90, DEFAULT_BUILD, {"smooth_q": "block"}, BLOCK),
        (sm90, DEFAULT_BUILD, {"smooth_q": "block", "qk_quant": "int4"}, BLOCK),
        # head_dim 136-256: the Hopper kernel with FP8 PV (padded to 256), nothing else.
        (sm90, DEFAULT_BUILD, {"d": 256}, WGMMA),
        (sm90, DEFAULT_BUILD, {"d": 160, "pv_quant": "fp8"}, WGMMA),
        (sm90, DEFAULT_BUILD, {"d": 192, "pv_quant": "none"}, HEAD_DIM_ABOVE_128),
        (sm90, DEFAULT_BUILD, {"d": 256, "smooth_q": "head"}, HEAD_DIM_ABOVE_128),
        (sm90, DEFAULT_BUILD, {"d": 256, "qk_quant": "int4"}, HEAD_DIM_ABOVE_128),
        (sm89, DEFAULT_BUILD, {"d": 136}, HEAD_DIM_ABOVE_128),
        # sm_90 without the Hopper kernel in the build: the warp-level kernel, FP16 PV unless
        # FP8 is asked for (FP8 mma.sync is emulated on sm_90).
        (sm90, {k: v for k, v in DEFAULT_BUILD.items() if k != WGMMA_KEY}, {}, MMA_INT8_INPUT),
        (sm90, {k: v for k, v in DEFAULT_BUILD.items() if k != WGMMA_KEY}, {"pv_quant": "fp8"},
         MMA_INT8_FP8),
        # A build from before the FP8 variants: FP16/BF16 PV everywhere, INT4 falls back.
        (sm90, OLD_BUILD, {"smooth_q": "head"}, MMA_INT8_INPUT),
        (sm90, OLD_BUILD, {"qk_quant": "int4"}, NO_FP8),
        (sm89, OLD_BUILD, {}, MMA_INT8_INPUT),
        # sm_89 (Ada): FP8 tensor cores, no wgmma.
        (sm89, DEFAULT_BUILD, {}, MMA_INT8_FP8),
        (sm89, DEFAULT_BUILD, {"smooth_q": False}, MMA_INT8_FP8),
        (sm89, DEFAULT_BUILD, {"pv_quant": "fp8"}, MMA_INT8_FP8),
        (sm89, DEFAULT_BUILD, {"pv_quant": "none"}, MMA_INT8_INPUT),
        (sm89, DEFAULT_BUILD, {"qk_quant": "int4"}, MMA_INT4_FP8),
        (sm89, DEFAULT_BUILD, {"qk_quant": "int4", "smooth_q": False, "d": 32}, MMA_INT4_FP8),
        (sm89, DEFAULT_BUILD, {"qk_quant": "int4", "pv_quant": "none"}, INT4_NONE),
        (sm89, DEFAULT_BUILD, {"smooth_q": "block"}, BLOCK),
        # sm_80/86: no FP8 tensor cores: PV in the input dtype; FP8 PV and INT4 fall back.
        (sm80, DEFAULT_BUILD, {}, MMA_INT8_INPUT),
        (sm86, DEFAULT_BUILD, {}, MMA_INT8_INPUT),
        (sm80, DEFAULT_BUILD, {"smooth_q": False}, MMA_INT8_INPUT),
        (sm80, DEFAULT_BUILD, {"pv_quant": "none", "d": 96}, MMA_INT8_INPUT),
        (sm80, DEFAULT_BUILD, {"pv_quant": "fp8"}, NO_FP8),
        (sm86, DEFAULT_BUILD, {"qk_quant": "int4"}, NO_FP8),
        (sm80, DEFAULT_BUILD, {"qk_quant": "int4", "pv_quant": "none"}, INT4_NONE),
        (sm80, DEFAULT_BUILD, {"smooth_q": "block"}, BLOCK),
        (sm80, SM80_BUILD, {}, MMA_INT8_INPUT),
        # The build has no attention code for this GPU at all.
        (sm89, SM80_BUILD | {MMA_KEY: ["sm_90a"]}, {}, "not compiled for sm_89"),
        ((13, 0), DEFAULT_BUILD, {}, "not compiled for sm_130 (built for sm_80, sm_86, sm_89, "
                                     "sm_90a, sm_100, sm_120)"),
        ((12, 0), SM80_BUILD, {}, "not compiled for sm_120 (built for sm_80)"),
        # Older than the kernels: exact SDPA, whatever the build.
        ((7, 5), DEFAULT_BUILD, {}, "compute capability 8.0 or newer, got sm_75"),
        # Consumer Blackwell (sm_120, and sm_121 on sm_120's code): native FP8 mma.sync as on
        # Ada, INT4 QK with FP8 PV only when asked; datacenter Blackwell (sm_100, sm_103): FP8
        # mma.sync emulated there (its FP8 tensor cores are tcgen05's), so FP16/BF16 PV.
        ((12, 0), DEFAULT_BUILD, {}, MMA_INT8_FP8),
        ((12, 1), DEFAULT_BUILD, {}, MMA_INT8_FP8),
        ((12, 0), DEFAULT_BUILD, {"pv_quant": "none"}, MMA_INT8_INPUT),
        ((12, 0), DEFAULT_BUILD, {"qk_quant": "int4"}, MMA_INT4_FP8),
        ((10, 0), DEFAULT_BUILD, {}, MMA_INT8_INPUT),
        ((10, 3), DEFAULT_BUILD, {}, MMA_INT8_INPUT),
        ((10, 0), DEFAULT_BUILD, {"pv_quant": "fp8"}, MMA_INT8_FP8),
        ((8, 7), DEFAULT_BUILD, {}, MMA_INT8_INPUT),
    ]
    names = {id(DEFAULT_BUILD): "default", id(SM80_BUILD): "sm80-build", id(OLD_BUILD): "old-build"}
    params = []
    for capability, build, options, want in cases:
        tag = "-".join([f"sm{capability[0]}{capability[1]}", names.get(id(build), "other-build"),
                        *(f"{k}={v}" for k, v in options.items())])
        params.append(pytest.param(capability, build, options, want, id=tag))
    return params


@pytest.mark.parametrize(("capability", "build", "options", "want"), routing_cases())
def test_kernel_routing(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                        build: dict[str, list[str]], options: dict[str, Any],
                        want: _plan.KernelChoice | str) -> None:
    """Which kernel and precisions serve a float16 call on a GPU of ``capability`` with a build
    of ``build``'s kernel families, or why it falls back: wgmma for INT8 + FP8 PV without Q
    smoothing on sm_90; else the warp-level kernel, with FP8 PV where asked for, for INT4, or
    for pv_quant="auto" where the build's FP8 code runs (sm_89+); PV in the input dtype else."""
    pretend_gpu(monkeypatch, capability, build)
    options = dict(options)
    q, k, v = qkv(d=options.pop("d", 128), dtype=torch.float16)
    call = validated(q, k, v, **options)
    choice, reason = _plan.route(call)
    explanation = sageattention2.explain(q, k, v, **options)  # says the same, in public terms
    if isinstance(want, str):
        assert reason is not None and want in reason, reason
        assert explanation == (False, "exact SDPA", None, None, reason)
        assert str(explanation) == f"exact SDPA: {reason}"
        return
    assert reason is None, reason
    assert choice == want
    assert explanation == (True, f"attention_{want.kernel}", want.qk, want.pv, None)


def test_fp8_reason_names_the_gpu_and_build(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_gpu(monkeypatch, (8, 6), DEFAULT_BUILD)
    q, k, v = qkv(d=64, dtype=torch.float16)
    _, reason = _plan.route(validated(q, k, v, qk_quant="int4"))
    assert reason == (f"{NO_FP8} (qk_quant='int4' (INT4 QK runs with FP8 PV only)); this GPU is "
                      "sm_86, attention_mma_fp8 is built for sm_89, sm_90a, sm_100, sm_120")
    _, reason = _plan.route(validated(q, k, v, pv_quant="fp8"))
    assert reason is not None and "(pv_quant='fp8'); this GPU is sm_86" in reason


@pytest.mark.parametrize(
    ("capability", "build", "starts", "contains"),
    [
        ((9, 0), DEFAULT_BUILD, f"quantized SageAttention2: {_plan.WGMMA_PLAN}, head_dim 64, 128, "
                                f"256 (256: FP8 PV only",
         [f"the {_plan.MMA_PLAN} for smooth_q='head'/True", "INT8 QK + FP8 PV",
          "INT4 QK + FP8 PV with qk_quant='int4'", f"{MMA_FP8_KEY} [sm_90a]"]),
        ((8, 9), DEFAULT_BUILD, f"quantized SageAttention2: {_plan.MMA_PLAN}: INT8 QK + FP8 PV",
         ["INT4 QK + FP8 PV with qk_quant='int4'", "zero-padded",
          f"kernels for sm_89: {PREPROCESS_KEY} [sm_80, sm_86, sm_89], {MMA_KEY} [sm_80, sm_86, "
          f"sm_89], {MMA_FP8_KEY} [sm_89]"]),
        ((8, 0), DEFAULT_BUILD,
         f"quantized SageAttention2: {_plan.MMA_PLAN}: INT8 QK + FP16/BF16 PV (FP8 PV and INT4 QK "
         "need sm_89+)", [f"kernels for sm_80: {PREPROCESS_KEY} [sm_80], {MMA_KEY} [sm_80]"]),
        ((12, 0), DEFAULT_BUILD, f"quantized SageAttention2: {_plan.MMA_PLAN}: INT8 QK + FP8 PV",
         [f"kernels for sm_120: {PREPROCESS_KEY} [sm_120], {MMA_KEY} [sm_120], "
          f"{MMA_FP8_KEY} [sm_120]"]),
        ((13, 0), DEFAULT_BUILD, "exact SDPA fallback (the attention kernel is not compiled for "
                                 "sm_130", ["no kernels compiled for sm_130"]),
    ],
    ids=["sm90", "sm89", "sm80", "sm120", "sm130"],
)
def test_kernel_plan_on_pretended_gpus(monkeypatch: pytest.MonkeyPatch,
                                       capability: tuple[int, int], build: dict[str, list[str]],
                                       starts: str, contains: list[str]) -> None:
    pretend_gpu(monkeypatch, capability, build)
    plan = kernel_plan("cuda:0")
    assert plan.startswith(starts), plan
    for text in contains:
        assert text in plan, (text, plan)
    if capability < (8, 9):
        assert "INT4 QK + FP8 PV" not in plan and "INT8 QK + FP8 PV" not in plan


@pytest.mark.parametrize(
    "options",
    [{}, {"smooth_q": False}, {"smooth_q": True}, {"smooth_q": "head"}, {"smooth_q": "block"},
     {"qk_quant": "int4"}, {"qk_quant": "int8", "d": 64}, {"d": 96}, {"pv_quant": "fp8"},
     {"pv_quant": "none"}, {"qk_quant": "int4", "pv_quant": "none"}],
)
def test_kernel_for_cpu_calls_is_mma(monkeypatch: pytest.MonkeyPatch,
                                     options: dict[str, Any]) -> None:
    """CPU tensors never go to the Hopper kernel, "auto" PV is the input dtype there (no FP8
    tensor cores to ask about), and choosing the kernel never touches torch.cuda (nor the
    cached capability) for them."""
    def no_cuda(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("routing touched torch.cuda or the GPU's build for a CPU call")

    for name in ("is_available", "current_device", "get_device_capability", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(_plan, "_capability", no_cuda)
    for name in ("build_info", "family_runs_on", "kernels_for_capability"):  # a GPU's probes
        monkeypatch.setattr(ops, name, no_cuda)
    options = dict(options)
    q, k, v = qkv(d=options.pop("d", 128), dtype=torch.float16)
    call = validated(q, k, v, **options)
    qk = options.get("qk_quant", "int8")
    fp8 = options.get("pv_quant") == "fp8" or qk == "int4"
    assert _plan.route(call)[0] == _plan.KernelChoice("mma", qk, "fp8" if fp8 else "input")


def test_host_path_asks_cuda_and_picks_the_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's host work is measured in microseconds at short sequences (docs/DECISIONS.md#d19):
    whether CUDA is available is asked once per process, not per call, and sageattn picks the kernel
    once per call (the fallback decision and the run share the pick)."""
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(_plan, "_capability", lambda index: (9, 0))
    _plan._cuda_available.cache_clear()
    try:
        for _ in range(3):
            assert _plan.cuda_capability(torch.device("cuda", 0)) == (9, 0)
        assert len(asked) == 1
    finally:
        _plan._cuda_available.cache_clear()  # the next caller asks the real torch.cuda again
    picks: list[AttentionCall] = []
    real = _plan.kernel_for
    monkeypatch.setattr(_plan, "kernel_for",
                        lambda call, target: picks.append(call) or real(call, target))
    q, k, v = qkv(d=64, dtype=torch.float32)  # CPU float32: decided, then the exact fallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SageAttentionFallbackWarning)
        sageattn(q, k, v)
    assert len(picks) == 1


def test_kernel_plan() -> None:
    plan = kernel_plan
    assert plan("cpu") == "exact SDPA fallback (the quantized kernels need CUDA tensors, got cpu)"
    if not torch.cuda.is_available():
        assert plan() == plan("cpu")
        assert plan("cuda") == "exact SDPA fallback (no CUDA GPU is available)"


@pytest.mark.parametrize(
    ("arch", "capability", "runs"),
    [
        ("sm_80", (8, 0), True), ("sm_80", (8, 9), True), ("sm_80", (9, 0), False),
        ("sm_89", (8, 6), False), ("sm_90a", (9, 0), True), ("sm_90a", (10, 0), False),
        ("sm_100f", (10, 3), True), ("sm_100f", (12, 0), False), ("sm_120", (12, 1), True),
        ("compute_80", (9, 0), True), ("compute_90", (8, 9), False), ("compute_90a", (9, 0), True),
        ("bogus", (8, 0), False),
    ],
)
def test_arch_runs_on(arch: str, capability: tuple[int, int], runs: bool) -> None:
    assert ops.arch_runs_on(arch, capability) is runs


# ------------------------------------------------------------------------------------------------
# README.md's routing table
# ------------------------------------------------------------------------------------------------

TABLE_START, TABLE_END = "<!-- routing-table:start -->", "<!-- routing-table:end -->"


def test_readme_routing_table_is_the_rules() -> None:
    """README.md's "Which GPU runs what" is exactly what the rules render."""
    readme = (REPO / "README.md").read_text()
    assert readme.count(TABLE_START) == 1 and readme.count(TABLE_END) == 1
    table = readme.split(TABLE_START)[1].split(TABLE_END)[0].strip()
    assert table == _plan.routing_table_markdown(), (
        "README.md's routing table differs from the routing rules: put the output of "
        "`python -m sageattention2 routing-table` between its markers")


@pytest.mark.parametrize("capability", [capability for _, capability in _plan.TABLE_GPUS],
                         ids=[gpu.split()[0] for gpu, _ in _plan.TABLE_GPUS])
def test_routing_table_gpus_are_the_default_build(monkeypatch: pytest.MonkeyPatch,
                                                  capability: tuple[int, int]) -> None:
    """The table's GPUs are what the default build looks like to the rules on them."""
    pretend_gpu(monkeypatch, capability, DEFAULT_BUILD)
    assert _plan.target_of(torch.device("cuda")) == _plan.default_build_target(capability)

