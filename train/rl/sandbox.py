"""The Python tool: untrusted code in a limited child interpreter that cannot hang the run.

    sandbox = PythonSandbox(SandboxConfig(timeout_seconds=2.0))
    result = sandbox("print(37 * 12)")       # ToolResult(text="444\\n", error=None, metadata=...)

Each call writes the code to `main.py` in a fresh temporary directory and runs
`python -I -S -u -X utf8` there (isolated mode: no site-packages, no PYTHON* variables, no
script directory on sys.path) with an environment of PATH, LANG, and HOME and TMPDIR pointing at
that directory, stdin from /dev/null, and stdout and stderr into unnamed temporary files. The
child limits itself before the code runs (`train.rl.sandbox_child`; in the child rather than in
a `preexec_fn`, which is unsafe in a parent with threads, as JAX's): CPU seconds, address space,
file size, open files, no new processes or threads, and imports closed after loading
`sandbox_child.PRELOADED_MODULES` (math, re, collections, fractions, random, ...: the same
modules on every machine). The parent kills the process group at the wall-clock timeout and
deletes the directory afterwards.

What is isolated, and by what (`isolation()`, found once per process, and each result's
metadata):
- filesystem: with Landlock (Linux >= 5.13, where enabled) the code can read and write only
  beneath its directory: not the repository, not a home directory, no other host file, whatever
  the user. Without Landlock, a parent running as root runs the code as `nobody`: it can still
  read world-readable files and create files in world-writable directories (/tmp, /dev/shm),
  but not read or change files of root or of any user. Without Landlock and not as root,
  nothing but convention (the working directory, HOME, TMPDIR) keeps the code from the files of
  the parent's user: `isolation()["filesystem"]` is then "none".
- network: a fresh network namespace (`unshare --net`, inside a user namespace when not root)
  has no interface but a loopback that is down, so no connection anywhere, the host's loopback
  included; Landlock ABI >= 4 denies TCP connect and bind besides (alone it leaves UDP open).
- processes: RLIMIT_NPROC 0 under a user other than root: no fork, no thread; under Landlock
  ABI >= 6 no signal to a process outside the sandbox, and as `nobody` none to other users'.
Not isolated in any case: CPU contention, the page cache, the clock, kernel bugs. This guards
against a model's mistakes and casual misuse; it is not a security boundary against a
determined attacker (run those in a VM).
"""

import ctypes
import dataclasses
import functools
import json
import math
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from train.rl import sandbox_child
from train.rl.tools import ToolResult

