"""Which kernel serves a :func:`sageattn` call and why a call falls back: the routing rules, as
data.

Every rule is a row with its condition in words and its reason, in two ordered tables:

* :data:`ROUTES`: which kernel serves a call, in which precisions (the first route that applies;
  :func:`kernel_for`);
* :data:`FALLBACKS`: why the quantized kernels cannot serve it (the first rule that applies;
  :func:`unsupported_reason`): the call then runs exact SDPA, and the rule's reason is the text of
  the fallback warning (or of strict's error). The table is four groups, checked in this order:
  the device (:data:`DEVICE_RULES`), the arguments (:data:`CALL_RULES`), the build
  (:data:`BUILD_RULES`), and the limits of the warp-level kernel (:data:`MMA_RULES`; the Hopper
  kernel is only routed calls it serves).

The rules read the validated call and a :class:`Target`: the device the call runs on and what the
loaded build has for it (:func:`target_of` probes it). :func:`route` applies both tables to a call,
:func:`kernel_plan` describes a device, and :func:`routing_table_markdown` renders the tables for
README.md ("Which GPU runs what", which tests/test_routing.py checks;
``python -m sageattention2 routing-table`` prints it).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import torch

from . import _backward, _key_ranges, ops
from ._tensor_memo import MISSING
from ._call import AttentionCall, validate

__all__ = [
    "BUILD_RULES",
    "CALL_RULES",
    "DEFAULT_BUILD",
    "DEVICE_RULES",
    "FALLBACKS",
    "MMA_PLAN",
    "MMA_RULES",
    "ROUTES",
    "TABLE_CALLS",
    "TABLE_GPUS",
    "WGMMA_PLAN",
    "Fallback",
    "KernelChoice",
    "MASK_RULE",
    "Route",
    "Target",
    "cuda_capability",
    "default_build_target",
    "device_reason",
    "family_archs",
    "kernel_for",
    "ANY_KERNEL_HEAD_DIMS",
    "head_dims_of",
    "kernel_head_dim",
    "kernel_plan",
    "native_fp8_mma",
    "probe_target",
    "route",
    "routing_table_markdown",
    "smooths_q",
    "target_of",
    "unsupported_reason",
]

Capability = tuple[int, int]

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MULTIPLE = 8
MIN_CAPABILITY: Capability = (8, 0)  # mma.sync INT8 m16n8k32 and fp16/bf16 m16n8k16, FP32 acc.
# What each attention kernel runs (kernel_plan).
MMA_PLAN = "per-thread quantized QK warp-level kernel (mma.sync)"
WGMMA_PLAN = ("INT8 QK (per-thread, Q quantized in the kernel) + FP8 PV Hopper kernel (wgmma; "
              "pv_quant='none': the same kernel with P and V in the input dtype)")


class KernelChoice(NamedTuple):
    """The attention kernel that serves a call (:func:`kernel_for`) and its precisions.

    ``kernel``: "wgmma" (the Hopper ``attention_wgmma``) or "mma" (the warp-level
    ``attention_mma``); ``qk``: the integer format of Q and K; ``pv``: "fp8" (P~ and V in E4M3,
    paper 3.3) or "input" (P and V in the input dtype, FP32 accumulation).
    """

    kernel: Literal["wgmma", "mma"]
    qk: Literal["int8", "int4"]
    pv: Literal["fp8", "input"]


class Target(NamedTuple):
    """All that the routing rules read of the machine: the device a call runs on and what the
    loaded build has for it (:func:`probe_target`; the README table pretends some)."""

    device_type: str  # "cuda", "cpu", "meta", ...
    capability: Capability | None  # None: not a CUDA device, or no CUDA GPU
    extension: bool  # sageattention2._C is loaded
    attention_op: bool  # and registers attention_mma
    mma_code: bool  # attention_mma code runs on capability (True when there is nothing to check)
    wgmma: bool  # the Hopper path (sageattn_wgmma, attention_wgmma code) runs on capability
    mma_fp8: bool  # attention_mma's FP8 PV variants (INT8 and INT4 QK) run on capability
    native_fp8: bool  # FP8 mma.sync is a native instruction of this GPU (native_fp8_mma)


# ------------------------------------------------------------------------------------------------
# Probing the device and the build
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Capability:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    # torch.cuda.is_available() reads the environment on every call (several microseconds of
    # each sageattn call, which is host-bound at short sequences); it does not change in a process.
    return torch.cuda.is_available()


def cuda_capability(device: torch.device) -> Capability | None:
    """The compute capability of a CUDA ``device``; None for any other device (without touching
    torch.cuda: a CPU call must not initialise CUDA) or when no GPU is available."""
    if device.type != "cuda" or not _cuda_available():
        return None
    return _capability(_cuda_index(device))


def native_fp8_mma(capability: Capability) -> bool:
    """FP8 mma.sync is a native tensor-core instruction (QMMA) on Ada (sm_89) and consumer
    Blackwell (sm_12x); sm_90 has it only emulated (docs/PROTOCOL.md#tensor-core-rates), where
    the INT8 + FP8 variant measured 286 TOPS against 369 for INT8 + FP16 (H100, 4K, hd128, kernel;
    docs/DECISIONS.md#d24)."""
    return capability == (8, 9) or capability[0] == 12


def _mma_code_runs_on(capability: Capability) -> bool:
    """The build has attention_mma code that runs on ``capability``; also True when the build
    reports no attention_mma kernel family at all (nothing to check)."""
    info = ops.build_info()
    if info is None or not any(ops.kernel_family(f) == ops.MMA_FAMILY for f in info.kernels):
        return True
    return ops.family_runs_on(ops.MMA_FAMILY, capability)


def probe_target(device_type: str, capability: Capability | None) -> Target:
    """The :class:`Target` of a device, read from the loaded build now (uncached)."""
    attention_op = ops.has_op("attention_mma")
    if capability is None:  # no GPU to ask the build about
        return Target(device_type, None, ops.HAS_EXTENSION, attention_op, mma_code=True,
                      wgmma=False, mma_fp8=False, native_fp8=False)
    return Target(
        device_type, capability, ops.HAS_EXTENSION, attention_op,
        mma_code=_mma_code_runs_on(capability),
        wgmma=ops.has_op("sageattn_wgmma") and ops.family_runs_on(ops.WGMMA_FAMILY, capability),
        mma_fp8=attention_op and ops.family_runs_on(ops.MMA_FP8_FAMILY, capability),
        native_fp8=native_fp8_mma(capability),
    )


@functools.lru_cache(maxsize=None)
def _cached_target(device_type: str, capability: Capability | None, extension: bool,
                   attention_op: bool) -> Target:
    # extension and attention_op are only part of the key: probe_target reads them itself, and
    # whether the extension loaded is asked on every call, as the build rules always did.
    return probe_target(device_type, capability)


def target_of(device: torch.device) -> Target:
    """The :class:`Target` of a call on ``device`` (probed once per device type and GPU)."""
    return _cached_target(device.type, cuda_capability(device), ops.HAS_EXTENSION,
                          ops.has_op("attention_mma"))


def _arch(capability: Capability | None) -> str:
    assert capability is not None
    return f"sm_{capability[0]}{capability[1]}"


def family_archs(family: str) -> str:
    """The archs the build compiled kernel ``family`` for, as text."""
    info = ops.build_info()
    archs = [] if info is None else [a for key, built in info.kernels.items()
                                     if ops.kernel_family(key) == family for a in built]
    return ", ".join(archs) or "no architectures"


# Every head_dim some kernel runs: 64 and 128 (both kernels), 256 (the Hopper kernel, FP8 PV).
ANY_KERNEL_HEAD_DIMS = tuple(sorted({*ops.MMA_HEAD_DIMS, *ops.WGMMA_HEAD_DIMS}))


@functools.lru_cache(maxsize=None)  # asked twice per call (routes and rules), a few head dims
def kernel_head_dim(head_dim: int, built: tuple[int, ...] = ops.MMA_HEAD_DIMS) -> int | None:
    """The head_dim a kernel built for the head dims ``built`` runs a call of ``head_dim`` at:
    itself when built for it, else the next larger one, the inputs zero-padded (a zero channel
    adds nothing to a score, so scores, softmax and LSE are unchanged, and its output channel, 0,
    is cut off). None when ``head_dim`` is not a positive multiple of 8 or above the largest."""
    if head_dim <= 0 or head_dim % HEAD_DIM_MULTIPLE != 0:
        return None
    return next((d for d in sorted(built) if d >= head_dim), None)


def head_dims_of(choice: KernelChoice) -> tuple[int, ...]:
    """The head dims ``choice``'s kernel is built for: the Hopper kernel's FP8 PV also 256."""
    if choice.kernel == "wgmma":
        return ops.WGMMA_HEAD_DIMS if choice.pv == "fp8" else ops.WGMMA_INPUT_PV_HEAD_DIMS
    return ops.MMA_HEAD_DIMS


# ------------------------------------------------------------------------------------------------
# The routing rules
# ------------------------------------------------------------------------------------------------


class Route(NamedTuple):
    """A kernel route: a call to which ``applies(call, target)`` is true runs ``choice``."""

    when: str
    applies: Callable[[AttentionCall, Target], bool]
    choice: KernelChoice
    why: str


WGMMA = KernelChoice("wgmma", "int8", "fp8")
WGMMA_INPUT = KernelChoice("wgmma", "int8", "input")
MMA_INT4_FP8 = KernelChoice("mma", "int4", "fp8")
MMA_INT8_FP8 = KernelChoice("mma", "int8", "fp8")
MMA_INT8_INPUT = KernelChoice("mma", "int8", "input")

ROUTES: tuple[Route, ...] = (
    Route("an sm_90 GPU with the build's Hopper kernel, `qk_quant` \"auto\"/\"int8\", `pv_quant` "
          "\"auto\"/\"fp8\", `smooth_q` \"auto\"/False",
          lambda call, target: (
              call.qk_quant == "int8" and call.pv_quant in ("auto", "fp8")
              and call.smooth_q in ("auto", "none")
              and kernel_head_dim(call.head_dim, ops.WGMMA_HEAD_DIMS) is not None
              and target.wgmma),
          WGMMA, "what the Hopper kernel computes: INT8 QK with Q quantized per row in the "
                 "kernel, no Q smoothing, FP8 PV"),
    Route("an sm_90 GPU with the build's Hopper kernel, `qk_quant` \"auto\"/\"int8\", `pv_quant` "
          "\"none\", `smooth_q` \"auto\"/False",
          lambda call, target: (
              call.qk_quant == "int8" and call.pv_quant == "none"
              and call.smooth_q in ("auto", "none")
              and kernel_head_dim(call.head_dim, ops.WGMMA_INPUT_PV_HEAD_DIMS) is not None
              and target.wgmma),
          WGMMA_INPUT, "the accurate tier: the Hopper kernel with P and V in the input dtype, "
                       "FP32 accumulation (3-4x less error than FP8 PV)"),
    Route("`qk_quant=\"int4\"`", lambda call, target: call.qk_quant == "int4", MMA_INT4_FP8,
          "the INT4 variant exists with FP8 PV only (sm_89+: native INT4 and FP8 mma.sync on "
          "Ada; INT4 emulated on sm_90, sm_100 and sm_120, FP8 also on sm_90 and sm_100: slow)"),
    Route("`pv_quant=\"fp8\"`, or \"auto\" on a GPU with native FP8 mma.sync (sm_89, sm_12x) "
          "and the build's FP8 code for it",
          lambda call, target: call.pv_quant == "fp8" or (
              call.pv_quant == "auto" and target.native_fp8 and target.mma_fp8),
          MMA_INT8_FP8, "FP8 PV is the fast PV where FP8 tensor cores are native; on sm_90 and "
                        "sm_100 the warp-level kernel's FP8 mma.sync is emulated (their FP8 "
                        "tensor cores are wgmma's and tcgen05's), slower than FP16 PV"),
    Route("any other call", lambda call, target: True, MMA_INT8_INPUT,
          "P and V in the input dtype, FP32 accumulation: every GPU from sm_80 on"),
)


class Fallback(NamedTuple):
    """A fallback rule: a call to which ``applies`` is true runs exact SDPA because of
    ``reason``, a template of the warning's text whose fields ``details`` gives (it takes what
    ``applies`` takes: the :class:`Target` for device and build rules, the call for argument
    rules, call, choice and target for the warp-level kernel's)."""

    when: str
    applies: Callable[..., bool]
    reason: str
    details: Callable[..., Mapping[str, object]] | None = None

    def message(self, *args: Any) -> str:
        return self.reason if self.details is None else self.reason.format(**self.details(*args))


_HEAD_DIMS = ", ".join(map(str, ANY_KERNEL_HEAD_DIMS))
_MMA_HEAD_DIMS = " and ".join(map(str, ops.MMA_HEAD_DIMS))

DEVICE_RULES: tuple[Fallback, ...] = (
    Fallback("tensors not on a CUDA device (CPU, meta, ...)",
             lambda target: target.device_type != "cuda",
             "the quantized kernels need CUDA tensors, got {device}",
             lambda target: {"device": target.device_type}),
    Fallback("torch sees no CUDA GPU", lambda target: target.capability is None,
             "no CUDA GPU is available"),
    Fallback(f"a GPU older than sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}",
             lambda target: target.capability < MIN_CAPABILITY,
             f"the quantized kernels need a GPU of compute capability {MIN_CAPABILITY[0]}."
             f"{MIN_CAPABILITY[1]} or newer, got {{arch}}",
             lambda target: {"arch": _arch(target.capability)}),
)
def _not_a_key_padding_mask(call: AttentionCall) -> bool:
    """The mask rule's test. An inference tensor examined before is judged by what was found then
    (its key ranges are read again where they are used: _execute)."""
    if call.attn_mask is None:
        return False
    shape = (call.attn_mask, call.q.shape[0], call.k.shape[2], call.q.shape[2])
    ranges = _key_ranges.remembered_unverified(*shape)
    if ranges is MISSING:
        ranges = _key_ranges.key_ranges(*shape)
    return ranges is None


# Its own name: a call's mask decides it (and a later call's mask may not), so the call cache
# examines each new mask (_execute).
MASK_RULE = Fallback(
    "an `attn_mask` other than a key-padding mask (one that leaves each batch item a contiguous "
    "range of keys, the same for all its heads and queries: `[B, 1, 1, N_kv]`, or `[B, 1, N_q, "
    "N_kv]` with equal rows)",
    _not_a_key_padding_mask,
    "the quantized kernels take no attn_mask other than a key-padding mask (one that leaves each "
    "batch item a contiguous range of keys, the same for all heads and queries: [B, 1, 1, N_kv], "
    "or [B, 1, N_q, N_kv] with equal rows)")
CALL_RULES: tuple[Fallback, ...] = (
    Fallback("float32 or float64 inputs", lambda call: call.q.dtype not in KERNEL_DTYPES,
             "the quantized kernels need float16 or bfloat16 inputs, got {dtype}",
             lambda call: {"dtype": call.q.dtype}),
    Fallback("`dropout_p` > 0", lambda call: call.dropout_p > 0.0,
             "the quantized kernels have no dropout (dropout_p > 0)"),
    MASK_RULE,
    Fallback(f"a head_dim above {max(ANY_KERNEL_HEAD_DIMS)} or not a multiple of "
             f"{HEAD_DIM_MULTIPLE}",
             lambda call: kernel_head_dim(call.head_dim, ANY_KERNEL_HEAD_DIMS) is None,
             f"the attention kernels are built for head_dim {_HEAD_DIMS} ({max(ANY_KERNEL_HEAD_DIMS)}: "
             f"the Hopper kernel with FP8 PV; other multiples of {HEAD_DIM_MULTIPLE} below "
             f"{max(ANY_KERNEL_HEAD_DIMS)} are zero-padded to the next), got {{head_dim}}",
             lambda call: {"head_dim": call.head_dim}),
    Fallback("v's head_dim differs from q's and k's", lambda call: call.head_dim_v != call.head_dim,
             "the quantized kernels need v's head_dim to be q's and k's, got {head_dim_v} and "
             "{head_dim}",
             lambda call: {"head_dim_v": call.head_dim_v, "head_dim": call.head_dim}),
    # (sageattn itself sends the calls that its exact backward serves to the graph op, which
    # decides with grad off: _compile.training_call; this rule keeps every other path exact)
    Fallback("inputs that require grad (grad enabled) on a call or entry point that sageattn's "
             "exact backward does not serve: a mask that requires grad, dropout, causal lengths "
             "that differ; or q or k whose channels trip the training guard (D52)",
             lambda call: torch.is_grad_enabled() and any(
                 t is not None and t.requires_grad
                 for t in (call.q, call.k, call.v, call.attn_mask)),
             "the inputs require grad and sageattn's backward does not serve {why}",
             lambda call: {"why": _backward.refusal(call) or _backward.guard_verdict(call) or (
                 "this entry point" if _backward.training_mode() == "quantized" else
                 f"calls while {_backward.TRAINING_ENVIRONMENT}=exact (the default; =quantized "
                 "opts in to the quantized forward with the exact backward)")}),
)
BUILD_RULES: tuple[Fallback, ...] = (
    Fallback("a build without the compiled extension", lambda target: not target.extension,
             "the sageattention2._C extension is not available"),
    Fallback("an extension without the attention op", lambda target: not target.attention_op,
             "the attention kernels are not built yet"),
    Fallback("a build without attention_mma code for this GPU",
             lambda target: target.capability is not None and not target.mma_code,
             "the attention kernel is not compiled for {arch} (built for {built})",
             lambda target: {"arch": _arch(target.capability),
                             "built": family_archs(ops.MMA_FAMILY)}),
)
MMA_RULES: tuple[Fallback, ...] = (
    Fallback(f"a head_dim above {max(ops.MMA_HEAD_DIMS)} off the Hopper kernel's FP8 PV (the "
             "warp-level kernel, `pv_quant=\"none\"`, `qk_quant=\"int4\"`, GPUs other than sm_90)",
             lambda call, choice, target: kernel_head_dim(call.head_dim) is None,
             f"the warp-level kernel and the Hopper kernel's accurate tier run head_dim up to "
             f"{max(ops.MMA_HEAD_DIMS)} ({_MMA_HEAD_DIMS}, smaller multiples of "
             f"{HEAD_DIM_MULTIPLE} zero-padded); head_dim {{head_dim}} runs quantized on the Hopper "
             "kernel (sm_90) with INT8 QK and FP8 PV only (qk_quant 'auto'/'int8', pv_quant "
             "'auto'/'fp8')",
             lambda call, choice, target: {"head_dim": call.head_dim}),
    Fallback("`qk_quant=\"int4\"` with `pv_quant=\"none\"`",
             lambda call, choice, target: choice.qk == "int4" and call.pv_quant == "none",
             "INT4 QK runs with FP8 PV only; pv_quant='none' needs qk_quant='int8'"),
    Fallback("`smooth_q=\"block\"`", lambda call, choice, target: call.smooth_q == "block",
             "the attention kernel smooths Q per head, not per block (smooth_q='block'); "
             "smooth_q='head' (the default) is exact as well"),
    Fallback("FP8 PV (`pv_quant=\"fp8\"`, or `qk_quant=\"int4\"`) on a GPU without the build's "
             f"{ops.MMA_FP8_FAMILY} code (older than sm_89)",
             lambda call, choice, target: (choice.pv == "fp8" and target.capability is not None
                                           and not target.mma_fp8),
             f"FP8 PV needs an sm_89+ GPU and a build with {ops.MMA_FP8_FAMILY} code for it "
             f"({{needs}}); this GPU is {{arch}}, {ops.MMA_FP8_FAMILY} is built for {{built}}",
             lambda call, choice, target: {
                 "needs": ("qk_quant='int4' (INT4 QK runs with FP8 PV only)"
                           if choice.qk == "int4" else "pv_quant='fp8'"),
                 "arch": _arch(target.capability), "built": family_archs(ops.MMA_FP8_FAMILY)}),
)
# In the order they are checked.
FALLBACKS: tuple[Fallback, ...] = (*DEVICE_RULES, *CALL_RULES, *BUILD_RULES, *MMA_RULES)


def kernel_for(call: AttentionCall, target: Target) -> KernelChoice:
    """The kernel and precisions of the first of :data:`ROUTES` that applies to ``call``."""
    for rule in ROUTES:
        if rule.applies(call, target):
            return rule.choice
    raise AssertionError("the last route applies to every call")


def _fallback(call: AttentionCall, choice: KernelChoice,
              target: Target) -> tuple[Fallback, tuple[Any, ...]] | None:
    """The first of :data:`FALLBACKS` that applies, with the arguments it was checked with."""
    for rule in DEVICE_RULES:
        if rule.applies(target):
            return rule, (target,)
    for rule in CALL_RULES:
        if rule.applies(call):
            return rule, (call,)
    for rule in BUILD_RULES:
        if rule.applies(target):
            return rule, (target,)
    if choice.kernel == "mma":  # the Hopper kernel is only routed calls it serves
        for rule in MMA_RULES:
            if rule.applies(call, choice, target):
                return rule, (call, choice, target)
    return None


def unsupported_reason(call: AttentionCall, choice: KernelChoice, target: Target) -> str | None:
    """Why the quantized path cannot serve ``call`` with ``choice`` on ``target`` (the reason of
    the first fallback rule that applies), or None when it can."""
    found = _fallback(call, choice, target)
    return None if found is None else found[0].message(*found[1])


def route(call: AttentionCall) -> tuple[KernelChoice, str | None]:
    """The kernel that serves ``call`` and why it cannot (None: it can), decided once per call."""
    target = target_of(call.q.device)
    choice = kernel_for(call, target)
    return choice, unsupported_reason(call, choice, target)


def _target_reason(target: Target) -> str | None:
    for rule in (*DEVICE_RULES, *BUILD_RULES):
        if rule.applies(target):
            return rule.message(target)
    return None


def device_reason(device: torch.device) -> str | None:
    """Why no call on ``device`` can run the quantized kernels (the reason of the first device or
    build rule that applies), or None."""
    return _target_reason(target_of(device))


def smooths_q(call: AttentionCall, choice: KernelChoice) -> bool:
    """Whether the warp-level kernel smooths Q (per head) for ``call``: as asked, and for
    smooth_q="auto" with INT4 QK only, whose 4-bit codes need it (paper 3.2: smoothing Q at least
    halves INT4's error on inputs with channel offsets). INT8 QK is accurate without it (the
    Hopper kernel's choice too), and then Q takes no pass before the kernel at all."""
    return call.smooth_q == "head" or (call.smooth_q == "auto" and choice.qk == "int4")


# ------------------------------------------------------------------------------------------------
# kernel_plan
# ------------------------------------------------------------------------------------------------


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _mma_variants(target: Target) -> str:
    """The variants of the warp-level kernel that run on ``target`` (kernel_plan)."""
    if target.mma_fp8 and target.native_fp8:
        return ("INT8 QK + FP8 PV (pv_quant='none': FP16/BF16 PV), "
                "INT4 QK + FP8 PV with qk_quant='int4'")
    if target.mma_fp8:
        return ("INT8 QK + FP16/BF16 PV (pv_quant='fp8': INT8 QK + FP8 PV, emulated FP8 "
                "mma.sync here), INT4 QK + FP8 PV with qk_quant='int4' (emulated)")
    return "INT8 QK + FP16/BF16 PV (FP8 PV and INT4 QK need sm_89+)"


def kernel_plan(device: torch.device | str | int | None = None) -> str:
    """What :func:`sageattn` runs for float16/bfloat16 inputs on ``device`` (default: the current
    CUDA device, else the CPU), and which kernels the extension has for it. A call the kernel
    cannot serve (see :func:`sageattn`, "Fallback") still runs exact SDPA."""
    dev = _resolve_device(device)
    target = target_of(dev)
    reason = _target_reason(target)
    capability = target.capability
    dims = (f"head_dim {_MMA_HEAD_DIMS} (smaller multiples of {HEAD_DIM_MULTIPLE} zero-padded)")
    hopper_dims = (f"head_dim {_HEAD_DIMS} (256: FP8 PV only; smaller multiples of "
                   f"{HEAD_DIM_MULTIPLE} zero-padded)")
    if reason or capability is None:
        plan = f"exact SDPA fallback ({reason or 'the quantized kernels need a CUDA GPU'})"
    elif target.wgmma:
        plan = (f"quantized SageAttention2: {WGMMA_PLAN}, {hopper_dims}, INT8 without Q smoothing; the "
                f"{MMA_PLAN} for smooth_q='head'/True or qk_quant='int4': "
                f"{_mma_variants(target)} (other calls: exact SDPA)")
    else:
        plan = (f"quantized SageAttention2: {MMA_PLAN}: {_mma_variants(target)}, {dims} "
                f"(other calls: exact SDPA)")
    info = ops.build_info()
    if capability is None or info is None:
        return plan
    arch = _arch(capability)
    kernels = ops.kernels_for_capability(capability)
    if not kernels:
        built = ", ".join(info.archs) or "no architectures"
        return f"{plan}; no kernels compiled for {arch} (built for {built})"
    listed = ", ".join(f"{family} [{', '.join(archs)}]" for family, archs in kernels.items())
    return f"{plan}; kernels for {arch}: {listed}"


# ------------------------------------------------------------------------------------------------
# The README table
# ------------------------------------------------------------------------------------------------

# The archs of each kernel family in the default build (setup.py: sm_80, sm_86, sm_89, sm_90a,
# sm_100, sm_120; csrc/torch/module.cpp: FP8 mma.sync code from sm_89 on), which the README
# table describes.
DEFAULT_BUILD: dict[str, tuple[str, ...]] = {
    ops.MMA_FAMILY: ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"),
    ops.MMA_FP8_FAMILY: ("sm_89", "sm_90a", "sm_100", "sm_120"),
    ops.WGMMA_FAMILY: ("sm_90a",),
}
# The README table's columns: GPUs and their capability (a cubin runs on its major's later
# minors: sm_86's on sm_87, sm_100's on sm_103, sm_120's on sm_121).
TABLE_GPUS: tuple[tuple[str, Capability], ...] = (
    ("sm_90 (H100, H200, H20)", (9, 0)),
    ("sm_89 (RTX 4090, L20, L40)", (8, 9)),
    ("sm_120 (RTX 5090, RTX PRO 6000)", (12, 0)),
    ("sm_100 (B200, GB200)", (10, 0)),
    ("sm_80/86 (A100, RTX 3090)", (8, 0)),
    ("sm_75 and older (T4, RTX 2080)", (7, 5)),
)
# Its rows: float16 calls with these options.
TABLE_CALLS: tuple[dict[str, Any], ...] = (
    {}, {"smooth_q": "head"}, {"pv_quant": "fp8"}, {"pv_quant": "none"}, {"qk_quant": "int4"},
)
_KERNEL_NAMES = {"wgmma": "attention_wgmma", "mma": "attention_mma"}
_PV_NAMES = {"fp8": "FP8", "input": "FP16/BF16"}


def default_build_target(capability: Capability) -> Target:
    """The :class:`Target` of a GPU of ``capability`` with the default build."""
    def runs(family: str) -> bool:
        return any(ops.arch_runs_on(arch, capability) for arch in DEFAULT_BUILD[family])

    return Target("cuda", capability, extension=True, attention_op=True,
                  mma_code=runs(ops.MMA_FAMILY), wgmma=runs(ops.WGMMA_FAMILY),
                  mma_fp8=runs(ops.MMA_FP8_FAMILY), native_fp8=native_fp8_mma(capability))


def _table_call(options: Mapping[str, Any]) -> AttentionCall:
    """A validated float16 call ([1, 1, 128, 128] meta tensors) with ``options``."""
    q = torch.empty(1, 1, 128, 128, dtype=torch.float16, device="meta")
    kwargs: dict[str, Any] = dict(tensor_layout="HND", qk_quant="auto", pv_quant="auto",
                                  smooth_k=True, smooth_q="auto", smooth_v=False,
                                  return_lse=False, strict=False)
    kwargs.update(options)
    return validate(q, q, q, None, 0.0, False, None, False, **kwargs)


def _kernel_text(choice: KernelChoice) -> str:
    return (f"`{_KERNEL_NAMES[choice.kernel]}`: {choice.qk.upper()} QK + {_PV_NAMES[choice.pv]} "
            "PV")


def _cell(call: AttentionCall, target: Target) -> str:
    """What ``call`` runs on ``target``: the kernel, or the fallback rule that stops it."""
    choice = kernel_for(call, target)
    found = _fallback(call, choice, target)
    if found is not None:
        return f"exact SDPA (fallback {FALLBACKS.index(found[0]) + 1})"
    return _kernel_text(choice)


def _template(reason: str) -> str:
    """A reason template as the table shows it: its fields in italics."""
    return reason.replace("{", "*").replace("}", "*")


def routing_table_markdown() -> str:
    """README.md's "Which GPU runs what", rendered from :data:`ROUTES` and :data:`FALLBACKS`:
    what float16 calls run on each GPU of :data:`TABLE_GPUS` with the default build, then both
    tables of rules."""
    def options(call: Mapping[str, Any]) -> str:
        return ", ".join(f"`{k}={v!r}`".replace("'", '"') for k, v in call.items()) or "defaults"

    targets = [default_build_target(capability) for _, capability in TABLE_GPUS]
    lines = ["| float16/bfloat16 CUDA call | " + " | ".join(g for g, _ in TABLE_GPUS) + " |",
             "|---" * (len(TABLE_GPUS) + 1) + "|"]
    for call_options in TABLE_CALLS:
        call = _table_call(call_options)
        cells = " | ".join(_cell(call, target) for target in targets)
        lines.append(f"| {options(call_options)} | {cells} |")
    lines += ["", "Which kernel serves a call: the first route that applies.", "",
              "| route | when | kernel | why |", "|---|---|---|---|"]
    lines += [f"| {i} | {rule.when} | {_kernel_text(rule.choice)} | {rule.why} |"
              for i, rule in enumerate(ROUTES, 1)]
    lines += ["", "When a call falls back to exact `F.scaled_dot_product_attention`: the first "
              "rule that applies, checked in this order. Its reason is the text of the "
              "`SageAttentionFallbackWarning`, shown once per reason (`strict=True` raises "
              "`NotImplementedError` with it instead).", "",
              "| fallback | when | reason |", "|---|---|---|"]
    lines += [f"| {i} | {rule.when} | {_template(rule.reason)} |"
              for i, rule in enumerate(FALLBACKS, 1)]
    return "\n".join(lines)
