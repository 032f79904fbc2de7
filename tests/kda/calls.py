"""`kda_attention` as the KDA tests call it: one call by implementation name, returning the output
and the final state, and fla's test loss with its gradients.

Inputs are `tests.kda.inputs.make_inputs` dictionaries ([B, T, H, K] q and k, [B, T, HV, V] v,
[B, T, HV, K] g, [B, T, HV] beta, optionally [B, HV, K, V] initial_state and [B, T] segment ids).
"""

import functools

import jax
import jax.numpy as jnp

import kda
from tests.kda.inputs import make_inputs


def run(impl, inputs, **options):
    """`kda_attention(**inputs, impl=impl, **options)`: (o [B, T, HV, V], state [B, HV, K, V])."""
    return kda.kda_attention(**inputs, output_final_state=True, impl=impl, **options)


@functools.cache
def _jitted_run(impl, static_inputs, options):
    return jax.jit(lambda arrays: run(impl, {**arrays, **dict(static_inputs)}, **dict(options)))


def jitted_run(impl, inputs, **options):
    """`run` under `jit`, one compiled program per implementation, options and shapes: eagerly the
    op dispatches (and on first sight compiles) each of its hundreds of operations alone, which
    costs about twice the CPU time of compiling it whole. The inputs' non-array entries
    (`use_qk_l2norm`, a None state) and the options are static."""
    arrays = {name: x for name, x in inputs.items() if isinstance(x, jax.Array)}
    static_inputs = tuple(sorted((name, x) for name, x in inputs.items() if name not in arrays))
    return _jitted_run(impl, static_inputs, tuple(sorted(options.items())))(arrays)


def loss_and_grads(impl, inputs, lower_bound):
    """fla's test loss `sum(o * do) + sum(state * dstate)` and its gradients (the initial
    state's where `inputs` has one), by name: o, state, q, k, v, g, beta[, initial_state]."""
    names = [name for name in ("q", "k", "v", "g", "beta", "initial_state") if name in inputs]
    cotangents = make_inputs(99, *inputs["v"].shape[:2], inputs["q"].shape[2],
                             *inputs["v"].shape[2:3], inputs["q"].shape[3], inputs["v"].shape[3],
                             initial_state=True)
    d_o = cotangents["v"] - 0.5
    d_state = cotangents["initial_state"]

    def loss(differentiable):
        o, state = run(impl, {**inputs, **differentiable}, gate_lower_bound=lower_bound)
        return jnp.sum(o.astype(jnp.float32) * d_o) + jnp.sum(state * d_state), (o, state)

    grads, (o, state) = jax.jit(jax.grad(loss, has_aux=True))({n: inputs[n] for n in names})
    return {"o": o, "state": state, **grads}
