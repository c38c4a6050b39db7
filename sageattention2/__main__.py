"""Command line: ``python -m sageattention2 info`` (the build, the GPU and what sageattn runs
there) and ``python -m sageattention2 routing-table`` (README.md's "Which GPU runs what", from
the routing rules)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from . import __version__, ops
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
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sageattention2", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("info", help="versions, compiled kernels, GPU and what sageattn runs")
    commands.add_parser("routing-table",
                        help="which kernel serves which call, and why calls fall back (Markdown)")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(_info())
    elif args.command == "routing-table":
        print(routing_table_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
