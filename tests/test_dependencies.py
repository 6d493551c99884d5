"""Every third-party package the code imports is declared in pyproject.toml: the runtime packages' imports
in `dependencies`, loadtest's in `dependencies` or its extras. A package that only arrives through another
(huggingface_hub through transformers) breaks the day that one stops requiring it."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGES = ("cluster", "deployments", "router", "llm_stage", "detok_stage", "core", "protos")
FIRST_PARTY = {*RUNTIME_PACKAGES, "loadtest", "tests"}
# Imported but deliberately not declared, with the reason.
UNDECLARED_OK = {
    "triton": "optional (guarded import): CUDA builds of torch bring it; the tests' extra pins it for the CPU",
    "vllm": "loadtest/baselines run it from their own venv (make vllm-venv)",
    "librosa": "loadtest/golden: regenerating a golden file against the reference, not part of any run",
    "s3tokenizer": "loadtest/golden: as librosa",
}


def _imported_top_levels(packages: tuple[str, ...]) -> dict[str, str]:
    """Top-level module name -> one file importing it, for absolute imports outside the stdlib and our own."""
    found: dict[str, str] = {}
    for package in packages:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            try:
                tree = ast.parse(path.read_text())
            except SyntaxError:
                continue  # not this test's concern: ruff (make lint) and importing it report it
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in (name.split(".")[0] for name in names):
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                        found.setdefault(top, str(path.relative_to(REPO_ROOT)))
    return found


def _declared(*extras: str) -> set[str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _undeclared(packages: tuple[str, ...], declared: set[str]) -> list[str]:
    """Imports none of whose distributions (in this venv) is declared, e.g. `google` -> protobuf or
    googleapis-common-protos is enough."""
    providers = metadata.packages_distributions()
    missing = []
    for top, where in sorted(_imported_top_levels(packages).items()):
        if top in UNDECLARED_OK:
            continue
        distributions = {canonicalize_name(name) for name in providers.get(top, [top])}
        if not distributions & declared:
            missing.append(f"{top} (imported by {where}; distribution {sorted(distributions)})")
    return missing


def test_runtime_imports_are_declared_dependencies() -> None:
    assert _undeclared(RUNTIME_PACKAGES, _declared()) == []


def test_loadtest_imports_are_declared_with_its_extras() -> None:
    assert _undeclared(("loadtest",), _declared("loadtest", "test")) == []


def test_huggingface_hub_is_declared_for_core_checkpoints() -> None:
    assert "huggingface_hub" in _imported_top_levels(("core",))  # the import this test was written for
    assert "huggingface-hub" in _declared()
