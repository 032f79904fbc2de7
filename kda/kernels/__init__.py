"""GPU kernels for KDA, grouped by backend. Importing a backend registers its path with `kda.api`.

* `kda.kernels.mosaic_gpu`: Pallas Mosaic GPU kernels (Hopper), the `impl="mosaic_gpu"` path that
  `impl="auto"` takes on Hopper: chunk preparation, recurrence over chunks (also split over
  sequence segments), and the backward of each.
* `kda.kernels.triton`: Pallas/jax-triton kernels for NVIDIA GPUs from Ampere on: the
  `impl="triton"` forward path (by name only) and the KDA layer's short convolution.
* `kda.kernels.path`: what every kernel path does around its kernels (head-size check, bounded
  or unbounded gates).
"""

from kda.kernels import mosaic_gpu, triton

__all__ = ["mosaic_gpu", "triton"]
