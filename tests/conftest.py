"""Test-wide set-up: eight virtual CPU devices for mesh tests, XLA's quick code generation on
machines without a GPU, and the `gpu` marker."""

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

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
