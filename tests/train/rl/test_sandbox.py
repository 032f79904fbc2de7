"""train.rl.sandbox: the Python tool answers with stdout or an "ERR" reason, never hangs (CPU
limit, wall timeout), caps its output and files, strips the environment, and keeps the code from
the host's files, network and processes as far as `isolation()` says this machine allows (the
checks of a layer the machine lacks are skipped, saying so)."""

import errno
import os
import pathlib
import pwd
import socket
import tempfile

import pytest

from train.rl.sandbox import PythonSandbox, SandboxConfig, isolation

LIMITS = dict(cpu_seconds=1, memory_bytes=256 << 20, file_bytes=4096, output_bytes=64,
              max_code_bytes=1000)


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(SandboxConfig(timeout_seconds=2.0, **LIMITS))


def test_stdout_is_the_result_and_the_preloaded_modules_import(sandbox):
    result = sandbox("import fractions, statistics\n"
                     "print(37 * 12, fractions.Fraction(1, 3) * 3, statistics.mean([1, 2]))")
    assert (result.text, result.error) == ("444 1 1.5\n", None)
    assert {key: result.metadata[key] for key in ("filesystem", "network", "user")} == {
        key: isolation()[key] for key in ("filesystem", "network", "user")}


@pytest.mark.parametrize("code, error, text", [
    ("1 // 0", "exception", "ERR ZeroDivisionError: integer division or modulo by zero"),
    ("def f(:", "exception", "ERR SyntaxError: invalid syntax"),
    ("import sys; sys.exit(3)", "exception", "ERR exit code 3"),
    ("import os; os.abort()", "signal", "ERR killed by SIGABRT"),
    ("x = bytearray(1 << 30)", "exception", "ERR MemoryError"),
    ("import os; os.fork()", "exception",
     "ERR BlockingIOError: [Errno 11] Resource temporarily unavailable"),
    ("import threading", "exception", "ERR ModuleNotFoundError: No module named 'threading'"),
    ("with open('big', 'w') as f:\n    f.write('x' * 5000)", "exception",
     "ERR OSError: [Errno 27] File too large"),
    ("x = 1\n" * 200, "refused", "ERR code longer than 1000 bytes"),
])
def test_failures_are_results_with_a_reason(sandbox, code, error, text):
    result = sandbox(code)
    assert (result.error, result.text) == (error, text)


def test_imports_are_closed(sandbox):
    """A built-in module not loaded yet needs no file, so only the closed import system keeps
    it out: the code gets the same modules on every machine."""
    result = sandbox("import sys\n"
                     "name = sorted(set(sys.builtin_module_names) - set(sys.modules))[0]\n"
                     "try:\n"
                     "    __import__(name)\n"
                     "except ModuleNotFoundError:\n"
                     "    print('closed')")
    assert result.text == "closed\n", result


def test_output_is_cut(sandbox):
    result = sandbox("print('x' * 1000)")
    assert (result.text, result.error, result.metadata["output_cut"]) == ("x" * 64, None, True)


def test_an_infinite_loop_ends_at_the_cpu_limit():
    """One CPU second, long before the wall timeout (generous: a loaded machine gives the loop a
    fraction of a core)."""
    result = PythonSandbox(SandboxConfig(timeout_seconds=20.0, **LIMITS))("while True:\n    pass")
    assert (result.error, result.text) == ("cpu", "ERR CPU time limit of 1 s")
    assert result.metadata["seconds"] < 20.0


def test_a_sleeping_program_is_killed_at_the_wall_timeout():
    """Killed at 1.5 s (not 30), its output so far kept."""
    result = PythonSandbox(SandboxConfig(timeout_seconds=1.5, **LIMITS))(
        "import time\nprint('started')\ntime.sleep(30)")
    assert (result.error, result.text) == ("timeout", "ERR timeout after 1.5 s")
    assert result.metadata["stdout"] == "started\n"
    assert 1.5 <= result.metadata["seconds"] < 3.0


