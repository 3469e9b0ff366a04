"""The one error type for bad user input, at the bottom of the project so every layer can raise it.

`InputError` is what a user can fix: a flag, a file, a line in a file, a missing optional package. The `suite`
command line prints it as one line and exits with code 2 (a traceback only with `--debug`); library users catch
it as the `ValueError` it is. Layer-specific errors (a damaged checkpoint, a params file of another preset) are
subclasses, so they reach the user the same way.
"""

from __future__ import annotations

__all__ = ["EXIT_USAGE", "EXTRAS", "InputError", "MissingExtraError", "missing_extra"]

EXIT_USAGE = 2
"""Exit code of a command given bad input (as argparse uses for a bad flag)."""


class InputError(ValueError):
    """Bad user input: one line naming the input (file and line, record, field or flag) and what is wrong."""


class MissingExtraError(InputError, ModuleNotFoundError):
    """An optional package a feature needs is not installed; the message names the extra that brings it."""


# Top-level import name of each optional package -> the extra of `lowmem-suite` that installs it.
EXTRAS: dict[str, str] = {
    "openmm": "fold",
    "pdbfixer": "fold",
    "matplotlib": "fold",
    "gemmi": "fold",
    "Bio": "fold",
    "ray": "ray",
}


def missing_extra(exc: BaseException) -> MissingExtraError | None:
    """The one-line error for an `ImportError` of an optional package (None for anything else)."""
    name = getattr(exc, "name", None) or ""
    top = name.partition(".")[0]
    if not isinstance(exc, ImportError) or top not in EXTRAS:
        return None
    extra = EXTRAS[top]
    err = MissingExtraError(f"this needs the optional package '{top}', which is not installed: "
                            f"pip install 'lowmem-suite[{extra}]'")
    err.name = name
    return err
