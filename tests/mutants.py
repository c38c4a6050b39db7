"""Mutants: behaviours users rely on, each broken in memory, and the tests that must catch it.

A test that cannot fail is a defect (issue 52). Each :class:`Mutant` here breaks one behaviour of
the package under test in memory (an option dropped, ``scale`` ignored, a plan forced to exact,
an output element left unwritten, ...) and names the tests that guard it. ``test_mutants.py``
runs those tests once per mutant, in a fresh pytest process with ``SAGEATTN_MUTANT=<name>`` (which
``conftest.py`` reads and applies before any test module is imported), and passes only when at
least one of them fails. GPU mutants (``gpu=True``) run where the GPU tests run.

``python3 tests/mutants.py`` lists them.
"""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

ENVIRONMENT = "SAGEATTN_MUTANT"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str                                  # the behaviour broken, in words
    tests: tuple[str, ...]                     # node ids relative to tests/ that must catch it
    apply: Callable[[pytest.MonkeyPatch], None]
    gpu: bool = False                          # its tests need the GPU


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, what: str, *tests: str, gpu: bool = False,
           ) -> Callable[[Callable[[pytest.MonkeyPatch], None]], Callable[[pytest.MonkeyPatch], None]]:
    """Register the decorated ``apply(patch)`` as the mutant ``name``."""
    def register(apply: Callable[[pytest.MonkeyPatch], None]) -> Callable[[pytest.MonkeyPatch], None]:
        assert name not in MUTANTS, name
        assert tests, f"mutant {name} names no test"
        MUTANTS[name] = Mutant(name, what, tests, apply, gpu)
        return apply
    return register


def apply(name: str) -> None:
    """Break the behaviour of mutant ``name`` for the rest of this process."""
    if name not in MUTANTS:
        raise pytest.UsageError(f"{ENVIRONMENT}={name}: no such mutant (python3 tests/mutants.py)")
    MUTANTS[name].apply(pytest.MonkeyPatch())


def _wrap(patch: pytest.MonkeyPatch, owner: Any, attribute: str,
          change: Callable[..., Any]) -> None:
    """Replace ``owner.attribute`` by ``change(real, *args, **kwargs)``."""
    real = getattr(owner, attribute)

    def changed(*args: Any, **kwargs: Any) -> Any:
        return change(real, *args, **kwargs)

    patch.setattr(owner, attribute, changed)


# ------------------------------------------------------------------------------------------------
# Mutants. Imports of sageattention2 happen inside each apply(): conftest.py chooses the package
# under test before anything imports it.
# ------------------------------------------------------------------------------------------------

# --- integrations and CLI (begin) ---

