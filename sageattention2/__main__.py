"""Command line: ``python -m sageattention2 info`` (the build, the GPU and what sageattn runs
there), ``routing-table`` (README.md's "Which GPU runs what", from the routing rules) and
``tune`` (measure where exact SDPA is faster than the quantized kernel on this GPU: the
crossover that ``qk_quant="auto"`` follows), ``check`` (every kernel variant's accuracy on this
GPU, PASS/FAIL), ``bench`` (sageattn against SDPA: the ANCHORS shapes, whole models, their
training step) and ``calibrate`` (the adaptive plan of a suite model, and its forward under
each choice)."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from . import __version__, _crossover, _model_suite, _plan, ops
from ._plan import routing_table_markdown
from .api import kernel_plan


def _info() -> str:
    torch_cuda = torch.version.cuda or "none (CPU-only build)"
    lines = [f"sageattention2 {__version__}", f"torch {torch.__version__} (CUDA {torch_cuda})"]
    info = ops.build_info()
    if info is None:
        lines.append(f"extension: not available ({ops.EXTENSION_ERROR})")
    else:
        lines.append(
            f"extension: built with CUDA {info.cuda_version} for "
            f"{', '.join(info.archs) or 'no architectures'}"
        )
        extension = Path(ops._C.__file__).resolve()
        if extension.parent != Path(__file__).resolve().parent:  # a checkout's sources, run here
            lines.append(f"  loaded from the installed build of these sources: {extension}")
        built = {family: ", ".join(archs) or "-" for family, archs in info.kernels.items()}
        width = max((len(family) for family in built), default=0)
        arch_width = max((len(archs) for archs in built.values()), default=0)
        for family, archs in built.items():
            description = info.descriptions.get(family, "")
            lines.append(f"  {family:<{width}}  {archs:<{arch_width}}  {description}".rstrip())
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"GPU: {torch.cuda.get_device_name()} (sm_{major}{minor})")
    else:
        lines.append("GPU: no CUDA GPU")
    lines.append(f"sageattn plan: {kernel_plan()}")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        table = _crossover.table_for(device, _plan.cuda_capability(device))
        lines.append("qk_quant='auto': " + (
            f"exact SDPA where it is faster, by the crossover {table.describe()}"
            if table is not None else
            "always quantized (no crossover table for this GPU: python -m sageattention2 tune "
            f"measures one; {_crossover.ENVIRONMENT}=off turns it off)"))
    return "\n".join(lines)


def _without_gpu(command: str, why: str) -> bool:
    """True, after saying so in one line, when no CUDA GPU is available for ``command`` (what
    ``check`` does too: a command that measures the GPU it runs on ends with exit code 1 and
    no traceback, instead of failing halfway or running something else)."""
    if torch.cuda.is_available():
        return False
    print(f"{command}: needs a CUDA GPU ({why})")
    return True


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``bench``: the shapes and/or the models; what cannot run here is said and skipped, or an
    error where it was asked for by name. Without a CUDA GPU it runs nothing unless ``--device``
    names another device: the full model suite on a CPU takes an hour, which no one asks for by
    typing ``bench`` alone."""
    if args.train and args.models is None:
        parser.error("bench --train times the models' training step: give --models [KEY ...]")
    if args.train and args.gpus is not None:
        parser.error("bench --train runs on one GPU: not with --gpus (the context-parallel suite "
                     "times forwards)")
    if args.gpus is not None:
        return _bench_gpus(parser, args)
    shapes = args.shapes or args.models is None
    models = args.models is not None or not args.shapes
    unknown = sorted(set(args.models or ()) - {c.key for c in _model_suite.CASES})
    if unknown:
        parser.error(f"bench --models: unknown model(s) {', '.join(unknown)}")
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and _without_gpu(
            "bench", "it times sageattn against SDPA there; --models --device cpu runs the models "
                     "on the CPU"):
        return 1
    if shapes:
        if device.type != "cuda":
            if args.shapes:
                print(f"bench: --shapes needs a CUDA GPU, not --device {args.device}")
                return 1
            print("bench: the ANCHORS shapes need a CUDA GPU: skipped", file=sys.stderr)
        else:
            from . import _bench_shapes

            _bench_shapes.run(args.out)
    if models:
        missing = [name for name in ("diffusers", "transformers")
                   if importlib.util.find_spec(name) is None]
        if missing:
            message = (f"the model suite needs {' and '.join(missing)}: pip install "
                       '"sageattention2[models]"')
            if args.models is not None:
                parser.error(f"bench --models: {message}")
            print(f"bench: {message}; skipped", file=sys.stderr)
        else:
            from . import _bench_models

            _bench_models.run(args.models, device, args.tiny, args.reps, args.out, args.seconds,
                              args.train)
    return 0


