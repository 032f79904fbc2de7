"""Kimi Delta Attention: gates, the token-by-token oracle, the chunked op, and one entry point.

    o, state = kda.kda_attention(q, k, v, g, beta, output_final_state=True)

The Flax layer lives in `kda.layer` (imported separately, so the op needs no Flax). GPU kernels
(`kda.kernels`) register themselves here for `impl="auto"`; they import on any backend.
"""

from kda.api import KDACall, available_implementations, kda_attention, register_kernel
from kda.chunked import chunk_kda
from kda.gate import MIN_LOWER_BOUND, lower_bound_gate, softplus_gate
from kda.reference import kda_reference, recurrent_step

from kda import kernels  # noqa: F401  (registers the GPU kernels with kda.api)

__all__ = [
    "KDACall",
    "MIN_LOWER_BOUND",
    "available_implementations",
    "chunk_kda",
    "kda_attention",
    "kda_reference",
    "lower_bound_gate",
    "recurrent_step",
    "register_kernel",
    "softplus_gate",
]