class _Unchanging(dict):  # type: ignore[type-arg]
    """An integration's ``_options`` whose ``update`` does nothing: register's
    ``_options.update(sageattn_kwargs)`` never happens."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Uncleared(dict):  # type: ignore[type-arg]
    """An integration's ``_options`` whose ``clear`` does nothing: register() again keeps the
    options of the register before."""

    def clear(self) -> None:
        pass


@mutant("diffusers-register-drops-options",
        "diffusers register(**options) never stores them: backend calls run sageattn's defaults",
        "test_integration_diffusers.py::test_register_options_reach_every_backend_call",
        "test_integration_diffusers.py::test_register_qk_quant_forces_the_kernel_under_the_crossover")
def _diffusers_register_drops_options(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import diffusers

    patch.setattr(diffusers, "_options", _Unchanging())


@mutant("diffusers-register-keeps-old-options",
        "diffusers register() again keeps the options of the register before",
        "test_integration_diffusers.py::test_register_options_reach_every_backend_call")
def _diffusers_register_keeps_old_options(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import diffusers

    patch.setattr(diffusers, "_options", _Uncleared())


@mutant("diffusers-apply-drops-options",
        "SageAttnProcessor runs patch_sdpa() without the options given to apply(...)",
        "test_integration_diffusers.py::test_apply_options_reach_every_call")
def _diffusers_apply_drops_options(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import diffusers

    real = diffusers.patch_sdpa
    patch.setattr(diffusers, "patch_sdpa", lambda **options: real())


@mutant("diffusers-apply-keeps-wrapped",
        "diffusers apply() leaves processors it wrapped before as they were (their old options)",
        "test_integration_diffusers.py::test_apply_again_takes_the_new_options")
def _diffusers_apply_keeps_wrapped(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import diffusers

    def apply(real: Callable[..., int], model: Any, **options: Any) -> int:
        before = {id(m): m.processor for m in diffusers._processor_modules(model)
                  if isinstance(m.processor, diffusers.SageAttnProcessor)}
        wrapped = real(model, **options)
        for m in diffusers._processor_modules(model):
            if id(m) in before:
                m.set_processor(before[id(m)])
        return wrapped

    _wrap(patch, diffusers, "apply", apply)


@mutant("diffusers-processor-hides-attributes",
        "SageAttnProcessor has no __getattr__: the wrapped processor's attributes are not read",
        "test_integration_diffusers.py::test_processor_reads_attributes_of_the_wrapped_one")
def _diffusers_processor_hides_attributes(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import diffusers

    patch.delattr(diffusers.SageAttnProcessor, "__getattr__")


@mutant("diffusers-processor-keeps-writes",
        "SageAttnProcessor keeps attribute writes to itself: the wrapped processor never sees them",
        "test_integration_diffusers.py::test_processor_reads_attributes_of_the_wrapped_one")
def _diffusers_processor_keeps_writes(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import diffusers

    patch.delattr(diffusers.SageAttnProcessor, "__setattr__")


@mutant("transformers-register-drops-options",
        "transformers register(**options) never stores them: calls run sageattn's defaults",
        "test_integration_transformers.py::test_register_options_reach_every_call",
        "test_integration_transformers.py::test_register_qk_quant_forces_the_kernel_under_the_crossover")
def _transformers_register_drops_options(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import transformers

    patch.setattr(transformers, "_options", _Unchanging())


@mutant("transformers-register-keeps-old-options",
        "transformers register() again keeps the options of the register before",
        "test_integration_transformers.py::test_register_options_reach_every_call")
def _transformers_register_keeps_old_options(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import transformers

    patch.setattr(transformers, "_options", _Uncleared())


@mutant("transformers-position-bias-ignored",
        "the attention function ignores position_bias (no hand-off to transformers' SDPA "
        "function): T5's calls run sageattn without their bias",
        "test_integration_transformers.py::test_position_bias_runs_transformers_sdpa")
def _transformers_position_bias_ignored(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import transformers

    _wrap(patch, transformers, "attention_forward", lambda real, *args, **kwargs: real(
        *args, **{name: value for name, value in kwargs.items() if name != "position_bias"}))


@mutant("transformers-output-attentions-unwarned",
        "output_attentions=True is not seen: no warning that no weights come back",
        "test_integration_transformers.py::test_output_attentions_warns_once")
def _transformers_output_attentions_unwarned(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import transformers

    _wrap(patch, transformers, "attention_forward", lambda real, *args, **kwargs: real(
        *args, **{name: value for name, value in kwargs.items() if name != "output_attentions"}))


@mutant("transformers-output-attentions-every-call",
        "the output_attentions warning's once-flag is never set: a warning on every call",
        "test_integration_transformers.py::test_output_attentions_warns_once")
def _transformers_output_attentions_every_call(patch: pytest.MonkeyPatch) -> None:
    from sageattention2.integrations import transformers

    def forgetting(real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        finally:
            transformers._warned_output_attentions = False

    _wrap(patch, transformers, "attention_forward", forgetting)


@mutant("crossover-not-followed",
        "qk_quant='auto' never runs exact SDPA where the crossover table says it is faster",
        "test_integration_diffusers.py::test_register_qk_quant_forces_the_kernel_under_the_crossover")
def _crossover_not_followed(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _crossover

    patch.setattr(_crossover, "exact_is_faster", lambda call, choice, capability: None)


@mutant("crossover-not-followed-on-the-gpu",
        "qk_quant='auto' never runs exact SDPA where the crossover table says it is faster (GPU)",
        "test_crossover.py::test_sageattn_follows_a_written_table_on_the_gpu",
        "test_integration_transformers.py::test_decoder_runs_the_kernel_on_the_gpu",
        "test_integration_diffusers.py::test_backend_runs_the_kernel_on_the_gpu", gpu=True)
def _crossover_not_followed_on_the_gpu(patch: pytest.MonkeyPatch) -> None:
    _crossover_not_followed(patch)


@mutant("cli-bench-without-gpu-runs-on-the-cpu",
        "bench without a CUDA GPU and without --device runs on the CPU (the model suite: an hour)",
        "test_integrations.py::test_cli_bench_needs_a_gpu_unless_a_device_is_named")
def _cli_bench_without_gpu_runs_on_the_cpu(patch: pytest.MonkeyPatch) -> None:
    import torch

    from sageattention2 import __main__

    def on_cpu(real: Callable[..., int], parser: Any, args: Any) -> int:
        if args.device is None and not torch.cuda.is_available():
            args.device = "cpu"
        return real(parser, args)

    _wrap(patch, __main__, "_bench", on_cpu)


@mutant("cli-bench-no-flags-skips-the-shapes",
        "bench with neither --shapes nor --models runs the models only",
        "test_integrations.py::test_cli_bench_with_no_flags_runs_the_shapes_then_the_models")
def _cli_bench_no_flags_skips_the_shapes(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import __main__

    def models_only(real: Callable[..., int], parser: Any, args: Any) -> int:
        if not args.shapes and args.models is None:
            args.models = []
        return real(parser, args)

    _wrap(patch, __main__, "_bench", models_only)


@mutant("cli-bench-drops-seconds",
        "bench --models does not pass --seconds on (the model suite's run takes its default)",
        "test_integrations.py::test_cli_bench_models_passes_its_flags")
def _cli_bench_drops_seconds(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import __main__

    def default_seconds(real: Callable[..., int], parser: Any, args: Any) -> int:
        args.seconds = 0.0  # _bench_models.run's default
        return real(parser, args)

    _wrap(patch, __main__, "_bench", default_seconds)


@mutant("cli-check-ignores-path",
        "check does not pass --path on: every variant is checked",
        "test_integrations.py::test_cli_check_passes_its_path_and_exit_code")
def _cli_check_ignores_path(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import __main__

    def every_path(real: Callable[..., int], args: Any) -> int:
        args.path = "all"
        return real(args)

    _wrap(patch, __main__, "_check_command", every_path)


@mutant("cli-check-exit-code-lost",
        "check exits 0 whatever the check found",
        "test_integrations.py::test_cli_check_passes_its_path_and_exit_code")
def _cli_check_exit_code_lost(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import __main__

    _wrap(patch, __main__, "_check_command", lambda real, args: real(args) and 0)


@mutant("cli-tune-takes-any-dtypes",
        "tune --dtypes takes any names (no check before tune runs)",
        "test_integrations.py::test_cli_tune_refuses_other_dtypes")
def _cli_tune_takes_any_dtypes(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import __main__

    patch.setattr(__main__, "_dtypes", lambda text: tuple(text.split(",")))


@mutant("cli-tune-without-gpu-check",
        "tune does not check for a CUDA GPU: without one it ends in a traceback",
        "test_integrations.py::test_cli_tune_needs_a_gpu")
def _cli_tune_without_gpu_check(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import __main__

    _wrap(patch, __main__, "_without_gpu", lambda real, command, why: (
        False if command == "tune" else real(command, why)))


@mutant("bench-models-speedup-inverted",
        "bench --models reports sageattn's time over SDPA's as the speedup",
        "test_integrations.py::test_cli_bench_models")
def _bench_models_speedup_inverted(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _bench_models

    def inverted(real: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        row = real(*args, **kwargs)
        row["speedup"] = row["sage_ms"] / row["default_ms"]
        return row

    _wrap(patch, _bench_models, "measure", inverted)


@mutant("bench-train-without-quantized-training",
        "bench --models --train runs sageattn's steps without SAGEATTN_TRAINING=quantized (its "
        "exact training path: the table would time exact SDPA under sageattn's name)",
        "test_integrations.py::test_cli_bench_models_train")
def _bench_train_without_quantized_training(patch: pytest.MonkeyPatch) -> None:
    import contextlib

    from sageattention2 import _bench_models

    patch.setattr(_bench_models, "environment", lambda name, value: contextlib.nullcontext())


@mutant("training-guard-off",
        "the training guard never trips (wide-channel q or k would train through INT8 QK, whose "
        "gradients fall to CosSim 0.90 there)",
        "test_training.py::test_training_guard")
def _training_guard_off(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _backward

    patch.setattr(_backward, "training_guard", lambda: 0.0)


@mutant("training-guard-waits-every-call",
        "the training guard waits for every call's statistic (each training call then waits for "
        "the GPU's queue: 4.9 % of Flux's step, session 45)",
        "test_training.py::test_training_guard_waits_only_for_a_kinds_first_call")
def _training_guard_waits_every_call(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _backward

    real = _backward._GuardKind.read
    patch.setattr(_backward._GuardKind, "read", lambda self, wait_for=0: real(self, len(self.pending)))


@mutant("own-backward-kernel-without-opt-in",
        "our backward kernel runs without SAGEATTN_BACKWARD_KERNEL=wgmma (it is slower than "
        "cuDNN's: training would lose speed unasked)",
        "test_backward_kernel.py::test_the_own_kernel_is_opt_in")
def _own_backward_kernel_without_opt_in(patch: pytest.MonkeyPatch) -> None:
    import os

    from sageattention2 import _backward

    def opted_in(real: Callable[..., bool], *args: Any) -> bool:
        saved = os.environ.get(_backward._OWN_KERNEL_ENVIRONMENT)
        os.environ[_backward._OWN_KERNEL_ENVIRONMENT] = "wgmma"
        try:
            return real(*args)
        finally:
            if saved is None:
                del os.environ[_backward._OWN_KERNEL_ENVIRONMENT]
            else:
                os.environ[_backward._OWN_KERNEL_ENVIRONMENT] = saved

    _wrap(patch, _backward, "_own_kernel", opted_in)


@mutant("backward-8bit-one-p-scale-per-key",
        "the 8-bit backward's reference scales P^T and dS^T once per key over all queries instead "
        "of per 64-query block (a key's small block rounds to zero: bias0 dV 0.70)",
        "test_reference_backward.py::test_the_block_scales_keep_a_key_small_in_one_block")
def _backward_8bit_one_p_scale_per_key(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import reference_backward as rb

    def one_scale(left_t: Any, right: Any) -> Any:
        left_codes, left_scale = rb.quantize_symmetric(left_t, (2,), rb.INT8_MAX)  # over all queries
        blocks = rb._blocks(left_codes.double() * left_scale.double())
        right_codes, right_scale = rb.quantize_symmetric(right, (2,), rb.INT8_MAX)
        return (blocks.transpose(-1, -2) @ rb._blocks(right_codes.double())).sum(2) * right_scale.double()

    patch.setattr(rb, "product_int8_per_block", one_scale)


@mutant("backward-8bit-channel-scale-per-block",
        "the 8-bit backward's reference scales dO and Q per channel per 64-query block instead of "
        "over all tokens (the kernel could no longer apply the channel scales once, at the end)",
        "test_reference_backward.py::test_the_channel_scales_span_all_tokens")
def _backward_8bit_channel_scale_per_block(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import reference_backward as rb

    def per_block(left_t: Any, right: Any) -> Any:
        left_codes, left_scale = rb.quantize_symmetric(rb._blocks(left_t), (3,), rb.INT8_MAX)
        right_codes, right_scale = rb.quantize_symmetric(rb._blocks(right), (3,), rb.INT8_MAX)
        dots = left_codes.double().transpose(-1, -2) @ right_codes.double()
        return (dots * left_scale.double().transpose(-1, -2) * right_scale.double()).sum(2)

    patch.setattr(rb, "product_int8_per_block", per_block)


@mutant("backward-8bit-q-unsmoothed",
        "the 8-bit backward's reference quantizes Q's rows without subtracting Q's mean (INT8 "
        "scores lose the offset's precision)",
        "test_reference_backward.py::test_the_scores_are_smoothed")
def _backward_8bit_q_unsmoothed(patch: pytest.MonkeyPatch) -> None:
    import torch

    from sageattention2 import reference_backward as rb

    real = rb.quantize_rows_smoothed

    def unsmoothed(q: Any) -> Any:
        mean, _, _ = real(q)
        codes, scale = rb.quantize_symmetric(q.float(), (3,), rb.INT8_MAX)
        return torch.zeros_like(mean), codes, scale

    patch.setattr(rb, "quantize_rows_smoothed", unsmoothed)


@mutant("tune-grid-transposed",
        "tune writes each class's speedups key length by query length (the table's [n_q][n_k] "
        "order swapped)",
        "test_crossover.py::test_tune_writes_what_it_measured")
def _tune_grid_transposed(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _tune

    def transposed(real: Callable[[dict], str], table: dict) -> str:
        classes = [dict(c, speedup=[list(row) for row in zip(*c["speedup"])])
                   for c in table["classes"]]
        return real(dict(table, classes=classes))

    _wrap(patch, _tune, "_dumps", transposed)

# --- integrations and CLI (end) ---

# --- kernels, varlen, adaptive (begin) ---

# sageattn_varlen's options, each dropped on its way to the per-sequence sageattn calls (the
# option -> the test that passes it).
_VARLEN_SEQUENCE_OPTIONS = {
    "scale": "test_varlen.py::test_options_reach_each_sequences_call[scale]",
    "strict": "test_varlen.py::test_strict_reaches_each_sequences_call",
    "smooth_k": "test_varlen.py::test_options_reach_each_sequences_call[smooth_k]",
    "smooth_q": "test_varlen.py::test_options_reach_each_sequences_call[smooth_q]",
    "smooth_v": "test_varlen.py::test_options_reach_each_sequences_call[smooth_v]",
    "qk_quant": "test_varlen.py::test_options_reach_each_sequences_call[int4]",
}


def _varlen_drops(option: str) -> Callable[[pytest.MonkeyPatch], None]:
    def apply(patch: pytest.MonkeyPatch) -> None:
        from sageattention2 import _varlen

        def dropping(real: Callable[..., Any], q: Any, k: Any, v: Any, bounds_q: Any,
                     bounds_k: Any, options: dict[str, Any]) -> Any:
            return real(q, k, v, bounds_q, bounds_k,
                        {name: value for name, value in options.items() if name != option})

        _wrap(patch, _varlen, "_run", dropping)
    return apply


for _option, _test in _VARLEN_SEQUENCE_OPTIONS.items():
    mutant(f"varlen-drops-{_option.replace('_', '-')}",
           f"sageattn_varlen does not pass {_option} to each sequence's sageattn call (its "
           "default runs)", _test)(_varlen_drops(_option))
del _option, _test


def _varlen_one_launch_with(patch: pytest.MonkeyPatch, **changes: Callable[[Any], Any]) -> None:
    """The one launch (_varlen._run_packed) with ``changes[name](q)`` for keyword ``name``."""
    from sageattention2 import _varlen

    def changed(real: Callable[..., Any], q: Any, *args: Any, **kwargs: Any) -> Any:
        return real(q, *args, **{**kwargs, **{name: f(q) for name, f in changes.items()}})

    _wrap(patch, _varlen, "_run_packed", changed)


def _kernel_head_dim_scale(q: Any) -> float:
    import math

    return 1.0 / math.sqrt(q.shape[-1])


@mutant("varlen-one-launch-ignores-scale",
        "sageattn_varlen's one launch runs 1 / sqrt(D), not the scale it was given",
        "test_varlen.py::test_options_reach_the_one_launch[wgmma]")
def _varlen_one_launch_ignores_scale(patch: pytest.MonkeyPatch) -> None:
    _varlen_one_launch_with(patch, sm_scale=_kernel_head_dim_scale)


@mutant("varlen-one-launch-ignores-scale-on-gpu",
        "sageattn_varlen's one launch runs 1 / sqrt(D), not the scale it was given (the kernel)",
        "test_varlen.py::test_varlen_options_on_the_gpu[scale]", gpu=True)
def _varlen_one_launch_ignores_scale_on_gpu(patch: pytest.MonkeyPatch) -> None:
    _varlen_one_launch_with(patch, sm_scale=_kernel_head_dim_scale)


@mutant("varlen-one-launch-drops-smooth-k",
        "sageattn_varlen's one launch always smooths K (smooth_k=False not passed)",
        "test_varlen.py::test_options_reach_the_one_launch[mma]")
def _varlen_one_launch_drops_smooth_k(patch: pytest.MonkeyPatch) -> None:
    _varlen_one_launch_with(patch, smooth_k=lambda q: True)


@mutant("varlen-one-launch-drops-smooth-v",
        "sageattn_varlen's one launch never smooths V (smooth_v not passed)",
        "test_varlen.py::test_options_reach_the_one_launch[wgmma]")
def _varlen_one_launch_drops_smooth_v(patch: pytest.MonkeyPatch) -> None:
    _varlen_one_launch_with(patch, smooth_v=lambda q: False)


@mutant("varlen-one-launch-row-unwritten",
        "the Hopper kernel's one launch leaves the last row of its output unwritten",
        "test_varlen.py::test_varlen_on_the_gpu[False-64]", gpu=True)
def _varlen_one_launch_row_unwritten(patch: pytest.MonkeyPatch) -> None:
    import torch

    from sageattention2 import ops

    def unwritten(real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out, lse = real(*args, **kwargs)
        fresh = torch.empty_like(out)
        fresh[:-1] = out[:-1]
        return fresh, lse

    _wrap(patch, ops, "sageattn_wgmma_varlen", unwritten)


@mutant("explain-text-ignores-pv",
        "Explanation's text says 'PV in FP8' for every quantized call",
        "test_explain.py::test_quantized_explanation_text[h100-accurate]")
def _explain_text_ignores_pv(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import api

    real = api.Explanation.__str__

    def text(self: Any) -> str:
        return f"{self.kernel}: {self.qk.upper()} QK, PV in FP8" if self.quantized else real(self)

    patch.setattr(api.Explanation, "__str__", text)


def _kernel_ignores_scale(patch: pytest.MonkeyPatch) -> None:
    """KernelCall.of with the softmax scale of the head_dim, whatever the call's scale."""
    import dataclasses
    import math

    from sageattention2 import _execute

    real = _execute.KernelCall.of

    def of(call: Any, choice: Any) -> Any:
        return dataclasses.replace(real(call, choice), sm_scale=1.0 / math.sqrt(call.head_dim))

    patch.setattr(_execute.KernelCall, "of", staticmethod(of))


