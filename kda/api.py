"""`kda_attention`, the one entry point to KDA, and the registry that picks an implementation.

Implementations share one signature (that of `kda.reference.kda_reference`). "reference" and
"chunked" always exist; kernels register themselves with a `supports(call)` predicate that accepts
only the calls their tests cover. `impl="auto"` takes the first registered kernel that supports
the call and otherwise falls back to the chunked op: slower, never wrong. A kernel registered with
`auto=False` runs only when asked for by name (one whose GPU tests have not all run yet).

Around whichever implementation runs, `kda_attention` confines non-finite inputs to the outputs
they reach causally (`confine_non_finite`): the implementation sees them as zeros, and the outputs
of the tokens they reach are set to NaN afterwards. Inside the chunked op and the kernels a NaN
would otherwise spread through the matmuls (0 * NaN = NaN) to earlier tokens and other documents.
"""

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from kda.chunked import chunk_kda
from kda.common import causal_reach
from kda.gate import check_gate_values, check_lower_bound
from kda.reference import kda_reference


@dataclasses.dataclass(frozen=True)
class KDACall:
    """The static facts of one call that a kernel's `supports` predicate may inspect."""

    batch: int
    seq_len: int
    num_heads: int
    num_value_heads: int
    key_dim: int
    value_dim: int
    dtype: jnp.dtype
    has_initial_state: bool
    output_final_state: bool
    has_segment_ids: bool
    use_qk_l2norm: bool
    gate_lower_bound: float | None
    backend: str


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    fn: Callable
    supports: Callable[[KDACall], bool]
    auto: bool = True  # whether `impl="auto"` may choose it


_BUILTIN = {
    "reference": Implementation("reference", kda_reference, lambda call: True),
    "chunked": Implementation("chunked", chunk_kda, lambda call: True),
}
_KERNELS: list[Implementation] = []


def register_kernel(name: str, fn: Callable, supports: Callable[[KDACall], bool], *,
                    auto: bool = True) -> None:
    """Adds a kernel to the front of the `impl="auto"` search order (re-registering replaces);
    with `auto=False` it is left out of that search and runs only when asked for by name."""
    if name in _BUILTIN or name == "auto":
        raise ValueError(f"name {name!r} is reserved; choose another kernel name")
    _KERNELS[:] = [impl for impl in _KERNELS if impl.name != name]
    _KERNELS.insert(0, Implementation(name, fn, supports, auto))


def available_implementations() -> list[str]:
    return ["auto", *_BUILTIN, *(impl.name for impl in _KERNELS)]


def _check_inputs(q, k, v, g, beta, initial_state, segment_ids):
    """Raises a ValueError naming the first argument whose rank, shape or dtype is wrong."""
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 [B, T, H, K], got shape {q.shape}")
    batch, length, num_heads, key_dim = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q [B, T, H, K] = {q.shape}, got {k.shape}")
    if v.ndim != 4 or v.shape[:2] != (batch, length) or v.shape[2] % num_heads:
        raise ValueError(
            f"v must have shape [B, T, HV, V] with B, T = {batch}, {length} and HV a multiple "
            f"of H = {num_heads}, got {v.shape}"
        )
    num_value_heads = v.shape[2]
    expected = {
        "g": (g, (batch, length, num_value_heads, key_dim), "[B, T, HV, K]"),
        "beta": (beta, (batch, length, num_value_heads), "[B, T, HV]"),
    }
    if initial_state is not None:
        expected["initial_state"] = (
            initial_state, (batch, num_value_heads, key_dim, v.shape[3]), "[B, HV, K, V]")
    if segment_ids is not None:
        expected["segment_ids"] = (segment_ids, (batch, length), "[B, T]")
    for name, (x, shape, layout) in expected.items():
        if x.shape != shape:
            raise ValueError(f"{name} must have shape {layout} = {shape}, got {x.shape}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them "
            "to the compute dtype first"
        )
    if initial_state is not None and initial_state.dtype != jnp.float32:
        raise ValueError(
            f"initial_state must be float32 (the state is always kept in float32), got "
            f"{initial_state.dtype}; pass initial_state.astype(jnp.float32)"
        )
    if segment_ids is not None and not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")


class Confined(NamedTuple):
    """`kda_attention`'s inputs with every non-finite value replaced by 0, and what they reach.

    The masks are per token and value head: a bad q spoils only its own token's output (q is
    read, never written into the state); a bad k, v, g or beta, or a bad initial state, spoils
    the state and so every later output of its document (`causal_reach`).
    """

    q: jax.Array  # [B, T, H, K]
    k: jax.Array  # [B, T, H, K]
    v: jax.Array  # [B, T, HV, V]
    g: jax.Array  # [B, T, HV, K]
    beta: jax.Array  # [B, T, HV]
    initial_state: jax.Array | None  # [B, HV, K, V]
    poisoned: jax.Array  # bool [B, T, HV]: outputs to set to NaN
    state_poisoned: jax.Array  # bool [B, HV]: final states to set to NaN


def _bad_gates(g, gate_lower_bound):
    """Gates no implementation can take, bool [B, T, HV, K]: NaN and +inf always; -inf only
    with a bound (the bounded path cannot represent it; the unbounded one erases exactly)."""
    bad = jnp.isnan(g) | (g == jnp.inf)
    return bad | (g == -jnp.inf) if gate_lower_bound is not None else bad


def _zero_where(bad, x):
    """x with its `bad` elements replaced by 0 (bitwise x where nothing is bad)."""
    return jnp.where(bad, jnp.zeros((), x.dtype), x)


def confine_non_finite(q, k, v, g, beta, initial_state, segment_ids, gate_lower_bound):
    """Zeros for the non-finite inputs, and the masks of the outputs they reach (`Confined`).

    Elementwise passes over the inputs and a cumulative max over [B, T, HV]: finite inputs come
    out bitwise unchanged and no output is masked.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV];
      initial_state: [B, HV, K, V] or None; segment_ids: integer [B, T] or None;
      gate_lower_bound: as in `kda_attention` (decides whether g = -inf is bad).
    """
    group = v.shape[2] // q.shape[2]
    to_value_heads = lambda x: jnp.repeat(x, group, axis=2) if group > 1 else x  # noqa: E731
    bad_q, bad_k, bad_v = (~jnp.isfinite(x) for x in (q, k, v))
    bad_g, bad_beta = _bad_gates(g, gate_lower_bound), ~jnp.isfinite(beta)
    reads_bad = to_value_heads(bad_q.any(-1))  # [B, T, HV]
    writes_bad = to_value_heads(bad_k.any(-1)) | bad_v.any(-1) | bad_g.any(-1) | bad_beta
    bad_state = None
    if initial_state is not None:
        bad_initial = ~jnp.isfinite(initial_state)
        bad_state = bad_initial.any((-2, -1))  # [B, HV]
        initial_state = _zero_where(bad_initial, initial_state)
    reached = causal_reach(writes_bad, segment_ids, bad_state)
    return Confined(q=_zero_where(bad_q, q), k=_zero_where(bad_k, k), v=_zero_where(bad_v, v),
                    g=_zero_where(bad_g, g), beta=_zero_where(bad_beta, beta),
                    initial_state=initial_state, poisoned=reached | reads_bad,
                    state_poisoned=reached[:, -1])


def poison_outputs(o, final_state, confined: Confined):
    """o [B, T, HV, V] and final_state [B, HV, K, V] (or None) with NaN where `confined` says
    a non-finite input reaches them."""
    o = jnp.where(confined.poisoned[..., None], jnp.array(jnp.nan, o.dtype), o)
    if final_state is not None:
        final_state = jnp.where(confined.state_poisoned[..., None, None],
                                jnp.array(jnp.nan, final_state.dtype), final_state)
    return o, final_state


def kda_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    use_qk_l2norm: bool = False,
    gate_lower_bound: float | None = None,
    impl: str = "auto",
    check_inputs: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Kimi Delta Attention.

    Args:
      q, k: queries and keys, [B, T, H, K].
      v: values, [B, T, HV, V]; HV a multiple of H (each q/k head serves HV // H value heads).
      g: log-decay per value head and key channel, [B, T, HV, K], g <= 0 (`kda.gate`); without
        `gate_lower_bound` any value down to -inf (a gate <= -104 has exp(g) = 0 in float32 and
        erases its channel of the state, exactly as in the oracle).
      beta: delta-rule write strength, [B, T, HV], usually in (0, 1).
      scale: read scale; default K ** -0.5.
      initial_state: float32 [B, HV, K, V] state before the first token, or None for zeros.
      output_final_state: also return the state after the last token.
      segment_ids: integer [B, T] for packed documents: the state restarts from zero wherever the
        id changes from one token to the next.
      use_qk_l2norm: L2-normalise q and k per head (`x * rsqrt(sum x^2 + 1e-6)`).
      gate_lower_bound: None, or L in [-5, 0) when every g >= L (the lower-bound gate); lets the
        chunked op and kernels compute every 16-token tile as a matmul. A promise: finite gates
        below L give wrong results, silently unless `check_inputs`.
      impl: "auto", "reference", "chunked", or a registered kernel's name.
      check_inputs: debugging aid; raise when g breaks its promise (a NaN, a gate above 0, or a
        gate below `gate_lower_bound`), eagerly as a ValueError, under `jit` as a
        `jax.errors.JaxRuntimeError` with that message (`kda.gate.check_gate_values`). Makes the
        host wait for g on every call.
    Returns:
      (o [B, T, HV, V] in v's dtype, final_state float32 [B, HV, K, V] or None).

    Non-finite inputs (NaN or inf in q, k, v, g, beta or initial_state; g = -inf only with a
    bound) stay where causality takes them, in every implementation: one at token t of a document
    makes NaN the outputs of tokens >= t of that document in its value heads (a bad q: token t's
    alone) and the final state if that document is the row's last; earlier tokens and other
    documents are untouched (`confine_non_finite`).
    """
    _check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    if gate_lower_bound is not None:
        gate_lower_bound = check_lower_bound(gate_lower_bound, "gate_lower_bound")
    if check_inputs:
        check_gate_values(g, gate_lower_bound)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    call = KDACall(
        batch=q.shape[0], seq_len=q.shape[1], num_heads=q.shape[2], num_value_heads=v.shape[2],
        key_dim=q.shape[3], value_dim=v.shape[3], dtype=q.dtype,
        has_initial_state=initial_state is not None, output_final_state=output_final_state,
        has_segment_ids=segment_ids is not None, use_qk_l2norm=use_qk_l2norm,
        gate_lower_bound=gate_lower_bound, backend=jax.default_backend(),
    )
    chosen = _choose(impl, call)
    confined = confine_non_finite(q, k, v, g, beta, initial_state, segment_ids, gate_lower_bound)
    o, final_state = chosen.fn(
        confined.q, confined.k, confined.v, confined.g, confined.beta, scale=scale,
        initial_state=confined.initial_state, output_final_state=output_final_state,
        segment_ids=segment_ids, use_qk_l2norm=use_qk_l2norm, gate_lower_bound=gate_lower_bound,
    )
    return poison_outputs(o, final_state, confined)


def _choose(impl: str, call: KDACall) -> Implementation:
    if impl == "auto":
        supported = (kernel for kernel in _KERNELS if kernel.auto and kernel.supports(call))
        return next(supported, _BUILTIN["chunked"])
    by_name = {**_BUILTIN, **{kernel.name: kernel for kernel in _KERNELS}}
    if impl not in by_name:
        raise ValueError(f"impl must be one of {available_implementations()}, got {impl!r}")
    chosen = by_name[impl]
    if not chosen.supports(call):
        raise ValueError(
            f"impl={impl!r} does not support this call ({call}); use impl='auto' to fall back "
            "to the chunked op"
        )
    return chosen