def test_the_environment_is_stripped_and_home_and_tmpdir_are_the_working_directory(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "do not leak")
    result = PythonSandbox(SandboxConfig(timeout_seconds=2.0, **dict(LIMITS, output_bytes=1024)))(
        "import os\n"
        "print(sorted(os.environ))\n"
        "here = os.getcwd()\n"
        "for path in (os.path.join(os.environ['HOME'], 'h'), os.path.join(os.environ['TMPDIR'],"
        " 't'), 'r'):\n"
        "    open(path, 'w').write('x')\n"
        "    print(os.path.dirname(os.path.realpath(path)) == here)\n"
        "print(os.getuid())\n"
        "print(here)")
    lines = result.text.splitlines()
    assert lines[:4] == ["['HOME', 'LANG', 'PATH', 'TMPDIR']", "True", "True", "True"]
    assert int(lines[4]) == pwd.getpwnam(isolation()["user"]).pw_uid
    here = pathlib.Path(lines[5])
    assert here.parent == pathlib.Path(tempfile.gettempdir()) and here.name.startswith("sandbox-")
    assert not here.exists()  # removed after the run


def test_the_code_cannot_touch_files_outside_its_directory(sandbox, tmp_path):
    """A file of the test's own (tmp_path, readable only by this user) can be neither read,
    changed, removed nor joined by a new one; under Landlock not even the root directory can be
    listed."""
    if isolation()["filesystem"] == "none":
        pytest.skip("no filesystem isolation here: no Landlock and not root (isolation())")
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    attempts = {
        "read": f"open({str(secret)!r}).read()",
        "append": f"open({str(secret)!r}, 'a').write('x')",
        "remove": f"import os; os.remove({str(secret)!r})",
        "create": f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')",
        "list root": "import os; os.listdir('/')",
    }
    for name, code in attempts.items():
        result = sandbox(code)
        if name == "list root" and isolation()["filesystem"] != "landlock":
            continue
        assert result.error == "exception" and "PermissionError" in result.text, (name, result)
    assert secret.read_text() == "secret" and sorted(os.listdir(tmp_path)) == ["secret.txt"]


def test_the_code_cannot_reach_the_network(sandbox):
    """The code sees only a loopback interface in its namespace, and a TCP connection to a
    server of the test's on the host's loopback fails (raw syscalls through ctypes, past Python):
    EACCES from Landlock, which checks first, or the namespace's ENETUNREACH."""
    layers = isolation()["network"].split("+")
    if layers == ["none"]:
        pytest.skip("no network isolation here: unshare --net fails and no Landlock ABI >= 4")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result = sandbox(
            "import ctypes, sys\n"
            "class Interface(ctypes.Structure):\n"
            "    _fields_ = [('index', ctypes.c_uint), ('name', ctypes.c_char_p)]\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.if_nameindex.restype = ctypes.POINTER(Interface)\n"
            "names, interfaces = [], libc.if_nameindex()\n"
            "while interfaces[len(names)].index:\n"
            "    names.append(interfaces[len(names)].name.decode())\n"
            "fd = libc.socket(2, 1, 0)\n"
            "address = (2).to_bytes(2, sys.byteorder) + "
            f"({port}).to_bytes(2, 'big') + bytes([127, 0, 0, 1]) + bytes(8)\n"
            "print(libc.connect(fd, address, 16), ctypes.get_errno(), names)")
        server.settimeout(0.0)
        with pytest.raises(BlockingIOError):
            server.accept()
    code, error, names = result.text.split(" ", 2)
    assert (code, int(error)) == ("-1", errno.EACCES if "landlock-tcp" in layers
                                  else errno.ENETUNREACH), result
    host = [name for _, name in socket.if_nameindex()]
    assert names.strip() == str(["lo"] if "namespace" in layers else host)


def test_the_code_cannot_signal_the_trainer(sandbox):
    """Signal 0 (a permission check) to this test's process: refused to another user, and under
    Landlock ABI >= 6 to any process outside the sandbox."""
    if isolation()["user"] != "nobody" and isolation()["landlock_abi"] < 6:
        pytest.skip("the code runs as this user without Landlock's signal scope")
    result = sandbox(f"import os; os.kill({os.getpid()}, 0)")
    assert result.text == "ERR PermissionError: [Errno 1] Operation not permitted", result


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="SandboxConfig.timeout_seconds must be"):
        SandboxConfig(timeout_seconds=0)
    with pytest.raises(ValueError, match="SandboxConfig.output_bytes must be at most"):
        SandboxConfig(output_bytes=10, file_bytes=5)
