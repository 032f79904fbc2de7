"""KDA's Pallas Mosaic GPU kernels (Hopper: wgmma, TMA), the `impl="mosaic_gpu"` path.

* `op`: the kernels composed under `jax.custom_vjp`s and registered with `kda.api` (importing
  this package registers it; it imports on any backend).
* `prepare`: forward of the chunk preparation with bounded gates (scores, masks, UT transform),
  writing the recurrence kernel's operands.
* `recurrence`: forward of the recurrence over chunks; `reversed_recurrence`: its backward.
* `recurrence_cotangents`: the recurrence's per-chunk cotangents that contract over V, one pass.
* `sequence_parallel`: the recurrence (and its reverse) over segments of the sequence side by
  side, combined exactly, for few long sequences.
* `prepare_backward`: backward of the chunk preparation; `score_backward`: its score-tile
  kernel; `l2_norm_backward`: backward of the q/k L2 norm.
* `tiles`: in-kernel building blocks of the preparation kernels (chunk cumsum, causal anchors,
  document masks, `(I + N)^-1`, split matmuls); `common`: what all kernels share (SMEM layouts,
  launch jitting, the operand and residual contracts).
"""

from kda.kernels.mosaic_gpu.op import NAME, kernel_recurrence, mosaic_gpu_kda, supports

__all__ = ["NAME", "kernel_recurrence", "mosaic_gpu_kda", "supports"]
