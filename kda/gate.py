"""The two log-decay gate parameterisations of KDA, computed in float32.

The gate turns a raw projection `f` into a per-channel log-decay `g <= 0`; the state's key row `c`
of head `h` is multiplied by `exp(g[..., h, c])` at every token.

* `lower_bound_gate` (Kimi K3, "safe" gate): `g = L * sigmoid(exp(A_log[h]) * (f + dt_bias[h, c]))`
  lies in `(L, 0)`. With `L >= -5` the log-decay accumulated over a 16-token tile is at most
  `16 * 5 = 80` nats and `e^80 ~ 5.5e34` fits in float32 and bfloat16 (max `~ e^88.7`), so the
  chunked algorithm can factor every 16x16 score tile, the diagonal ones included, into a plain
  matmul of `q * exp(G - anchor)` and `k * exp(anchor - G)` (`kda.chunked`). A bound below -5 would
  overflow those factors, which is why it is rejected.
* `softplus_gate` (released Kimi-Linear form): `g = -exp(A_log[h]) * softplus(f + dt_bias[h, c])`
  is unbounded below, so the chunked op must use the exact per-element path on diagonal tiles.

`check_gate_values` checks at run time what a caller promises about g: g <= 0, no NaN, and g >= L
when it passes `gate_lower_bound=L` (`kda_attention(check_inputs=True)`).

Derivation of the bound: docs/kda_gate.md.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Most negative per-token log-decay for which a 16-token tile's factored scores stay finite.
MIN_LOWER_BOUND = -5.0


def check_lower_bound(lower_bound: float, name: str = "lower_bound") -> float:
    """Returns `lower_bound` as a float if it lies in [-5, 0), else raises a ValueError."""
    lower_bound = float(lower_bound)
    if not MIN_LOWER_BOUND <= lower_bound < 0.0:
        raise ValueError(
            f"{name} must lie in [{MIN_LOWER_BOUND}, 0), got {lower_bound}. The chunked KDA "
            "algorithm factors each 16-token tile into a matmul of q*exp(G - a) and k*exp(a - G); "
            "with a per-token log-decay of at least -5 those factors stay below e^80, which fits "
            "float32 and bfloat16 (max ~e^88.7). Use a bound in [-5, 0), or the softplus gate "
            "(unbounded, exact per-element diagonal tiles) if you need stronger decay."
        )
    return lower_bound


def _gate_input(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array):
    """Validates shapes; returns float32 `(exp(A_log) [H, 1], f + dt_bias [B, T, H, K])`."""
    if f.ndim != 4:
        raise ValueError(f"f must have rank 4 [B, T, H, K], got shape {f.shape}")
    num_heads, head_dim = f.shape[2], f.shape[3]
    if A_log.shape != (num_heads,):
        raise ValueError(f"A_log must have shape [H] = ({num_heads},), got {A_log.shape}")
    if dt_bias.shape != (num_heads, head_dim):
        raise ValueError(
            f"dt_bias must have shape [H, K] = ({num_heads}, {head_dim}), got {dt_bias.shape}"
        )
    rate = jnp.exp(A_log.astype(jnp.float32))[:, None]
    return rate, f.astype(jnp.float32) + dt_bias.astype(jnp.float32)


def lower_bound_gate(
    f: jax.Array, A_log: jax.Array, dt_bias: jax.Array, lower_bound: float = MIN_LOWER_BOUND
) -> jax.Array:
    """Bounded log-decay `g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h, c]))`.

    Args:
      f: raw gate projection, [B, T, H, K].
      A_log: per-head log rate, [H].
      dt_bias: per-channel bias, [H, K].
      lower_bound: in [-5, 0); `g` lies in `(lower_bound, 0)`.
    Returns:
      g: float32 [B, T, H, K].
    """
    lower_bound = check_lower_bound(lower_bound)
    rate, u = _gate_input(f, A_log, dt_bias)
    return lower_bound * jax.nn.sigmoid(rate * u)


def softplus_gate(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """Unbounded log-decay `g = -exp(A_log[h]) * softplus(f + dt_bias[h, c])`.

    Args:
      f: raw gate projection, [B, T, H, K].
      A_log: per-head log rate, [H].
      dt_bias: per-channel bias, [H, K].
    Returns:
      g: float32 [B, T, H, K], in (-inf, 0).
    """
    rate, u = _gate_input(f, A_log, dt_bias)
    return -rate * jax.nn.softplus(u)


def gate_violations(lowest, highest, nans, *, lower_bound: float | None, name: str = "g"):
    """What is wrong with a gate array, from its summary, as sentences ("" when nothing is).

    Args:
      lowest, highest: the most negative and the largest non-NaN gate (arrays of any shape, e.g.
        one per example under `vmap`; -inf counts as a value).
      nans: the number of NaN gates.
      lower_bound: the promised bound L, or None (unbounded: any g in [-inf, 0]).
      name: the argument's name in the message.
    """
    lowest, highest = float(np.min(lowest)), float(np.max(highest))
    nans = int(np.sum(nans))
    problems = []
    if nans:
        problems.append(f"{name} has {nans} NaN gates")
    if highest > 0.0:
        problems.append(
            f"{name} must be a log-decay <= 0, but its largest gate is {highest:.6g} (a gate "
            "above 0 grows the state); compute it with kda.lower_bound_gate or kda.softplus_gate")
    if lower_bound is not None and lowest < lower_bound:
        problems.append(
            f"{name} breaks the promise gate_lower_bound={lower_bound:g}: its most negative "
            f"gate is {lowest:.6g}, and below the bound the matmul tiles of the chunked op and "
            "the kernels give wrong results or NaN. Pass gate_lower_bound=None (exact for any "
            f"gate down to -inf, e.g. kda.softplus_gate's), or keep g in [{lower_bound:g}, 0] "
            f"(kda.lower_bound_gate with lower_bound={lower_bound:g} does by construction, or "
            f"clamp: jnp.maximum(g, {lower_bound:g}))")
    return "; ".join(problems)


def _raise_on_violations(lowest, highest, nans, *, lower_bound, name):
    """`jax.debug.callback` target: raises a ValueError naming what `gate_violations` finds."""
    message = gate_violations(lowest, highest, nans, lower_bound=lower_bound, name=name)
    if message:
        raise ValueError(message)


def check_gate_values(g: jax.Array, lower_bound: float | None, name: str = "g") -> None:
    """Raises when `g` breaks the promise made about it: a NaN, a gate above 0, or, with a bound
    L, a gate below L (-inf included). Without a bound, -inf is allowed (it erases the state).

    Works eagerly (a ValueError) and inside `jit`, `grad` and `vmap`: three reductions of g feed
    a `jax.debug.callback`, which raises on the host when the program runs; under `jit` the
    error arrives as a `jax.errors.JaxRuntimeError` that carries the ValueError's message. The
    callback makes the host wait for g, so this is a debugging aid, off by default.

    Args:
      g: log-decay [B, T, HV, K].
      lower_bound: the promised L, or None.
      name: the argument's name in the message.
    """
    if g.size == 0:
        return
    nan = jnp.isnan(g)
    lowest = jnp.min(jnp.where(nan, jnp.inf, g))
    highest = jnp.max(jnp.where(nan, -jnp.inf, g))
    callback = functools.partial(_raise_on_violations, lower_bound=lower_bound, name=name)
    jax.debug.callback(callback, lowest, highest, jnp.sum(nan, dtype=jnp.int32))
