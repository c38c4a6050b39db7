"""Every mutant of tests/mutants.py is caught: its tests, run in a fresh pytest process with the
behaviour broken, fail (and they pass unbroken: they are part of this suite)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mutants

TESTS = Path(__file__).resolve().parent


def _param(m: mutants.Mutant) -> object:
    return pytest.param(m.name, id=m.name, marks=[pytest.mark.gpu] if m.gpu else [])


def run_with_mutant(name: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The mutant's tests in a fresh pytest process (the package conftest.py chooses, importlib
    mode as on the GPU machine), stopping at the first failure."""
    m = mutants.MUTANTS[name]
    env = dict(os.environ, **{mutants.ENVIRONMENT: name})
    return subprocess.run(
        [sys.executable, "-m", "pytest", *(str(TESTS / t) for t in m.tests), "-x", "-q", "-rf",
         "-p", "no:cacheprovider", "--import-mode=importlib", "--no-header"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("name", [_param(m) for m in mutants.MUTANTS.values()])
def test_mutant_is_caught(name: str, tmp_path: Path) -> None:
    result = run_with_mutant(name, tmp_path)
    summary = result.stdout.strip().splitlines()[-1:] or [""]
    only_skipped = re.fullmatch(r"\d+ skipped(, \d+ warnings?)? in .*", summary[0])
    if result.returncode == 0 and only_skipped:
        pytest.skip(f"mutant {name}: its tests skip here ({summary[0]}), so nothing can catch it")
    failed = re.search(r"\b(\d+) failed\b", summary[0])
    assert result.returncode == 1 and failed, (
        f"mutant {name} ({mutants.MUTANTS[name].what}) survived: exit code {result.returncode}\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-2000:]}")


def test_every_mutant_names_existing_tests() -> None:
    """Each mutant's tests are files (and functions) of this directory."""
    for m in mutants.MUTANTS.values():
        for test in m.tests:
            path, _, function = test.partition("::")
            assert (TESTS / path).is_file(), (m.name, test)
            name = function.split("[")[0]
            assert not name or f"def {name}(" in (TESTS / path).read_text(), (m.name, test)
