"""GPU kernels of the MoE, grouped by backend; `moe.grouped_matmul` and `moe.activations` pick
them, and fall back to XLA wherever a kernel's tests do not cover the call.

* `moe.kernels.mosaic_gpu`: Pallas Mosaic GPU (Hopper) grouped GEMMs over row-ragged groups.
* `moe.kernels.triton`: Pallas (Triton backend) GLU activation kernels.
"""
