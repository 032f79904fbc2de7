"""Grouped matmul `out[rows of group g] = lhs[rows of group g] @ rhs[g]`, with gradients.

lhs: [M, K] rows sorted by group, rhs: [G, K, N], group_sizes: [G] -> [M, N] in lhs.dtype,
float32 accumulation. Two backends:
- "xla": `jax.lax.ragged_dot`. Correct everywhere and fine on CPU, but far from the tensor cores'
  throughput on Hopper, so it is not used there.
- "mosaic_gpu": Hopper kernels under a custom VJP: our warp-specialized
  `moe.kernels.mosaic_gpu.ragged_matmul` for the forward and the input gradient, and
  `moe.kernels.mosaic_gpu.transposed_ragged_matmul` for the weight gradient, both faster than
  JAX's bundled `ragged_dot_mgpu` / `transposed_ragged_dot_mgpu` at the MoE's shapes
  (`benchmarks/grouped_matmul_h200.md`).

"auto" takes "mosaic_gpu" when the call is on a Hopper GPU with bf16/f16 operands whose widths
fit the kernels' tiles, and "xla" otherwise, so it is never wrong, only slower.

Rows at or past `sum(group_sizes)` belong to no group: "xla" returns zeros there, "mosaic_gpu"
leaves them unwritten. Callers that have such rows mask them with `jnp.where`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe.kernels.mosaic_gpu.ragged_matmul import ragged_matmul
from moe.kernels.mosaic_gpu.tiling import config_for, transposed_config_for
from moe.kernels.mosaic_gpu.transposed_ragged_matmul import transposed_ragged_matmul

_MOSAIC_DTYPES = (jnp.bfloat16, jnp.float16)
ROW_MULTIPLE = 8  # the kernels' bulk copies need the row count to be a multiple of 8
_WIDTH_MULTIPLE = 128  # K and N: each is an output width of one of the three products


def grouped_matmul(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str = "auto"
) -> jax.Array:
    """Rows of `lhs` grouped consecutively, each group times its own matrix.

    Args:
        lhs: [M, K] rows sorted by group.
        rhs: [G, K, N] one matrix per group.
        group_sizes: [G] int32 rows per group, summing to at most M.
        backend: "auto", "xla" or "mosaic_gpu".

    Returns:
        [M, N] in lhs.dtype.
    """
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"grouped_matmul needs lhs [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}."
        )
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes must be [G={rhs.shape[0]}], got {group_sizes.shape}.")
    rhs = rhs.astype(lhs.dtype)
    backend = resolve_backend(backend, lhs, rhs)
    if backend == "xla":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))
    if backend == "mosaic_gpu":
        if not mosaic_gpu_supports(lhs, rhs):
            raise ValueError(
                f"backend='mosaic_gpu' needs a Hopper GPU, bf16/f16 operands, M % 8 == 0 "
                f"and K, N % 128 == 0; got lhs {lhs.shape} {lhs.dtype}, rhs "
                f"{rhs.shape} on {jax.default_backend()}. Use backend='auto' to fall back to XLA."
            )
        return _mosaic_grouped_matmul(lhs, rhs, group_sizes.astype(jnp.int32))
    raise ValueError(f"backend must be 'auto', 'xla' or 'mosaic_gpu', got {backend!r}.")


def resolve_backend(backend: str, lhs, rhs) -> str:
    """The backend a call runs on: "auto" becomes "mosaic_gpu" where supported, else "xla"."""
    if backend != "auto":
        return backend
    return "mosaic_gpu" if mosaic_gpu_supports(lhs, rhs) else "xla"


def mosaic_gpu_supports(lhs, rhs) -> bool:
    """Whether the Mosaic GPU kernels can run this product (forward and both gradients).

    lhs: [M, K] and rhs: [G, K, N] arrays (or `jax.ShapeDtypeStruct`s).
    """
    m = lhs.shape[0]
    _, k, n = rhs.shape
    return (
        _on_hopper()
        and m % ROW_MULTIPLE == 0
        and lhs.dtype in _MOSAIC_DTYPES
        and rhs.dtype == lhs.dtype
        and k % _WIDTH_MULTIPLE == 0
        and n % _WIDTH_MULTIPLE == 0
    )


@functools.cache
def _on_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


@jax.custom_vjp
def _mosaic_grouped_matmul(lhs, rhs, group_sizes):
    return ragged_matmul(lhs, rhs, group_sizes, config=config_for(lhs.shape[1], rhs.shape[2]))


def _mosaic_forward(lhs, rhs, group_sizes):
    return _mosaic_grouped_matmul(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _mosaic_backward(residuals, out_grad):
    lhs, rhs, group_sizes = residuals
    out_grad = out_grad.astype(lhs.dtype)
    lhs_grad = ragged_matmul(out_grad, rhs, group_sizes, transpose_rhs=True,
                             config=config_for(rhs.shape[2], rhs.shape[1]))
    return lhs_grad, weight_gradient(lhs, out_grad, group_sizes), None


_mosaic_grouped_matmul.defvjp(_mosaic_forward, _mosaic_backward)


def weight_gradient(lhs: jax.Array, out_grad: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[G, K, N] `lhs[rows of g]^T @ out_grad[rows of g]` on a Hopper GPU (our
    `transposed_ragged_matmul`). lhs: [R, K], out_grad: [R, N], group_sizes: [G] int32."""
    return transposed_ragged_matmul(
        lhs, out_grad, group_sizes, config=transposed_config_for(out_grad.shape[1])
    )
