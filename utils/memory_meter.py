"""Memory as the kernel charges it (a memory cgroup per side, else RSS plus the offload files' resident pages),
and this process's resident memory; every figure says how it was taken (`method`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import mmap
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

__all__ = ["MMAP_THRESHOLD", "Cgroup", "SideMeter", "cgroup_method", "file_resident_bytes", "files_resident_bytes",
           "fix_malloc", "fixed_mmap_threshold", "hwm_bytes", "kill_group", "malloc_trim", "peak_rss_bytes",
           "reset_peak_rss", "rss_bytes", "run_command", "tree_rss_bytes"]

_counter = itertools.count()
_FALLBACK = "rss+mincore"


# ---- this process's resident memory ---------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """Resident set size of this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    """Peak resident set since start or since the last `reset_peak_rss()` (Linux VmHWM); the unresettable
    `peak_rss_bytes()` where /proc has no VmHWM. A child's own peak: its `ru_maxrss` starts at its parent's."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes()


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


@functools.cache
def _libc():
    """The C library with mmap, munmap and mincore typed; None where it does not load."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def fix_malloc(mmap_threshold: int, trim_threshold: int | None = None) -> None:
    """Fix glibc's mmap threshold (no dynamic growth), so freed large tensors leave the resident set and RSS
    follows live data; optionally its trim threshold. Does nothing without glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD
    if trim_threshold is not None:
        libc.mallopt(-1, trim_threshold)  # M_TRIM_THRESHOLD


def malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc); does nothing elsewhere."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


MMAP_THRESHOLD = 65536
"""glibc's mmap threshold (bytes) in the processes of a memory pass."""


@contextlib.contextmanager
def fixed_mmap_threshold() -> Iterator[None]:
    """Processes started inside this block run with glibc's mmap threshold fixed at `MMAP_THRESHOLD` (through the
    environment, which glibc reads at start): freed large blocks leave the resident set, so its peak follows live
    tensors. This process's allocator is unchanged. Timing passes run outside it (users get the default)."""
    name = "MALLOC_MMAP_THRESHOLD_"
    saved = os.environ.get(name)
    os.environ[name] = str(MMAP_THRESHOLD)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


# ---- cgroups -----------------------------------------------------------------------------------------------


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, filesystem type, super options) of each mount, from /proc/self/mountinfo."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) >= 5 and len(rest) >= 3:
                    out.append((fields[4], rest[0], rest[2]))
    except OSError:
        pass
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: '' for v2, else each v1 controller name."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    paths[c] = path
    except OSError:
        pass
    return paths


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


