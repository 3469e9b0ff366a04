"""One import namespace: the project installs as `lowmem.*`, and the repository's folders shadow nothing.

`kernels` is Hugging Face's package (transformers imports it), `recipes`, `suite` and `diffusion` are PyPI
names, `fastfold` is hpcaitech FastFold's. The tests run against the installed package (pytest's `append`
import mode keeps the checkout last on sys.path), so these checks see what a user's interpreter sees.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("utils", "kernels", "core_parallel", "diffusion", "fastfold", "recipes", "suite")


def _sources():
    for folder in FOLDERS:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_project_modules_import_as_lowmem_from_the_checkout_folders():
    import lowmem.core_parallel
    import lowmem.kernels
    import lowmem.recipes

    for name, mod in (("kernels", lowmem.kernels), ("core_parallel", lowmem.core_parallel),
                      ("recipes", lowmem.recipes)):
        assert mod.__name__ == f"lowmem.{name}"
        assert Path(mod.__file__).resolve() == ROOT / name / "__init__.py"
    from lowmem.recipes import GeminiStrategy, ZeroStrategy

    assert GeminiStrategy.__module__ == "lowmem.recipes.strategies"
    assert ZeroStrategy.__module__ == "lowmem.recipes.strategies"


def test_no_absolute_import_of_a_project_folder_and_no_namespace_string():
    """Inside the project, imports are relative and no string names `lowmem.` (one place owns the name)."""
    bad = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] in (*FOLDERS, "lowmem"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in (*FOLDERS, "lowmem"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"lowmem(\.\w+)+(:\w+)?", node.value.strip()):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: string {node.value!r}")
    assert not bad, "\n".join(bad)


def test_no_lowmem_folder_in_the_checkout():
    """An implicit namespace: a `lowmem/` folder at the root would shadow the installed mapping."""
    assert not (ROOT / "lowmem").exists()


def test_top_level_names_stay_free_for_their_owners():
    """With Hugging Face's `kernels` installed, `import kernels` is theirs and ours is `lowmem.kernels`."""
    spec = importlib.util.find_spec("kernels")
    if spec is None:
        pytest.skip("Hugging Face's kernels package is not installed")
    assert Path(spec.origin).resolve().parent != ROOT / "kernels", "the checkout's kernels/ shadows Hugging Face's"
    # the checkout may be on sys.path (for `tests.*`), but only behind everything installed
    paths = [Path(p).resolve() if p else Path.cwd() for p in sys.path]
    if ROOT in paths:
        assert all(p == ROOT for p in paths[paths.index(ROOT):]), sys.path


def test_a_fresh_interpreter_gets_both_packages_and_transformers_imports():
    """What a user's `python -c` sees outside the checkout: transformers (which imports Hugging Face's
    `kernels` from 5.25 on) and our attention processor both work, and ours does not fall back to SDPA."""
    if importlib.util.find_spec("kernels") is None:
        pytest.skip("Hugging Face's kernels package is not installed")
    code = (
        "import kernels, transformers, lowmem.kernels, os;"
        "from lowmem.diffusion import attention as a;"
        "import torch;"
        "q = torch.randn(1, 2, 5, 4);"
        "o = a._core_attention(q, q, q, None, 0.5, 'torch');"
        "print(os.path.realpath(kernels.__file__));"
        "print(os.path.realpath(lowmem.kernels.__file__));"
        "print(a._kernel_attention is lowmem.kernels.attention"
        " and torch.allclose(o, lowmem.kernels.attention_reference(q, q, q, scale=0.5)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT.parent, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    hub, ours, same = out.stdout.strip().splitlines()[-3:]
    assert Path(hub).parent != ROOT / "kernels"
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert same == "True", "diffusion attention did not run our kernels.attention"


# Arrows only point down: a folder imports only folders of a lower rank (diffusion and fastfold share one rank
# and do not import each other); `utils` is the plumbing below them all.
_RANK = {"utils": 0, "kernels": 1, "core_parallel": 2, "diffusion": 3, "fastfold": 3, "recipes": 4, "suite": 5}


def test_imports_point_down_the_layers():
    bad = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        here = rel.parts[0]
        package = list(rel.parts[:-1])  # the importing module's package, as folder names
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level > 0):
                continue
            base = package[: len(package) - (node.level - 1)]
            full = base + (node.module.split(".") if node.module else [])
            # `from .. import kernels` names the folder in the imported names
            targets = full[:1] or [alias.name.split(".")[0] for alias in node.names]
            for there in targets:
                if there not in _RANK:
                    bad.append(f"{rel}:{node.lineno}: import of {there!r} above the namespace")
                elif there != here and _RANK[there] >= _RANK[here]:
                    bad.append(f"{rel}:{node.lineno}: {here} imports {there}")
    assert not bad, "\n".join(bad)
