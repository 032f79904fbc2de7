"""GPU kernels for KDA. Importing a kernel module registers it with `kda.api` for `impl="auto"`.

* `kda.kernels.mosaic_gpu`: Pallas Mosaic GPU (Hopper) forward of the recurrence over chunks, and
  the `impl="mosaic_gpu"` path (registered) that runs it, after the preparation kernel when the
  gates are bounded.
* `kda.kernels.mosaic_gpu_prepare`: Pallas Mosaic GPU (Hopper) forward of the chunk preparation
  with bounded gates (scores, masks, UT transform), writing the recurrence kernel's operands.
* `kda.kernels.mosaic_gpu_common`: what the two share (SMEM layouts, `RecurrenceOperands`).
* `kda.kernels.triton`: the same two kernels in Triton through jax-triton (NVIDIA GPUs from Ampere
  on; `kda.kernels.triton_kernels` holds the kernels), the `impl="triton"` path (registered behind
  `mosaic_gpu`).
"""

from kda.kernels import mosaic_gpu, triton

__all__ = ["mosaic_gpu", "triton"]