mutant("kernel-ignores-scale", "sageattn's kernel path runs 1 / sqrt(D), not the scale given",
       "test_explain.py::test_the_kernel_explain_names_runs_with_the_scale[wgmma]")(
    _kernel_ignores_scale)
mutant("kernel-ignores-scale-on-gpu",
       "sageattn's kernel path runs 1 / sqrt(D), not the scale given (the real kernels)",
       "test_sageattn_gpu.py::test_sageattn_scale[default]", gpu=True)(_kernel_ignores_scale)


@mutant("kernel-drops-smooth-k",
        "sageattn's kernel path quantizes K without subtracting its mean (smooth_k not passed)",
        "test_sageattn_gpu.py::test_sageattn_shapes[accurate-b2h4:4-1000x1000-d128-full-NHD-bf16]",
        gpu=True)
def _kernel_drops_smooth_k(patch: pytest.MonkeyPatch) -> None:
    """(Caught by the float64 bound alone, on inputs whose K has channel offsets: the emulation
    gives 0.043 against the accurate tier's 0.03 there, 0.015 with K smoothed.)"""
    import dataclasses

    from sageattention2 import _execute

    real = _execute.KernelCall.of

    def of(call: Any, choice: Any) -> Any:
        return dataclasses.replace(real(call, choice), smooth_k=False)

    patch.setattr(_execute.KernelCall, "of", staticmethod(of))