class Cgroup:
    """A fresh child of this process's memory cgroup: `add` processes, read `peak()`, `remove()` it. `create()`
    is None where the machine allows none (not root, no memory controller, a v2 parent holding processes)."""

    def __init__(self, version: int, path: str, home: str) -> None:
        self.version, self.path, self.home = version, path, home  # home: this process's own group folder
        self.method = "cgroup2:memory.peak" if version == 2 else "cgroup1:memory.max_usage_in_bytes"
        self.procs = os.path.join(path, "cgroup.procs")
        self._peak_fd: int | None = None

    @classmethod
    def create(cls, label: str = "bench") -> Cgroup | None:
        name = f"lowmem-{label}-{os.getpid()}-{next(_counter)}"
        own = _own_paths()
        for point, fstype, options in _mounts():
            if fstype == "cgroup2" and "" in own:
                group = cls._make(2, point, own[""], name)
            elif fstype == "cgroup" and "memory" in options.split(",") and "memory" in own:
                group = cls._make(1, point, own["memory"], name)
            else:
                continue
            if group is not None:
                return group
        return None

    @classmethod
    def _make(cls, version: int, point: str, own: str, name: str) -> Cgroup | None:
        home = os.path.join(point, own.lstrip("/"))
        path = os.path.join(home, name)
        probe = "memory.peak" if version == 2 else "memory.max_usage_in_bytes"
        try:
            if version == 2:
                with open(os.path.join(home, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        return None
                with open(os.path.join(home, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        # fails (EBUSY) in a non-root group that holds processes: then no v2 measurement
                        _write(os.path.join(home, "cgroup.subtree_control"), "+memory")
            os.mkdir(path)
        except OSError:
            return None
        group = cls(version, path, home)
        if not os.path.exists(os.path.join(path, probe)):
            group.remove()
            return None
        return group

    def add(self, pid: int | None = None) -> None:
        """Move `pid` (default: this process) into the group; its new pages are charged here from now on."""
        _write(self.procs, str(pid if pid is not None else os.getpid()))

    def leave(self) -> None:
        """Move this process back to the group it came from."""
        _write(os.path.join(self.home, "cgroup.procs"), str(os.getpid()))

    def peak(self) -> int:
        """Highest charge since the group was made (or since `reset_peak`), bytes."""
        if self._peak_fd is not None:
            return int(os.pread(self._peak_fd, 64, 0).split()[0])
        with open(os.path.join(self.path, "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")) as f:
            return int(f.read().split()[0])

    def set_limit(self, nbytes: int) -> None:
        """Cap the group's charge (page cache included): the kernel reclaims, then kills (`oom_kills`)."""
        _write(os.path.join(self.path, "memory.max" if self.version == 2 else "memory.limit_in_bytes"), str(nbytes))

    def oom_kills(self) -> int | None:
        """Tasks of the group the kernel's OOM killer ended (None where the kernel does not say)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            return None
        return None

    def reset_peak(self) -> bool:
        """Start the peak again from the current charge; False where the kernel cannot."""
        try:
            if self.version == 1:
                _write(os.path.join(self.path, "memory.max_usage_in_bytes"), "0")
                return True
            # v2 (Linux >= 6.12): a write resets the peak seen through that same open file
            fd = os.open(os.path.join(self.path, "memory.peak"), os.O_RDWR)
            os.write(fd, b"reset\n")
        except OSError:
            return False
        if self._peak_fd is not None:
            os.close(self._peak_fd)
        self._peak_fd = fd
        return True

    def remove(self) -> None:
        """Delete the group once its processes are gone (its page cache moves to the parent)."""
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)  # exiting tasks leave the group a moment after wait() returns


@functools.cache
def cgroup_method() -> str:
    """How this machine's figures are taken: the cgroup method when a child group can be made, else rss+mincore."""
    group = Cgroup.create("probe")
    if group is None:
        return _FALLBACK
    group.remove()
    return group.method


# ---- page cache of files (mincore) -------------------------------------------------------------------------

_PAGE = os.sysconf("SC_PAGE_SIZE")
_WINDOW = 1 << 30  # map at most 1 GiB at a time: the vector of one byte per page stays small


def file_resident_bytes(path: str) -> int:
    """Bytes of `path` now in the page cache (mincore(2) on a read-only shared mapping; maps nothing in)."""
    libc = _libc()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        total = 0
        for offset in range(0, size, _WINDOW):
            length = min(_WINDOW, size - offset)
            addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                pages = (length + _PAGE - 1) // _PAGE
                vec = ctypes.create_string_buffer(pages)
                if libc.mincore(addr, length, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += sum(b & 1 for b in vec.raw[:pages]) * _PAGE
            finally:
                libc.munmap(addr, length)
        return min(total, size + _PAGE - 1)
    finally:
        os.close(fd)


def files_resident_bytes(paths: Iterable[str]) -> int:
    """Page-cache bytes of every regular file under `paths` (files or folders); files that vanish count 0."""
    total = 0
    for top in paths:
        walk = [("", [], [top])] if os.path.isfile(top) else os.walk(top)
        for folder, _, names in walk:
            for name in names:
                try:
                    total += file_resident_bytes(os.path.join(folder, name))
                except (OSError, ValueError):
                    pass  # removed while we looked, or not mappable (a socket, a pipe)
    return total


# ---- a side measured inside its own processes -------------------------------------------------------------


class SideMeter:
    """Memory of one side measured from inside its process: `start()` moves it into a fresh cgroup (what it
    allocates from then on is charged there, page cache included); without one, peak RSS (VmHWM) over the base
    plus the most the offload files held in the page cache, sampled by a thread."""

    def __init__(self, offload_paths: Sequence[str] = (), interval: float = 0.05, use_cgroup: bool = True) -> None:
        self.offload_paths = list(offload_paths)
        self.interval = interval
        self.group = Cgroup.create("side") if use_cgroup else None
        self.method = self.group.method if self.group else _FALLBACK
        self._base = 0
        self._files_max = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SideMeter:
        """Count from now: join the group, or take the resident set now as the base and start sampling files."""
        if self.group:
            self.group.add()
            self.group.reset_peak()
            return self
        self.reset()
        self._base = rss_bytes()
        if self.offload_paths and self._thread is None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._files_max = max(self._files_max, files_resident_bytes(self.offload_paths))

    def reset(self) -> None:
        """Peak from the current usage on (after setup, say)."""
        if self.group:
            self.group.reset_peak()
            return
        reset_peak_rss()
        self._files_max = files_resident_bytes(self.offload_paths) if self.offload_paths else 0

    def peak(self) -> int:
        """Highest charge since `start`/`reset`, bytes (the cgroup's; else VmHWM - base + file pages)."""
        if self.group:
            return self.group.peak()
        if self.offload_paths:
            self._files_max = max(self._files_max, files_resident_bytes(self.offload_paths))
        return max(0, hwm_bytes() - self._base) + self._files_max

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.group:
            try:
                self.group.leave()
            except OSError:
                pass
            self.group.remove()
            self.group = None


# ---- whole commands ----------------------------------------------------------------------------------------


def tree_rss_bytes(pid: int) -> int:
    """Summed RSS of `pid` and all its descendants now (0 for processes gone meanwhile)."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


_INHERIT_MARGIN = 32 * 2**20


def _inherited_peak_bytes() -> int:
    """A bound on the ru_maxrss a child starts with: Linux carries it across fork and exec from this process."""
    return max(peak_rss_bytes(), hwm_bytes())


def kill_group(proc: subprocess.Popen) -> None:
    """End a child started in its own session and everything it started (ranks, per-case processes)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(argv: Sequence[str], offload_paths: Sequence[str] = (), interval: float = 0.02,
                env: dict[str, str] | None = None, timeout: float | None = None, use_cgroup: bool = True,
                cap_bytes: int | None = None, measure: bool = True, **popen: Any) -> dict[str, Any]:
    """Run `argv` to its exit: {"returncode", "peak_bytes", "method", "wall_s", ...}, the whole process tree's
    memory from its first instruction (a cgroup; else sampled tree RSS, the child's ru_maxrss where above what it
    inherits, plus `offload_paths`' resident pages; `measure` False: no memory figure). `cap_bytes`: the cgroup's
    limit (page cache included), with `cap_enforced` and `oom_kills`. Past `timeout` the command (and its process
    group with `start_new_session`) is killed and `subprocess.TimeoutExpired` raised."""
    group = Cgroup.create("cmd") if measure and (use_cgroup or cap_bytes) else None
    capped: dict[str, Any] = {}
    if cap_bytes:
        capped = {"cap_bytes": cap_bytes, "cap_enforced": group is not None}
        if group is not None:
            group.set_limit(cap_bytes)
    t0 = time.perf_counter()
    if group:  # the shell joins the group, then execs the command: every page of it is charged there
        argv = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', group.procs, *argv]
    inherited = _inherited_peak_bytes()
    proc = subprocess.Popen(list(argv), env=env, **popen)
    sampled, files_max, maxrss = 0, 0, 0
    try:
        if group or not measure:
            proc.wait(timeout=timeout)
        else:
            deadline = None if timeout is None else t0 + timeout
            while True:
                sampled = max(sampled, tree_rss_bytes(proc.pid))
                if offload_paths:
                    files_max = max(files_max, files_resident_bytes(offload_paths))
                # wait4 on this child alone: its ru_maxrss, not that of every child this process ever had
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    maxrss = usage.ru_maxrss * 1024
                    break
                if deadline is not None and time.perf_counter() > deadline:
                    raise subprocess.TimeoutExpired(list(argv), timeout)
                time.sleep(interval)
        wall = time.perf_counter() - t0
        if not measure:
            return {"returncode": proc.returncode, "peak_bytes": None, "method": None, "wall_s": wall}
        if group:
            return {"returncode": proc.returncode, "peak_bytes": group.peak(), "method": group.method,
                    "wall_s": wall, **capped, **({"oom_kills": group.oom_kills()} if cap_bytes else {})}
        if offload_paths:
            files_max = max(files_max, files_resident_bytes(offload_paths))
        # read again now: the parent may have grown between the first reading and the fork; the kernel's RSS
        # counters are per-CPU approximations, hence a margin (the sampled tree RSS still sees a real peak)
        inherited = max(inherited, _inherited_peak_bytes())
        counted = maxrss if maxrss > inherited + _INHERIT_MARGIN else 0
        return {"returncode": proc.returncode, "peak_bytes": max(sampled, counted) + files_max,
                "method": f"{_FALLBACK} (tree RSS sampled every {interval * 1e3:.0f} ms, children's ru_maxrss "
                          f"{'counted' if counted else 'not above the parent peak it inherits: not counted'})",
                "wall_s": wall, "tree_rss_bytes": sampled, "children_maxrss_bytes": maxrss,
                "inherited_peak_bytes": inherited, "files_resident_bytes": files_max, **capped}
    finally:
        if proc.poll() is None:
            if popen.get("start_new_session"):  # what the command started goes too (ranks, per-case processes)
                kill_group(proc)
            proc.kill()
            proc.wait()
        if group:
            group.remove()