_CHILD_SOURCE = pathlib.Path(sandbox_child.__file__).read_text(encoding="utf-8")
_UNPRIVILEGED_USER = "nobody"
_STDERR_TAIL_BYTES = 2048  # the end of stderr kept: its last line is the failure's reason


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one run of the Python tool.

    timeout_seconds: wall-clock limit; the process group is killed at it.
    cpu_seconds: CPU-time limit (RLIMIT_CPU), a positive int.
    memory_bytes: address-space limit (RLIMIT_AS): allocations past it raise MemoryError.
    file_bytes: the largest file the code may write (RLIMIT_FSIZE), stdout and stderr included.
    output_bytes: stdout kept in the result (and stderr in its metadata), at most file_bytes.
    max_code_bytes: longer code is refused without running.
    """

    timeout_seconds: float = 5.0
    cpu_seconds: int = 2
    memory_bytes: int = 512 << 20
    file_bytes: int = 1 << 20
    output_bytes: int = 4096
    max_code_bytes: int = 16384

    def __post_init__(self):
        def require(condition, name, requirement):
            if not condition:
                raise ValueError(f"SandboxConfig.{name} must be {requirement}, got "
                                 f"{getattr(self, name)!r}")

        require(isinstance(self.timeout_seconds, (int, float)) and 0 < self.timeout_seconds
                < math.inf, "timeout_seconds", "a finite number of seconds > 0")
        for name in ("cpu_seconds", "memory_bytes", "file_bytes", "output_bytes",
                     "max_code_bytes"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                    "a positive int")
        require(self.output_bytes <= self.file_bytes, "output_bytes",
                f"at most file_bytes={self.file_bytes}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where it has none (or it is disabled)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # VERSION flag
    return max(int(version), 0)


def _runs(command: list[str]) -> bool:
    """Whether `command` exits 0 within 10 s."""
    try:
        return subprocess.run(command, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def isolation() -> dict:
    """How this machine isolates the sandbox, found once per process (module docstring):
    filesystem: "landlock", "unprivileged-user" or "none"; network: "namespace+landlock-tcp",
    "namespace", "landlock-tcp" or "none"; user: the name the code runs as, with its uid and gid
    (None: the parent's own); landlock_abi: 0 without Landlock; unshare: the command prefix that
    gives the network namespace, or ()."""
    abi = landlock_abi()
    as_root = os.geteuid() == 0
    prefix = ("unshare", "--net") if as_root else ("unshare", "--user", "--map-current-user",
                                                   "--net")
    if shutil.which("unshare") is None or not _runs([*prefix, "true"]):
        prefix = ()
    network = [name for name, present in (("namespace", prefix), ("landlock-tcp", abi >= 4))
               if present]
    user, uid, gid = pwd.getpwuid(os.geteuid()).pw_name, None, None
    if as_root:
        try:
            account = pwd.getpwnam(_UNPRIVILEGED_USER)
        except KeyError:
            raise RuntimeError(f"the Python sandbox runs code as {_UNPRIVILEGED_USER!r} when the "
                               f"trainer runs as root, and this system has no such user: add it "
                               f"(useradd) or run as another user") from None
        user, uid, gid = account.pw_name, account.pw_uid, account.pw_gid
    return dict(
        filesystem="landlock" if abi else "unprivileged-user" if as_root else "none",
        network="+".join(network) or "none",
        user=user,
        uid=uid,
        gid=gid,
        landlock_abi=abi,
        unshare=prefix,
    )


def _read_capped(file, limit: int, tail: bool = False) -> tuple[str, bool]:
    """The first (or with `tail` the last) `limit` bytes of an open file as text, a cut
    character dropped, and whether there was more."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(size - limit, 0) if tail else 0)
    return file.read(limit).decode("utf-8", errors="ignore"), size > limit


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


class PythonSandbox:
    """The Python tool: `sandbox(code) -> ToolResult`, never raising for the code's sake.

    A result's text is the code's stdout (cut at output_bytes) when it exits 0; otherwise "ERR "
    and the reason: the last line of its traceback ("ERR ZeroDivisionError: division by zero"),
    "ERR timeout after 2 s", "ERR CPU time limit of 2 s", "ERR killed by SIGSEGV" (SIGKILL: the
    hard CPU limit a second after an ignored SIGXCPU, or the kernel out of memory). Its error is
    None, "exception", "timeout", "cpu", "signal", "refused" or "setup"; its metadata holds the
    exit code, the wall seconds, stdout (its first output_bytes) and stderr (its last 2 KB),
    whether stdout was cut, and `isolation()`'s filesystem, network and user.
    """

    def __init__(self, config: SandboxConfig = SandboxConfig()):
        self.config = config
        self.isolation = isolation()

    def __call__(self, code: str) -> ToolResult:
        config, found = self.config, self.isolation
        metadata = {key: found[key] for key in ("filesystem", "network", "user")}
        if len(code.encode("utf-8", errors="replace")) > config.max_code_bytes:
            return ToolResult.failure("refused", f"code longer than {config.max_code_bytes} "
                                      "bytes", **metadata)
        settings = dict(
            limits=dict(RLIMIT_AS=config.memory_bytes, RLIMIT_FSIZE=config.file_bytes,
                        RLIMIT_NOFILE=64, RLIMIT_CORE=0),
            cpu_seconds=config.cpu_seconds,
            user=None if found["uid"] is None else (found["uid"], found["gid"]),
            landlock_abi=found["landlock_abi"],
        )
        work = tempfile.mkdtemp(prefix="sandbox-")
        try:
            (pathlib.Path(work) / "main.py").write_text(code, encoding="utf-8")
            if found["uid"] is not None:
                os.chown(work, found["uid"], found["gid"])
            return self._run(work, settings, metadata)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _run(self, work: str, settings: dict, metadata: dict) -> ToolResult:
        config = self.config
        command = [*self.isolation["unshare"], sys.executable, "-I", "-S", "-u", "-X", "utf8",
                   "-c", _CHILD_SOURCE, json.dumps(settings)]
        environment = dict(PATH="/usr/bin:/bin", LANG="C.UTF-8", HOME=work, TMPDIR=work)
        start = time.monotonic()
        with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
            process = subprocess.Popen(command, cwd=work, env=environment,
                                       stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                       start_new_session=True)
            try:
                returncode, timed_out = process.wait(timeout=config.timeout_seconds), False
            except BaseException as error:  # the timeout, or the trainer interrupted
                _kill_group(process)  # before reaping it, so its pid is not anyone else's yet
                returncode, timed_out = process.wait(), True
                if not isinstance(error, subprocess.TimeoutExpired):
                    raise
            output, cut = _read_capped(stdout, config.output_bytes)
            errors, _ = _read_capped(stderr, _STDERR_TAIL_BYTES, tail=True)
        metadata.update(returncode=returncode, seconds=time.monotonic() - start, stdout=output,
                        stderr=errors, output_cut=cut)
        if timed_out:
            return ToolResult.failure("timeout", f"timeout after {config.timeout_seconds:g} s",
                                      **metadata)
        if returncode == 0:
            return ToolResult(output, None, metadata)
        if returncode == sandbox_child.SETUP_FAILED:
            return ToolResult.failure("setup", _last_line(errors), **metadata)
        if returncode == -signal.SIGXCPU:
            return ToolResult.failure("cpu", f"CPU time limit of {config.cpu_seconds} s",
                                      **metadata)
        if returncode < 0:
            return ToolResult.failure("signal", f"killed by {signal.Signals(-returncode).name}",
                                      **metadata)
        return ToolResult.failure("exception", _last_line(errors) or f"exit code {returncode}",
                                  **metadata)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the process's group (the child leads its own session). After a normal exit
    there is none: the child cannot start processes (RLIMIT_NPROC 0)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
