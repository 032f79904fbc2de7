"""Gated-linear-unit activations of the expert and dense FFNs, computed in float32.

SiTU-GLU (Kimi K3 report Eq. 12): `(b1·tanh(g/b1)·sigmoid(g)) ⊙ (b2·tanh(u/b2))`. Both branches
are soft-capped, so `|SiTU-GLU| < b1·b2` (100 at the K3 betas 4 and 25) with a non-zero gradient
everywhere, while for |g| << b1 and |u| << b2 it is SwiGLU `silu(g)·u`. SwiGLU and a hard-clamped
SwiGLU (`silu(min(g, L))·clip(u, -L, L)`, GLM / DeepSeek-V4 style) are kept for ablations.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from core.sharding import arrays_are_whole_on_each_device
from moe.config import ACTIVATIONS
from moe.kernels.triton import glu as glu_kernel


def softcap(z: jax.Array, cap: float) -> jax.Array:
    """`cap · tanh(z / cap)`: the identity near 0, bounded by ±cap."""
    return cap * jnp.tanh(z / cap)


def situ_glu(gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0):
    """SiTU-GLU of gate and up pre-activations (same shape), float32."""
    gate = jnp.asarray(gate, jnp.float32)
    up = jnp.asarray(up, jnp.float32)
    return softcap(gate, beta) * jax.nn.sigmoid(gate) * softcap(up, linear_beta)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU `silu(gate) · up`, float32."""
    return jax.nn.silu(jnp.asarray(gate, jnp.float32)) * jnp.asarray(up, jnp.float32)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float = 7.0) -> jax.Array:
    """SwiGLU with hard clamps `silu(min(gate, limit)) · clip(up, ±limit)`, float32."""
    gate = jnp.minimum(jnp.asarray(gate, jnp.float32), limit)
    return jax.nn.silu(gate) * jnp.clip(jnp.asarray(up, jnp.float32), -limit, limit)


@dataclasses.dataclass(frozen=True)
class GLUActivation:
    """A GLU activation chosen by name, with its constants; `act(gate, up)` is float32."""

    kind: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    swiglu_limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.kind!r}.")

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if gate.shape != up.shape:
            raise ValueError(f"gate {gate.shape} and up {up.shape} must have the same shape.")
        if self.kind == "situ":
            return situ_glu(gate, up, self.situ_beta, self.situ_linear_beta)
        if self.kind == "swiglu":
            return swiglu(gate, up)
        return clamped_swiglu(gate, up, self.swiglu_limit)

    @classmethod
    def from_config(cls, cfg) -> GLUActivation:
        """The activation a `MoEConfig` names."""
        return cls(cfg.activation, cfg.situ_beta, cfg.situ_linear_beta, cfg.swiglu_limit)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_glu(activation: Callable[[jax.Array, jax.Array], jax.Array], gate_up: jax.Array):
    """`activation(gate, up)` of a fused pre-activation, in its dtype; the backward recomputes.

    gate_up: [..., 2, M], gate at index 0 and up at index 1 -> [..., M]. (Keeping the pair on its
    own axis means a sharded M is never merged with it.)

    Plain autodiff of the float32 activation keeps its intermediates (SiTU-GLU: tanh(g/b1),
    sigmoid(g), tanh(u/b2) and their products, seven [..., M] arrays) as float32 residuals; XLA
    may store those that hold transcendentals rather than recompute them in the backward, each a
    float32 copy of the routed rows written and read back. Here the only residual is gate_up,
    which the grouped matmul wrote anyway, and the backward recomputes the intermediates in its
    elementwise pass over gate_up.

    On GPUs, for shapes that `moe.kernels.triton.glu.supports` and arrays not sharded by `jit`
    over a mesh, both passes are Pallas kernels that read their operands and write their results
    once (XLA's backward writes and re-reads float32 intermediates); elsewhere they are the XLA
    computation below.
    """
    return _fused_glu(activation, gate_up)


def glu_kernel_runs(gate_up) -> bool:
    """Whether `fused_glu` runs its Pallas kernels for this gate_up [..., 2, M] (array or
    ShapeDtypeStruct): on a GPU, for shapes `moe.kernels.triton.glu.supports`, arrays whole on
    the device."""
    return (jax.default_backend() == "gpu" and glu_kernel.supports(gate_up)
            and arrays_are_whole_on_each_device())


def _fused_glu(activation, gate_up):
    if glu_kernel_runs(gate_up):
        return glu_kernel.glu_forward(activation, gate_up)
    return activation(gate_up[..., 0, :], gate_up[..., 1, :]).astype(gate_up.dtype)


def _fused_glu_forward(activation, gate_up):
    return _fused_glu(activation, gate_up), gate_up


def _fused_glu_backward(activation, gate_up, out_grad):
    if glu_kernel_runs(gate_up):
        return (glu_kernel.glu_backward(activation, gate_up, out_grad),)
    # Forward and backward share one XLA program: without the barrier, common-subexpression
    # elimination merges the recomputed intermediates with the forward's and the float32
    # residuals come back. Taking out_grad through it too keeps the recomputation from being
    # scheduled (and stored) before the backward reaches it.
    gate_up, out_grad = jax.lax.optimization_barrier((gate_up, out_grad))
    _, pullback = jax.vjp(functools.partial(_fused_glu, activation), gate_up)
    return pullback(out_grad)


fused_glu.defvjp(_fused_glu_forward, _fused_glu_backward)
