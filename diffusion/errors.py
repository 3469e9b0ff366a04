"""The error `diffusion` raises for bad user input.

`diffusion` sits below `suite`, so it does not import the CLI's `UsageError`; `InputError` subclasses it
when `suite` is importable (it always is in this repository), so the CLI prints one line and exits 2.
"""

from __future__ import annotations

try:
    from ..suite.errors import UsageError as _Base
except ImportError:  # pragma: no cover - diffusion used without the suite package
    _Base = ValueError

__all__ = ["InputError"]


class InputError(_Base):  # type: ignore[misc, valid-type]
    """Bad user input: one line naming the file (and line) and what is wrong."""
