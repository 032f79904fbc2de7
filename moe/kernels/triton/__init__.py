"""The MoE's Pallas kernels on the Triton backend (NVIDIA GPUs).

* `glu`: a GLU activation of a fused gate/up product, forward and backward in one pass each.
"""
