"""Shared pytest configuration, and which sageattention2 the tests run against.

``pytest tests`` and ``python -m pytest tests`` see different ``sys.path`` (``python -m`` puts
the working directory, usually the checkout, in front of site-packages), so without a rule they
would test different code. This file decides, before any test imports ``sageattention2``:

1. an installed sageattention2 (found with the checkout taken off ``sys.path``) whose Python
   sources, ``sageattention2/*.py``, are the checkout's: the tests run against it and its
   compiled extension (unless only the checkout has one: then against the checkout, whose
   sources are the same);
2. an installed one whose sources differ from the checkout's: the tests run against the checkout
   if it has an in-place build (``sageattention2/_C*.so``, from
   ``python setup.py build_ext --inplace``); otherwise collection fails, saying to reinstall
   (``pip install --no-build-isolation .``);
3. none installed: the checkout, with its in-place build if it has one.

The header names the package under test; when it has no compiled extension, a warning line (in
the header, and again after the results for ``-q`` runs, which have no header) says that the
extension and GPU tests skip, and why. CI (``pip install .``, then ``pytest tests`` from the
checkout) and the GPU machine (``pip install .``, then ``python3 -m pytest /repo/tests
--import-mode=importlib`` from another directory) both take case 1.

GPU tests carry the ``gpu`` marker and skip on machines without CUDA (CI has none); run them on
the device machine with ``scripts/device_check.sh``. Test helpers are in ``tests/helpers.py``
(this directory goes on ``sys.path`` for them; importlib mode does not put it there).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CHECKOUT_PACKAGE = REPO / "sageattention2"
REINSTALL = "pip install --no-build-isolation ."


def _is_checkout(entry: str) -> bool:
    try:
        return Path(entry or ".").resolve() == REPO
    except OSError:
        return False


def _has_extension(package: Path) -> bool:
    return any(package.glob("_C*.so"))


def _sources(package: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(package.glob("*.py"))}


def _choose_package() -> tuple[str, str | None]:
    """Put the package the tests must import first on ``sys.path``; return what it is, and the
    error that stops the run (None when there is none)."""
    sys.path[:] = [entry for entry in sys.path if not _is_checkout(entry)]
    if "sageattention2" in sys.modules:  # imported before this file ran (a plugin?): too late
        return "unknown", (f"sageattention2 was imported before tests/conftest.py could choose "
                           f"the package under test ({sys.modules['sageattention2'].__file__})")
    spec = importlib.util.find_spec("sageattention2")
    installed = Path(spec.origin).parent if spec is not None and spec.origin else None
    in_place_build = _has_extension(CHECKOUT_PACKAGE)
    same_sources = installed is not None and (
        installed == CHECKOUT_PACKAGE or _sources(installed) == _sources(CHECKOUT_PACKAGE))
    if same_sources and (_has_extension(installed) or not in_place_build):
        return f"the installed package ({installed})", None
    if installed is not None and not in_place_build:
        return "none", (f"the installed sageattention2 ({installed}) has other Python sources "
                        f"than this checkout ({CHECKOUT_PACKAGE}): the tests would test other "
                        f"code. Reinstall it from the checkout ({REINSTALL}), or build the "
                        "extension in place (python setup.py build_ext --inplace) to test the "
                        "checkout.")
    sys.path.insert(0, str(REPO))
    why = ("the installed one has no compiled extension" if same_sources
           else "the installed one has other sources" if installed is not None
           else "no sageattention2 is installed")
    return f"the checkout ({CHECKOUT_PACKAGE}; {why})", None


PACKAGE_UNDER_TEST, _PACKAGE_ERROR = _choose_package()
sys.path.insert(0, str(TESTS))  # for `import helpers`


def pytest_configure(config: pytest.Config) -> None:
    if _PACKAGE_ERROR is not None:
        raise pytest.UsageError(_PACKAGE_ERROR)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled extension")
    import mutants  # tests/mutants.py: a behaviour broken on purpose, before any test module loads

    if os.environ.get(mutants.ENVIRONMENT):
        mutants.apply(os.environ[mutants.ENVIRONMENT])


def _missing_extension_warning() -> str | None:
    from sageattention2 import ops

    if ops.HAS_EXTENSION:
        return None
    return (f"WARNING: sageattention2._C is not available ({ops.EXTENSION_ERROR}): the "
            f"extension and GPU tests will skip. Install the package ({REINSTALL}) or build it "
            "in place (python setup.py build_ext --inplace).")


def pytest_report_header(config: pytest.Config) -> list[str]:
    import sageattention2

    lines = [f"sageattention2 {sageattention2.__version__} under test: {PACKAGE_UNDER_TEST}"]
    warning = _missing_extension_warning()
    return lines if warning is None else [*lines, warning]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    if config.get_verbosity() >= 0 and not config.getoption("no_header"):
        return  # the header said it
    warning = _missing_extension_warning()
    if warning is not None:
        terminalreporter.write_line(warning, yellow=True, bold=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_fallback_warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts as if no fallback warning had been shown yet and no call had been made
    (sageattn remembers how it ran each kind of call: a test that pretends another GPU or build
    must not find a decision of another test), and with no crossover table: qk_quant="auto"
    always runs the quantized kernel, which is what the tests of the kernels test (the tests of
    the crossover, tests/test_crossover.py, give it their own tables); and with the INT4 guard
    off, so that qk_quant="int4" runs INT4 on every head, as the emulation does (the tests of the
    guard turn it on); and with nothing measured by the training guard (it remembers each kind
    of call's spread)."""
    from sageattention2 import _backward, _crossover, _execute

    monkeypatch.setenv(_crossover.ENVIRONMENT, "off")
    monkeypatch.setenv(_execute.INT4_GUARD_ENVIRONMENT, "off")
    _execute._warned_reasons.clear()
    _execute.clear_call_cache()
    _crossover.clear_cache()
    _backward.reset_guard()
    yield
    _execute._warned_reasons.clear()
    _execute.clear_call_cache()
    _crossover.clear_cache()
    _backward.reset_guard()


