"""utils: the plumbing every layer shares, below `kernels` and the parallel core.

- `settings`: typed settings classes as command-line flags and YAML files (one merge rule: flag > file > default).
- `errors`: the project's one `InputError` (bad input: one line, exit code 2 at the command line).
- `fileio`: atomic writes and folder swaps, fsync, page-cache control.
- `libc`: C library functions Python's `os` lacks, looked up through ctypes.
- `lazy`: lazy attribute tables for package `__init__` modules.
- `memory_meter`: peak and current memory of processes, sides and whole commands (memory cgroups, else RSS
  plus the resident page-cache pages of files), each figure with the method that took it.

Nothing here imports torch or any other part of the project.
"""
