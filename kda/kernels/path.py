"""What every kernel path does around its kernels: check the head sizes, run the chunked op with
the kernel's recurrence when the gates are unbounded, or the kernel path's whole-op
`jax.custom_vjp` when they are bounded (`gate_lower_bound`); and what their `supports`
predicates ask of the call and the device."""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kda.api import KDACall
from kda.chunked import CHUNK_SIZE, chunk_kda_with_recurrence


class BoundedOptions(NamedTuple):
    """The static arguments of a bounded-gate `custom_vjp` (hashable, for `nondiff_argnums`)."""

    scale: float
    use_qk_l2norm: bool
    gate_lower_bound: float


class KernelPath(NamedTuple):
    """A kernel path's pieces.

    kernels: the name in error messages ("the Mosaic GPU kernels").
    supported_dims: the head sizes K and V the kernels take.
    recurrence: `(ChunkedInputs, initial_state, out_dtype) -> (o, final_state)`, differentiable,
      used with the plain-JAX preparation when the gates are unbounded.
    bounded_kda: `(q, k, v, g, beta, initial_state, segment_ids, BoundedOptions) ->
      (o, final_state)`, the whole op with bounded gates; initial_state is float32, or None for
      zeros (which a kernel then need not read).
    bounded_needs_equal_dims: the bounded path only for K = V (else the recurrence path).
    """

    kernels: str
    supported_dims: tuple[int, ...]
    recurrence: Callable
    bounded_kda: Callable
    bounded_needs_equal_dims: bool


def kernel_kda(path: KernelPath, q, k, v, g, beta, *, scale, initial_state, output_final_state,
               segment_ids, use_qk_l2norm, gate_lower_bound):
    """KDA by a kernel path; arguments and results as `kda.reference.kda_reference`, with K and V
    in `path.supported_dims`."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    if key_dim not in path.supported_dims or value_dim not in path.supported_dims:
        raise ValueError(
            f"{path.kernels} need K and V in {path.supported_dims}, got K={key_dim}, "
            f"V={value_dim}; use impl='chunked' for other head sizes")
    if gate_lower_bound is None or (path.bounded_needs_equal_dims and key_dim != value_dim):
        return chunk_kda_with_recurrence(
            path.recurrence, q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, segment_ids=segment_ids,
            use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound,
            chunk_size=CHUNK_SIZE)
    if initial_state is not None:
        initial_state = initial_state.astype(jnp.float32)
    o, final_state = path.bounded_kda(
        q, k, v, g, beta, initial_state, segment_ids,
        BoundedOptions(float(scale), bool(use_qk_l2norm), float(gate_lower_bound)))
    return o, (final_state if output_final_state else None)


def covers_call_shapes(call: KDACall, supported_dims: tuple[int, ...]) -> bool:
    """What the kernel paths ask of the call itself, whatever the device: bfloat16 and
    K = V in `supported_dims`."""
    return (call.dtype == jnp.bfloat16
            and call.key_dim == call.value_dim
            and call.key_dim in supported_dims)


def compute_capability() -> str | None:
    """The default GPU's CUDA compute capability ("9.0" on Hopper), or None: no GPU, or one
    that reports none."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    return getattr(device, "compute_capability", None)
