"""The MoE's Pallas Mosaic GPU kernels (Hopper): warp-specialized grouped GEMMs.

* `ragged_matmul`: `out[rows of g] = lhs[rows of g] @ rhs[g]` over row-ragged groups (the expert
  up/down projections and their input gradients), with optional fused GLU epilogues
  (`ragged_matmul_glu`, `ragged_matmul_glu_grad`).
* `transposed_ragged_matmul`: the weight gradient `out[g] = lhs[rows of g]^T @ out_grad[rows of g]`.
* `tiling`: the kernels' tile configs, sweep tables, config pickers and Hopper constants.
* `common`: what both kernels share (the persistent launch, swizzled SMEM, slab stores).
* `simulation`: `simulated_hopper` (lower for "cuda" without a GPU) and `interpreted_on_cpu`.
"""