def _bench_gpus(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``bench --models [KEY...] --gpus N``: the context-parallel suite on N GPUs of this host."""
    from . import _bench_parallel

    if args.shapes or args.models is None:
        parser.error("bench --gpus runs models: give --models [KEY ...] "
                     f"({', '.join(_bench_parallel.CASES)})")
    keys = args.models or list(_bench_parallel.CASES)
    unknown = sorted(set(keys) - set(_bench_parallel.CASES))
    if unknown:
        parser.error(f"bench --gpus: unknown model(s) {', '.join(unknown)}; context parallelism "
                     f"runs {', '.join(_bench_parallel.CASES)}")
    if args.gpus < 2:
        parser.error(f"bench --gpus: at least 2, got {args.gpus}")
    if _without_gpu("bench", "context parallelism runs on GPUs"):
        return 1
    if torch.cuda.device_count() < args.gpus:
        print(f"bench: --gpus {args.gpus} needs {args.gpus} GPUs, this machine has "
              f"{torch.cuda.device_count()}")
        return 1
    _bench_parallel.run(keys, args.gpus, max(1, min(args.reps, 5)), args.out)
    return 0


def _check_command(args: argparse.Namespace) -> int:
    """``check``: its exit code is the check's (1 when a variant fails or no GPU is here)."""
    from . import _check

    return _check.run(args.quick, args.path)


def _dtypes(text: str) -> tuple[str, ...]:
    """``tune --dtypes``: comma-separated float16 and/or bfloat16 (argparse's type: a bad list
    is a usage error before anything runs)."""
    from . import _tune

    dtypes = tuple(text.split(","))
    if not set(dtypes) <= set(_tune.DTYPES):  # ("" and "float16," name "" too)
        raise argparse.ArgumentTypeError(
            f"must name float16 and/or bfloat16 (comma-separated), got {text!r}")
    return dtypes


def _tune_command(args: argparse.Namespace) -> int:
    """``tune``: measure and write the crossover table of this GPU."""
    from . import _tune

    if _without_gpu("tune", "it measures the crossover of the GPU it runs on"):
        return 1
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    path = _tune.tune(axes=_tune.QUICK_AXES if args.quick else None,
                      head_dims=args.head_dims or _tune.HEAD_DIMS, dtypes=args.dtypes,
                      causal=causal, out=args.out, base=args.base, pv_quant=args.pv_quant)
    print(f"wrote {path}")
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sageattention2", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("info", help="versions, compiled kernels, GPU and what sageattn runs")
    commands.add_parser("routing-table",
                        help="which kernel serves which call, and why calls fall back (Markdown)")
    tune = commands.add_parser(
        "tune", help="measure where exact SDPA is faster than the quantized kernel on this GPU "
                     "(the crossover of qk_quant='auto'; 24 classes of 12-23 s: 5-8 minutes on an "
                     "H100, 6 on an H200)")
    tune.add_argument("--quick", action="store_true", help="a coarser grid (a few seconds)")
    tune.add_argument("--head-dims", type=_ints, default=None,
                      help="comma-separated head_dims (default: 40,64,80,128,160,256)")
    tune.add_argument("--dtypes", type=_dtypes, default=("float16", "bfloat16"),
                      help="float16 and/or bfloat16, comma-separated (default: both)")
    tune.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                      help="the causal classes, the others, or both (default)")
    tune.add_argument("--base", type=Path, default=None,
                      help="a table of this GPU on the same grid: the classes not measured now "
                           "are kept from it")
    tune.add_argument("--pv-quant", choices=("auto", "none"), default="auto",
                      help="none: the table of the accurate tier (PV in the input dtype), a file of "
                           "its own beside the default one")
    tune.add_argument("--out", default=None,
                      help="where to write the table (default: the one sageattn reads for this "
                           "GPU model, under ~/.cache/sageattention2/crossover/)")
    check = commands.add_parser(
        "check", help="the accuracy of every kernel variant this GPU runs, PASS/FAIL (a GPU)")
    check.add_argument("--quick", action="store_true", help="without the shapes of 2K keys and more")
    check.add_argument("--path", choices=("all", "wgmma", "mma"), default="all",
                       help="the Hopper kernel, the warp-level one, or both (default)")
    calibrate = commands.add_parser(
        "calibrate", help="the adaptive plan of a model of the suite (each attention call site's "
                          "fastest variant within an error budget) and the forward under it")
    calibrate.add_argument("--model", required=True, choices=[c.key for c in _model_suite.CASES])
    calibrate.add_argument("--budget", type=float, nargs="+", default=[0.003, 0.01],
                           help="errors allowed per call, 1 - CosSim * (1 - rel. L1) (default: "
                                "0.003 0.01)")
    calibrate.add_argument("--steps", type=int, default=1, help="forwards per run (default 1)")
    calibrate.add_argument("--reps", type=int, default=5, help="timed runs per configuration")
    calibrate.add_argument("--tiny", action="store_true", help="tiny widths and resolutions")
    calibrate.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    calibrate.add_argument("--out", type=Path, default=None,
                           help="folder for the plans (JSON) and the table")
    bench = commands.add_parser(
        "bench", help="sageattn against SDPA on this GPU: the ANCHORS shapes (TOPS) and whole "
                      "models (the model suite needs the [models] extra); both by default; "
                      "--models --train: the models' training step")
    bench.add_argument("--shapes", action="store_true", help="the ANCHORS shapes only")
    bench.add_argument("--models", nargs="*", metavar="KEY", default=None,
                       help="the model suite only, or these of its models: " + ", ".join(
                           c.key for c in _model_suite.CASES))
    bench.add_argument("--train", action="store_true",
                       help="--models: a training step (forward, backward, AdamW) instead of the "
                            "forward, sageattn with SAGEATTN_TRAINING=quantized "
                            "(models_train.md/png)")
    bench.add_argument("--tiny", action="store_true",
                       help="tiny widths and resolutions: every call site, in seconds")
    bench.add_argument("--device", default=None,
                       help="default: cuda (without a CUDA GPU bench runs nothing: --device cpu "
                            "runs the models on the CPU, slowly)")
    bench.add_argument("--reps", type=int, default=10,
                       help="timed forwards (steps) per mode (median), at least")
    bench.add_argument("--seconds", type=float, default=2.0,
                       help="--models: time each mode this long at least (more forwards or steps "
                            "for short models, up to 400; 0: exactly --reps)")
    bench.add_argument("--out", type=Path, default=None,
                       help="folder for the tables and charts (shapes.md/png, models.md/png, "
                            "models_train.md/png)")
    bench.add_argument("--gpus", type=int, default=None, metavar="N",
                       help="--models on N GPUs of this host under context parallelism (diffusers' "
                            "native backends against ours, each mode; parallel.md/png): wan, wan14b, "
                            "flux2k")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(_info())
    elif args.command == "routing-table":
        print(routing_table_markdown())
    elif args.command == "tune":
        return _tune_command(args)
    elif args.command == "check":
        return _check_command(args)
    elif args.command == "bench":
        return _bench(parser, args)
    elif args.command == "calibrate":
        from . import _calibrate

        if any(not b >= 0 for b in args.budget):
            parser.error(f"calibrate --budget: non-negative errors, got {args.budget}")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        _calibrate.run(args.model, args.budget, args.steps, args.reps, device, args.tiny, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
