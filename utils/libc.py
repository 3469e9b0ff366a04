"""Functions of the C library looked up by name through ctypes, for system calls Python's `os` lacks
(`renameat2`, `sync_file_range`, `mremap`, `malloc_trim`)."""

from __future__ import annotations

import ctypes

__all__ = ["libc_function"]


def libc_function(name: str, argtypes: list, restype, *, library: str | None = None):
    """The C function `name` with its signature set (`errno` readable with `ctypes.get_errno()`), or None where
    the C library has none (musl, macOS, an older glibc). `library=None` looks among the symbols the process has
    loaded already, the C library's among them."""
    try:
        fn = getattr(ctypes.CDLL(library, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn
