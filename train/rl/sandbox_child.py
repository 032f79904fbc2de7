"""The Python sandbox's first code in its child interpreter (`train.rl.sandbox` runs this file's
source with `python -I -S -u -X utf8 -c`): it limits the process, then runs the untrusted
`main.py` of its working directory.

Standard library only. In order:
1. resource limits: CPU seconds, address space, file size, open files, no core files;
2. the modules of `PRELOADED_MODULES` imported, while the interpreter's files are readable;
3. the switch to an unprivileged user (when the parent runs as root);
4. no new processes or threads (RLIMIT_NPROC 0; root would be exempt, hence after step 3);
5. Landlock, when the parent found the kernel offers it: every filesystem right beneath the
   working directory and none elsewhere (nothing to read either: the modules are loaded); with
   ABI >= 4 no TCP bind or connect; with ABI >= 6 no signals to, and no abstract UNIX sockets
   of, processes outside the sandbox. Irreversible for this process;
6. imports closed (an empty `sys.meta_path`): the code has what steps 1-2 loaded, the same set
   on every machine whether or not steps 3 and 5 would let it read the standard library;
7. `main.py` compiled and run as `__main__`; an uncaught exception (a syntax error too) prints
   its traceback without this file's frames and exits 1.

Any failure in steps 1-6 exits with `SETUP_FAILED` and one line on stderr: the code never runs
with less isolation than the parent reported.
"""

import ctypes
import importlib
import json
import os
import resource
import sys
import traceback

SETUP_FAILED = 125
# What the code can import: arithmetic, text, containers and randomness (plus what the
# interpreter and this file loaded: os, sys, json, traceback, ...).
PRELOADED_MODULES = ("math", "cmath", "re", "string", "collections", "itertools", "functools",
                     "operator", "heapq", "bisect", "fractions", "decimal", "random",
                     "statistics", "datetime", "time")

# Landlock (linux/landlock.h); the syscall numbers are the same on every architecture.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _filesystem_rights(abi: int) -> int:
    """Every filesystem right Landlock ABI `abi` knows."""
    rights = (1 << 13) - 1  # ABI 1: execute, write, read, read dir, remove, make ...
    for version, right in ((2, _REFER), (3, _TRUNCATE), (5, _IOCTL_DEV)):
        if abi >= version:
            rights |= right
    return rights


def _check(result: int, what: str) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")
    return result


def restrict_with_landlock(abi: int, directory: str) -> None:
    """Landlock for this process: every filesystem right beneath `directory`, none elsewhere;
    TCP and the scopes as far as `abi` knows them."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    rights = _filesystem_rights(abi)
    attr = _RulesetAttr(rights, _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0,
                        _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the struct's fields this ABI knows
    ruleset = _check(libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                                  ctypes.c_uint32(0)), "landlock_create_ruleset")
    fd = os.open(directory, os.O_PATH | os.O_CLOEXEC)
    beneath = _PathBeneathAttr(rights, fd)
    _check(libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(beneath),
                        ctypes.c_uint32(0)), "landlock_add_rule")
    os.close(fd)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(libc.syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)


def set_up(settings: dict) -> None:
    """Steps 1-6 of the module docstring, from the parent's settings."""
    for name, value in settings["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    cpu = settings["cpu_seconds"]  # SIGXCPU at the soft limit, SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    for module in PRELOADED_MODULES:
        importlib.import_module(module)
    if settings["user"] is not None:
        uid, gid = settings["user"]
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    if settings["landlock_abi"]:
        restrict_with_landlock(settings["landlock_abi"], os.getcwd())
    sys.meta_path.clear()


def main() -> None:
    try:
        with open("main.py", encoding="utf-8") as file:
            source = file.read()
        set_up(json.loads(sys.argv[1]))
    except Exception as error:  # noqa: BLE001 - any setup failure ends the run, reported
        print(f"sandbox setup failed: {type(error).__name__}: {error}", file=sys.stderr)
        sys.exit(SETUP_FAILED)
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - the untrusted code's own failure
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
