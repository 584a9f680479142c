"""Runs untrusted Python (model-written HumanEval code) in a child process with time, memory and output limits.

What contains the code:
- a separate interpreter (`sys.executable -I -S -B`: isolated mode, no site-packages, no .pyc writes) in a fresh
  temporary directory (its working directory and $HOME, deleted afterwards), with a minimal environment and stdin
  closed;
- its own session and process group, killed as a whole (os.killpg) on timeout and after every run, so children the
  code left behind die with it;
- resource limits set in the child before exec (preexec_fn): address space (memory), CPU seconds, open files,
  file size, no core dumps, and the process count for non-root users (Linux does not enforce RLIMIT_NPROC for
  root);
- an audit hook installed by a short prelude before the user code runs (sys.addaudithook, PEP 578). It refuses
  socket creation and DNS look-ups (no network), process creation (fork, exec, spawn, os.system, subprocess),
  signals to other processes, loading native code through ctypes, changing resource limits, and writes, deletes
  and renames outside the working directory; the refused operation raises PermissionError in the user code. Audit
  hooks cannot be removed and also cover the private `_socket` module, which monkeypatching `socket.socket` would
  not.
- bounded output: stdout and stderr are read as they come, the first `max_output_bytes` of each are kept and the
  rest is drained and counted, so a flood neither blocks the child nor grows the caller's memory.

This is defence in depth, not a jail: code running as the same user can still read files, and a determined program
(introspection of the hook, native extensions already loaded) may get around the Python-level hook. The kernel
limits (rlimits, the process group kill, the timeout) hold regardless. Run the harness as an unprivileged user or
in a container when the code comes from an untrusted model.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

# Executed by `python -c` in the child; the user code is in solution.py in the working directory. Only stdlib
# modules the interpreter has already imported at startup are used before the hook is in place.
_PRELUDE = r"""
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_DENY = frozenset((
    "socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.gethostbyaddr", "socket.getnameinfo", "socket.sendto", "socket.sendmsg",
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
    "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "signal.pthread_kill",
    "resource.setrlimit", "resource.prlimit",
))
_PATH_EVENTS = frozenset((
    "os.remove", "os.rmdir", "os.rename", "os.link", "os.symlink", "os.mkdir", "os.chmod", "os.chown",
    "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile",
))
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

def _inside(path):
    if isinstance(path, int):
        return True  # an already open descriptor
    try:
        p = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return p == _ROOT or p.startswith(_ROOT + os.sep)

def _kvcmas_sandbox_hook(event, args):
    if event in _DENY:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event in ("os.kill", "os.killpg") and args and args[0] not in (0, os.getpid(), os.getpgrp()):
        raise PermissionError(f"sandbox: {event} of another process is not allowed")
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2]
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
        if writes and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
    elif event in _PATH_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} on {a!r} outside the working directory is not allowed")

sys.addaudithook(_kvcmas_sandbox_hook)
del _kvcmas_sandbox_hook
sys.argv = ["solution.py"]
with open("solution.py", "rb") as _f:
    _source = _f.read()
_code = compile(_source, "solution.py", "exec")
del _f, _source
exec(_code, {"__name__": "__main__", "__file__": "solution.py", "__builtins__": __builtins__})
"""

_MIB = 1 << 20
_DRAIN_AFTER_EXIT_S = 1.0  # how long to keep reading pipes held open by escaped grandchildren once the child exited


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run. passed: exit status 0 within the time limit. returncode: the exit status, negative for a
    signal (as subprocess reports it), None when the process could not be started. stdout/stderr: decoded (UTF-8,
    invalid bytes replaced), each at most max_output_bytes plus a truncation note."""

    passed: bool
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    output_truncated: bool = False
    wall_s: float = 0.0


def _user_process_count(uid: int) -> int:
    """Processes owned by `uid` now (Linux /proc; 0 when it cannot be read)."""
    count = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == uid:
                        count += 1
    return count


def _limits(timeout_s: float, memory_mb: int, file_size_mb: int, max_open_files: int) -> list[tuple[int, int]]:
    """(resource, limit) pairs for the child; soft = hard so the code cannot raise them (unless it runs as root)."""
    cpu_s = math.ceil(timeout_s) + 1
    limits = [
        (resource.RLIMIT_AS, memory_mb * _MIB),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_NOFILE, max_open_files),
        (resource.RLIMIT_FSIZE, file_size_mb * _MIB),
        (resource.RLIMIT_CORE, 0),
    ]
    uid = os.getuid()
    if uid != 0 and hasattr(resource, "RLIMIT_NPROC"):
        # RLIMIT_NPROC counts every process of the user, so the limit leaves room for the ones already running.
        limits.append((resource.RLIMIT_NPROC, _user_process_count(uid) + 32))
    return limits


