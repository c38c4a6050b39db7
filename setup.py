"""Build of the sageattention2 CUDA extension (torch.utils.cpp_extension).

Install with ``pip install --no-build-isolation .`` in an environment that already has torch.
TORCH_CUDA_ARCH_LIST narrows the archs (default "8.0;8.6;8.9;9.0a;10.0;12.0"); MAX_JOBS parallelises nvcc.
SAGEATTENTION2_SKIP_CUDA=1 installs the pure-Python package only (reference and fallbacks).
"""
from __future__ import annotations

import os
from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).parent
DEFAULT_ARCHS = "8.0;8.6;8.9;9.0a;10.0;12.0"


def read_version() -> str:
    scope: dict[str, str] = {}
    exec((ROOT / "sageattention2" / "_version.py").read_text(), scope)
    return scope["__version__"]


def arch_flags(arch_list: str) -> tuple[list[str], list[str]]:
    """nvcc -gencode flags and arch names for entries like "8.0", "8.9", "9.0a", "9.0+PTX"."""
    flags, names = [], []
    for entry in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        ptx = entry.endswith("+PTX")
        entry = entry.removesuffix("+PTX")
        suffix = "a" if entry.endswith("a") else ""
        num = entry.removesuffix("a").replace(".", "")
        # The -gencode form is needed for sm_90a: it assembles wgmma/setmaxnreg in one pass.
        flags.append(f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num}{suffix},code=compute_{num}{suffix}")
        names.append(f"sm_{num}{suffix}")
    return flags, names


def read_source_list(path: Path) -> list[str]:
    """The paths of a source list: one a line; blank lines and lines starting with '#' skipped
    (CMakeLists.txt reads it by the same rule)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def runtime_libstdcxx() -> list[str]:
    """The shared libstdc++ this process (with torch imported) runs with, as a link argument.

    Some toolchains find only libstdc++.a (e.g. a g++ wrapper whose -B dirs hold no
    libstdc++.so, as on our H100 image): the extension then carries a private static
    libstdc++ beside the shared one torch uses, and the first integer formatted into an error
    message crashes in its uninitialised locale. Linking the very library torch loaded keeps one
    libstdc++ per process; a compiler needing a newer one fails at link time, not at run time.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libstdc++.so" in line}
    except OSError:
        return []
    return sorted(paths)[:1]


def extensions() -> tuple[list, dict]:
    if os.environ.get("SAGEATTENTION2_SKIP_CUDA") == "1":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
    gencode, names = arch_flags(arch_list)
    # torch adds no arch flags of its own when the nvcc flags already name an arch.
    csrc = ROOT / "csrc"
    # csrc/sources.txt lists the op library (CMakeLists.txt builds it from the same list); the
    # Python module (its entry and the call cache) comes on top.
    sources = [f"csrc/{path}" for path in read_source_list(csrc / "sources.txt")] + [
        "csrc/torch/module.cpp", "csrc/torch/call_cache.cpp"]
    define = [f'-DSAGE_ARCH_LIST="{",".join(names)}"']
    ext = CUDAExtension(
        name="sageattention2._C",
        sources=sources,
        include_dirs=[str(csrc)],
        extra_link_args=runtime_libstdcxx(),
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", *define],
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", *gencode, *define],
        },
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions()

setup(
    name="sageattention2",
    version=read_version(),
    # sageattention2.crossover holds data only (the measured crossovers of qk_quant="auto",
    # sageattention2/_crossover.py): a namespace package, so that setuptools ships it as one.
    packages=find_namespace_packages(include=["sageattention2", "sageattention2.*"],
                                     exclude=["*.__pycache__"]),
    package_data={"sageattention2.crossover": ["*.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
