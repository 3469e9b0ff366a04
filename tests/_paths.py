"""A PYTHONPATH entry for test subprocesses that exposes `tests` and nothing else of the checkout.

Child interpreters started with `-c` or by Ray need `tests.*` importable; putting the repository root on
their PYTHONPATH would also put its `kernels/`, `recipes/`, ... folders ahead of the installed packages of
those names (Hugging Face's `kernels`, ...). A folder holding only a `tests` link avoids that.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def tests_only_path() -> str:
    folder = Path(tempfile.mkdtemp(prefix="lowmem-tests-path-"))
    (folder / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    atexit.register(shutil.rmtree, folder, True)
    return str(folder)