@mutant("adaptive-restart-off-by-one",
        "AppliedPlan.restart() sets the step to 0, so the next forward counts as step 1",
        "test_adaptive.py::test_restart_counts_steps_from_zero")
def _adaptive_restart_off_by_one(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import adaptive

    def restart(self: Any) -> None:
        self._tracker.step = 0

    patch.setattr(adaptive.AppliedPlan, "restart", restart)


@mutant("adaptive-calibrate-ignores-repeats",
        "calibrate(repeats=n) runs the model once",
        "test_adaptive.py::test_calibrate_repeats")
def _adaptive_calibrate_ignores_repeats(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import adaptive

    _wrap(patch, adaptive, "calibrate",
          lambda real, *args, **kwargs: real(*args, **{**kwargs, "repeats": 1}))


class _StepsRunOn:
    """A site tracker whose step count is never set back (calibrate's ``tracker.step = -1``
    before each repeat is lost): the steps of the second repeat follow the first's."""

    def __init__(self, tracker: Any) -> None:
        self.__dict__["_tracker"] = tracker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tracker, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not (name == "step" and value == -1 and self._tracker.step >= 0):
            setattr(self._tracker, name, value)


@mutant("adaptive-calibrate-steps-run-on",
        "calibrate's repeats do not restart the step count (steps 0-3 for two runs of two)",
        "test_adaptive.py::test_calibrate_repeats")
def _adaptive_calibrate_steps_run_on(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import adaptive

    real = adaptive._SiteTracker
    patch.setattr(adaptive, "_SiteTracker", lambda *args, **kwargs: _StepsRunOn(real(*args, **kwargs)))


@mutant("adaptive-calibrate-keeps-one-repeat",
        "the plan takes each call's first repeat's measurement, not the mean of the repeats",
        "test_adaptive.py::test_calibrate_repeats")
def _adaptive_calibrate_keeps_one_repeat(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import adaptive

    def first_only(real: Callable[..., Any], measured: Any, *args: Any, **kwargs: Any) -> Any:
        kept = {call: {name: runs[:1] for name, runs in variants.items()}
                for call, variants in measured.items()}
        return real(kept, *args, **kwargs)

    _wrap(patch, adaptive, "choose", first_only)


@mutant("adaptive-variants-run-exact",
        "the adaptive plan's variants (calibrated and applied) run exact SDPA, not the kernel",
        "test_adaptive.py::test_calibrate_on_the_gpu", gpu=True)
def _adaptive_variants_run_exact(patch: pytest.MonkeyPatch) -> None:
    import torch

    from sageattention2 import adaptive

    def exact(*args: Any, qk_quant: str = "auto", pv_quant: str = "auto", **kwargs: Any) -> Any:
        return torch._C._nn.scaled_dot_product_attention(*args, **kwargs)

    patch.setattr(adaptive, "sageattn", exact)


def _exact_fallback_scale_off(patch: pytest.MonkeyPatch) -> None:
    """The exact fallback's SDPA with its softmax scale 1e-3 too large."""
    import math

    from sageattention2 import _execute

    def off(real: Callable[..., Any], q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        scale = kwargs.get("scale")
        kwargs["scale"] = (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale) * (1 + 1e-3)
        return real(q, k, v, *args, **kwargs)

    _wrap(patch, _execute, "_exact_sdpa", off)


mutant("exact-fallback-scale-off", "the exact fallback's softmax scale is off by 1e-3",
       "test_fuzz.py::test_fuzz_on_cpu[0]")(_exact_fallback_scale_off)
mutant("exact-fallback-scale-off-on-gpu",
       "the exact fallback's softmax scale is off by 1e-3 (the GPU's fallbacks)",
       "test_fuzz.py::test_fuzz_on_the_gpu[9]", gpu=True)(_exact_fallback_scale_off)


@mutant("quantize-kv-small-output-unwritten",
        "quantize_kv leaves the last element of k_scale (a small output) unwritten",
        "test_preprocess_gpu.py::test_quantize_kv_bit_exact[64-int8-fp16-hnd-1x2x2x1x1x128]",
        gpu=True)
def _quantize_kv_small_output_unwritten(patch: pytest.MonkeyPatch) -> None:
    import torch

    from sageattention2 import ops

    def unwritten(real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        fresh = torch.empty_like(out.k_scale)  # (<= 1 MB: the allocator's small pool)
        fresh.view(-1)[:-1] = out.k_scale.reshape(-1)[:-1]
        return out._replace(k_scale=fresh)

    _wrap(patch, ops, "quantize_kv", unwritten)


@mutant("kernel-wrong-on-one-call",
        "the Hopper kernel's output is wrong (one element) on the third of a run of calls",
        "test_attention_wgmma_gpu.py::test_items_of_one_or_two_tiles_do_not_hang[fp8]", gpu=True)
def _kernel_wrong_on_one_call(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import ops

    calls = [0]

    def wrong_once(real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out, lse = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == 3:
            out = out.clone()
            out[(0,) * out.dim()] += 1
        return out, lse

    _wrap(patch, ops, "sageattn_wgmma", wrong_once)


@mutant("bottom-right-blind-rows-unwritten",
        "causal bottom-right with more queries than keys leaves the rows that see no key "
        "unwritten (instead of 0)",
        "test_causal_alignment.py::test_bottom_right_on_the_gpu[4096-1000]", gpu=True)
def _bottom_right_blind_rows_unwritten(patch: pytest.MonkeyPatch) -> None:
    import torch

    from sageattention2 import _execute

    def unwritten(real: Callable[..., Any], call: Any, choice: Any) -> Any:
        out, lse = real(call, choice)
        blind = call.q.shape[2] - call.k.shape[2]
        if blind > 0:
            fresh = torch.empty_like(out)
            fresh[:, :, blind:] = out[:, :, blind:]
            out = fresh
        return out, lse

    _wrap(patch, _execute, "_bottom_right", unwritten)

# --- kernels, varlen, adaptive (end) ---

# --- other (begin) ---
@mutant("ring-skips-later-shards",
        "the ring skips the shards after its own rank's also without is_causal",
        "test_parallel.py::test_two_ranks_on_the_cpu")
def _ring_skips_later_shards(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import parallel

    _wrap(patch, parallel, "_shard_causality",
          lambda real, is_causal, owner, rank: None if owner > rank else real(is_causal, owner, rank))


@mutant("ulysses-lse-heads-misplaced",
        "Ulysses brings the LSE back with the heads of the ranks in the wrong order",
        "test_parallel.py::test_two_ranks_on_the_cpu")
def _ulysses_lse_heads_misplaced(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import parallel

    _wrap(patch, parallel, "_lse_heads_to_tokens",
          lambda real, lse, group, split: real(lse, group, split).roll(lse.shape[1], dims=1))
@mutant("agreement-ignores-peers",
        "the ranks' agreement through their sockets returns this rank's own record, as if every "
        "rank agreed: a bad input on one rank leaves the others in the collective",
        "test_parallel.py::test_two_ranks_on_the_cpu")
def _agreement_ignores_peers(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import parallel

    _wrap(patch, parallel._HostMesh, "max", lambda real, self, values: list(values))


def _next_rank_for_own(patch: pytest.MonkeyPatch, exchange: str) -> None:
    """``_peer_exchange.<exchange>(q, k, v, memory, ...)`` given the next rank's index for this
    rank's (and no views kept from a right call)."""
    from sageattention2 import _peer_exchange

    _wrap(patch, _peer_exchange, exchange, lambda real, q, k, v, memory, *rest: real(
        q, k, v, dataclasses.replace(memory, rank=(memory.rank + 1) % len(memory.buffers), layouts={}),
        *rest))


@mutant("ulysses-peers-rank-off-by-one",
        "Ulysses through the peers' memory takes the next rank's index for its own: its rows land "
        "in another rank's place and it reads another rank's heads",
        "test_parallel.py::test_ulysses_through_peer_memory")
def _ulysses_peers_rank_off_by_one(patch: pytest.MonkeyPatch) -> None:
    _next_rank_for_own(patch, "tokens_to_heads")


@mutant("ulysses-halves-rank-off-by-one",
        "Ulysses in halves of the heads takes the next rank's index for its own: its rows and its "
        "output land in another rank's place",
        "test_parallel.py::test_ulysses_in_halves_through_peer_memory")
def _ulysses_halves_rank_off_by_one(patch: pytest.MonkeyPatch) -> None:
    _next_rank_for_own(patch, "ulysses_in_halves")


@mutant("halves-second-half-not-awaited",
        "Ulysses in halves runs the second half's kernel without waiting for the peers' signals "
        "(PeerMemory.wait on its channel does nothing): it reads rows not yet written",
        "test_parallel.py::test_ulysses_in_halves_through_peer_memory")
def _halves_second_half_not_awaited(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _peer_exchange

    _wrap(patch, _peer_exchange.PeerMemory, "wait",
          lambda real, memory, channel, peers=None: None if channel == 1 else real(memory, channel, peers))


@mutant("ring-gather-not-awaited",
        "the ring's gather through the peers' memory reads the peers' rows without waiting for "
        "their signals (PeerMemory.wait on the ring's channel does nothing)",
        "test_parallel.py::test_ring_all_gather_through_peer_memory")
def _ring_gather_not_awaited(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _peer_exchange

    _wrap(patch, _peer_exchange.PeerMemory, "wait", lambda real, memory, channel, peers=None: None
          if channel == _peer_exchange.RING_CHANNEL else real(memory, channel, peers))


@mutant("ring-gather-awaits-first-owner-only",
        "the ring's kernels on every peer's shard wait only for the first owner's row (the one "
        "each rank attends first), not for each owner's own",
        "test_parallel.py::test_ring_all_gather_through_peer_memory")
def _ring_gather_awaits_first_owner_only(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _peer_exchange

    _wrap(patch, _peer_exchange, "wait_for_row", lambda real, memory, owner: real(memory, owner)
          if owner == (memory.rank + 1) % len(memory.buffers) else None)


@mutant("ring-sends-before-peers-read",
        "the ring's gather sends a call's row into the peers' buffers without waiting until every "
        "peer has read the last call's (the wait on the readers' channel does nothing)",
        "test_parallel.py::test_ring_all_gather_through_peer_memory")
def _ring_sends_before_peers_read(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _peer_exchange

    _wrap(patch, _peer_exchange.PeerMemory, "wait_caught_up", lambda real, memory, channel: None)


@mutant("halves-send-before-peers-read",
        "Ulysses in halves sends its rows into the peers' buffers without waiting until every peer "
        "has ended its last exchange through them (its wait on the readers' channel does nothing)",
        "test_parallel.py::test_ulysses_after_the_ring_waits_for_its_readers")
def _halves_send_before_peers_read(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _peer_exchange

    def without_the_wait(real: Any, q: Any, k: Any, v: Any, memory: Any, *args: Any, **kwargs: Any) -> Any:
        memory.wait_caught_up = lambda channel: None
        try:
            return real(q, k, v, memory, *args, **kwargs)
        finally:
            del memory.wait_caught_up

    _wrap(patch, _peer_exchange, "ulysses_in_halves", without_the_wait)


@mutant("exchanges-end-without-done-reading",
        "no exchange through the peers' memory tells the peers it has read its buffer (done_reading "
        "does nothing): the ring's gather after a Ulysses call sends into buffers still being read",
        "test_parallel.py::test_ring_after_ulysses_waits_for_its_readers")
def _exchanges_end_without_done_reading(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _peer_exchange

    patch.setattr(_peer_exchange.PeerMemory, "done_reading", lambda memory: None)


@mutant("merge-parts-weights-by-first-lse",
        "merging attention parts weighs every part by the first part's LSE (the parts as if they "
        "saw equally many keys)",
        "test_parallel.py::test_merge_parts_on_the_cpu")
def _merge_parts_weights_by_first_lse(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import _execute

    _wrap(patch, _execute, "merge_parts", lambda real, outs, lses, out_nhd: real(
        outs, [lses[0]] * len(lses), out_nhd))


@mutant("compat-drops-softmax-scale",
        "the drop-in ignores flash-attn's softmax_scale= (as the authors' function does)",
        "test_compat.py::test_keywords_are_translated", "test_compat.py::test_callers_on_the_cpu")
def _compat_drops_softmax_scale(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import compat

    def translate(real: Any, function: str, given: dict[str, Any]) -> dict[str, Any]:
        given = dict(given, kwargs={n: v for n, v in given["kwargs"].items() if n != "softmax_scale"})
        return real(function, given)

    _wrap(patch, compat, "_translate", translate)


@mutant("compat-lse-in-log2",
        "the drop-in returns the LSE in base 2 (the kernels' internal form)",
        "test_compat.py::test_outputs_and_lse_on_the_cpu", "test_compat.py::test_callers_on_the_cpu")
def _compat_lse_in_log2(patch: pytest.MonkeyPatch) -> None:
    from sageattention2 import compat

    def run(real: Any, *args: Any) -> Any:
        result = real(*args)
        return (result[0], result[1] * 1.4426950408889634) if isinstance(result, tuple) else result

    _wrap(patch, compat, "_run", run)
# --- other (end) ---


if __name__ == "__main__":
    width = max(len(name) for name in MUTANTS)
    for m in MUTANTS.values():
        print(f"{m.name:<{width}}  {'GPU' if m.gpu else 'CPU'}  {m.what}")
    sys.exit(0)
