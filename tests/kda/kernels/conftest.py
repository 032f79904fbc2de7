"""Fixtures of the KDA kernel tests."""

import pytest

import kda.api
from kda.kernels.mosaic_gpu import op as mosaic_gpu


@pytest.fixture
def kernel_on_any_backend(monkeypatch):
    """Lets `kda_attention(impl="mosaic_gpu")` reach the kernel on CPU (for interpret mode)."""
    kernel = kda.api.Implementation(mosaic_gpu.NAME, mosaic_gpu.mosaic_gpu_kda,
                                    lambda call: True)
    monkeypatch.setattr(kda.api, "_KERNELS", [kernel])
