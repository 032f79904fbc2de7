"""GPU kernels for KDA. Importing a kernel module registers it with `kda.api` for `impl="auto"`.

* `kda.kernels.mosaic_gpu`: Pallas Mosaic GPU (Hopper) forward of the recurrence over chunks.
"""

from kda.kernels import mosaic_gpu

__all__ = ["mosaic_gpu"]