# ------------------------------------------------------------------------------------------------
# The GPU tests of the attention kernels (tests/test_*_gpu.py, helpers in gpu_helpers.py)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def attention_kernel() -> None:
    """Skip unless the quantized attention kernels can run on this machine's GPU."""
    from sageattention2 import _plan

    reason = _plan.device_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"the attention kernel cannot run here: {reason}")


@pytest.fixture
def wgmma_kernel() -> None:
    """Skip unless the build has attention_wgmma and this GPU runs its code (sm_90a)."""
    from sageattention2 import _plan, ops

    if not ops.has_op("attention_wgmma"):
        pytest.skip("this build has no attention_wgmma op")
    target = _plan.target_of(torch.device("cuda"))
    if not target.wgmma:
        major, minor = target.capability or (0, 0)
        pytest.skip(f"no attention_wgmma code for sm_{major}{minor} in this build")


@pytest.fixture
def mma_fp8_kernel() -> None:
    """Skip unless the build has attention_mma's FP8 PV variants for this GPU (sm_89+)."""
    from gpu_helpers import mma_fp8_on_device
    from sageattention2 import ops

    if not mma_fp8_on_device():
        capability = torch.cuda.get_device_capability()
        pytest.skip(f"no {ops.MMA_FP8_FAMILY} code for sm_{capability[0]}{capability[1]} in "
                    "this build")


@pytest.fixture(scope="session")
def dropin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The drop-in installed as the README says (pip, from compat/), into a folder of its own
    (copied first: setuptools writes build files next to the sources)."""
    root = tmp_path_factory.mktemp("dropin")
    shutil.copytree(Path(__file__).resolve().parents[1] / "compat", root / "src")
    site = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
                    "--no-deps", "--no-index", "--target", str(site), str(root / "src")],
                   check=True, capture_output=True, text=True)
    return site
