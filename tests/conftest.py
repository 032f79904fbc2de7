"""Test-wide set-up: eight virtual CPU devices for mesh tests, XLA's quick code generation on
machines without a GPU, a persistent compilation cache, and the `gpu` marker."""

import os

# Must happen before JAX initialises its backends (conftest is imported first). Besides the eight
# devices: the CPU suite compiles hundreds of small programs and runs each a few times, so XLA's
# unoptimised code generation (what `train.step.FAST_COMPILE_OPTIONS` asks for one step) cuts its
# time by a fifth to a quarter. Machines with an NVIDIA GPU keep XLA's defaults: the flags are
# global, and the GPU tests should run the code that users run.
_FLAGS = ["--xla_force_host_platform_device_count=8"]
if not os.path.exists("/dev/nvidiactl"):
    _FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ.setdefault("XLA_FLAGS", " ".join(_FLAGS))
# Many tests compile the same programs (the tiny model's train step in every run-a-training test,
# again in each subprocess the fault tests launch): JAX's persistent cache, keyed by the program,
# the flags and the versions, compiles each once per suite and once ever on a developer's machine.
# Set through the environment so that those subprocesses share it; inside pytest's own cache
# folder (ignored by git, emptied by `pytest --cache-clear`).
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMPILATION_CACHE = os.path.join(_REPOSITORY, ".pytest_cache", "jax")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _COMPILATION_CACHE)

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def one_device_xla_flags(monkeypatch) -> str:
    """For a child process that must see one CPU device (a notebook's kernel): the suite's
    XLA_FLAGS without the eight virtual devices, so that it still compiles quickly and shares the
    persistent cache's flags. Returns the flags it set."""
    flags = " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                     if not flag.startswith("--xla_force_host_platform_device_count"))
    monkeypatch.setenv("XLA_FLAGS", flags)
    return flags
