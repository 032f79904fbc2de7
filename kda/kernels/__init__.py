"""GPU kernels for KDA. Importing a kernel module registers it with `kda.api` for `impl="auto"`.

* `kda.kernels.mosaic_gpu`: the `impl="mosaic_gpu"` path (registered): the Pallas Mosaic GPU
  (Hopper) kernels below composed under `jax.custom_vjp`s.
* `kda.kernels.mosaic_gpu_prepare`: forward of the chunk preparation with bounded gates (scores,
  masks, UT transform), writing the recurrence kernel's operands.
* `kda.kernels.mosaic_gpu_recurrence`: forward of the recurrence over chunks.
* `kda.kernels.sequence_parallel`: the recurrence over segments of the sequence side by side,
  combined exactly, for few long sequences.
* `kda.kernels.mosaic_gpu_backward`: the reversed recurrence (backward of the recurrence).
* `kda.kernels.mosaic_gpu_cotangents`: the recurrence's per-chunk cotangents in one pass.
* `kda.kernels.mosaic_gpu_prepare_backward`: backward of the chunk preparation.
* `kda.kernels.mosaic_gpu_l2_norm`: backward of the q/k L2 norm (the preparation backward's
  last step).
* `kda.kernels.mosaic_gpu_tiles`: the in-kernel building blocks of both preparation kernels
  (chunk cumsum, causal anchors and score tiles, document masks, `(I + N)^-1`, split matmuls).
* `kda.kernels.path`: what every kernel path does around its kernels (head-size check, bounded
  or unbounded gates).
* `kda.kernels.mosaic_gpu_common`: what they share (SMEM layouts, `RecurrenceOperands`).
* `kda.kernels.short_conv`: the KDA layer's short convolution and SiLU as Pallas (Triton) kernels,
  used by `kda.layer.conv_silu_parts` where `KDAConfig.conv_kernels` (on by default) allows.
* `kda.kernels.triton`: the forward kernels in Triton through jax-triton (NVIDIA GPUs from Ampere
  on; `kda.kernels.triton_kernels` holds the kernels), the `impl="triton"` path (by name only:
  its GPU tests have passed on the H200 alone, where `impl="auto"` takes `mosaic_gpu`).
"""

from kda.kernels import mosaic_gpu, triton

__all__ = ["mosaic_gpu", "triton"]
