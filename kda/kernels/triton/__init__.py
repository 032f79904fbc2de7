"""KDA's Triton kernels (jax-triton and Pallas' Triton backend) for NVIDIA GPUs from Ampere on.

* `op`: the `impl="triton"` path (forward kernels, plain-JAX backward), registered with
  `kda.api` by name only (`impl="auto"` never takes it); importing it never imports triton.
* `kernels`: the Triton kernels of `op` (chunk-preparation scores and solve, recurrence); this
  module imports triton, so it is loaded only to launch.
* `short_conv`: the KDA layer's causal short convolution and SiLU as Pallas (Triton) kernels,
  used by `kda.layer.conv_silu_parts` where `KDAConfig.conv_kernels` allows.
"""

from kda.kernels.triton.op import NAME, kernel_recurrence, supports, triton_kda

__all__ = ["NAME", "kernel_recurrence", "supports", "triton_kda"]