def _make_preexec(limits: list[tuple[int, int]]) -> Callable[[], None]:
    """The child-side hook: only setrlimit calls on values computed in the parent (runs between fork and exec)."""

    def preexec() -> None:
        for res, value in limits:
            _, hard = resource.getrlimit(res)
            if hard != resource.RLIM_INFINITY and value > hard:
                value = hard
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(res, (value, value))

    return preexec


def _exited(pid: int) -> bool:
    """True once the child has ended; it is left a zombie (WNOWAIT), so its pid, which is also its process group
    id, cannot be reused before `proc.wait()` reaps it and killpg never reaches an unrelated group."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class _BoundedBuffer:
    """Keeps the first `cap` bytes written to it and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            out += f"\n[... {self.dropped} more bytes truncated]"
        return out


def run_python(
    code: str,
    timeout_s: float = 10,
    memory_mb: int = 512,
    *,
    file_size_mb: int = 16,
    max_open_files: int = 64,
    max_output_bytes: int = 64 * 1024,
) -> SandboxResult:
    """Runs `code` as a Python program in a sandboxed child (see the module docstring) and reports how it ended.

    timeout_s: wall-clock limit (the CPU limit is ceil(timeout_s) + 1 s); memory_mb: address-space limit;
    file_size_mb: largest file the code may write; max_open_files: descriptor limit; max_output_bytes: how much of
    stdout and of stderr is kept. Never raises because of the code itself (syntax errors, crashes, hangs, floods all
    come back as a failed result); raises ValueError for non-positive limits.
    """
    if not timeout_s > 0 or memory_mb <= 0 or file_size_mb <= 0 or max_open_files <= 0 or max_output_bytes <= 0:
        raise ValueError(
            f"run_python: limits must be positive (timeout_s={timeout_s}, memory_mb={memory_mb}, "
            f"file_size_mb={file_size_mb}, max_open_files={max_open_files}, max_output_bytes={max_output_bytes})"
        )
    workdir = tempfile.mkdtemp(prefix="kvcmas-sandbox-")
    start = time.monotonic()
    try:
        with open(os.path.join(workdir, "solution.py"), "wb") as f:
            f.write(code.encode("utf-8", errors="replace"))  # lone surrogates become "?"
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", "-c", _PRELUDE],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own session and process group: killpg reaches everything it spawns
                preexec_fn=_make_preexec(_limits(timeout_s, memory_mb, file_size_mb, max_open_files)),
                close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return SandboxResult(False, None, False, "", f"sandbox: could not start the interpreter: {exc}")
        return _supervise(proc, start, timeout_s, max_output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(proc: subprocess.Popen[bytes], start: float, timeout_s: float, cap: int) -> SandboxResult:
    """Reads both pipes until EOF, the deadline, or a short drain after the child's exit; then kills its group."""
    assert proc.stdout is not None and proc.stderr is not None
    out_buf, err_buf = _BoundedBuffer(cap), _BoundedBuffer(cap)
    buffers = {proc.stdout.fileno(): out_buf, proc.stderr.fileno(): err_buf}
    deadline = start + timeout_s
    exited_at: float | None = None
    with selectors.DefaultSelector() as sel:
        for pipe in (proc.stdout, proc.stderr):
            sel.register(pipe, selectors.EVENT_READ)
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and _exited(proc.pid):
                exited_at = now
                _kill_group(proc.pid)  # leftovers in its group; they may hold the pipes open
            end = deadline if exited_at is None else exited_at + _DRAIN_AFTER_EXIT_S
            if now >= end:
                break
            for key, _ in sel.select(timeout=min(end - now, 0.05)):
                try:
                    chunk = os.read(key.fd, 65536)
                except OSError:
                    chunk = b""
                if chunk:
                    buffers[key.fd].add(chunk)
                else:
                    sel.unregister(key.fileobj)
    # Still running when its pipes closed early: wait (without reaping) for it to end or for the deadline.
    while not _exited(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    timed_out = not _exited(proc.pid)
    _kill_group(proc.pid)
    returncode = proc.wait()  # reaps the child only now
    proc.stdout.close()
    proc.stderr.close()
    return SandboxResult(
        passed=returncode == 0 and not timed_out,
        returncode=returncode,
        timed_out=timed_out,
        stdout=out_buf.text(),
        stderr=err_buf.text(),
        output_truncated=bool(out_buf.dropped or err_buf.dropped),
        wall_s=time.monotonic() - start,
    )
