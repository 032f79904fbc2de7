"""Runs the token-by-token KDA oracle and the chunked op on random inputs; prints agreement and time.

    python -m experiments.kda_demo [--batch 2] [--length 2048] [--heads 4] [--dim 64] [--gate both]
"""

import argparse
import time

import jax
import jax.numpy as jnp

import kda
from experiments.harness import relative_error


def random_inputs(key, batch, length, heads, dim, gate):
    """FLA-layout inputs with gates of the chosen form (see `kda.gate`)."""
    keys = jax.random.split(key, 7)
    shape = (batch, length, heads, dim)
    raw_gate = jax.random.normal(keys[3], shape)
    dt_bias = jax.random.normal(keys[4], (heads, dim))
    if gate == "lower_bound":
        g = kda.lower_bound_gate(raw_gate, jnp.zeros(heads), dt_bias)
    else:
        A_log = jnp.log(jax.random.uniform(keys[5], (heads,), minval=1.0, maxval=16.0))
        g = kda.softplus_gate(raw_gate, A_log, dt_bias)
    return dict(q=jax.random.normal(keys[0], shape), k=jax.random.normal(keys[1], shape),
                v=jax.random.normal(keys[2], shape), g=g,
                beta=jax.nn.sigmoid(jax.random.normal(keys[6], shape[:3])))


def timed(fn, inputs):
    """(result, seconds of the second call): the first call compiles."""
    jax.block_until_ready(fn(**inputs))
    start = time.perf_counter()
    result = jax.block_until_ready(fn(**inputs))
    return result, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--gate", choices=["lower_bound", "softplus", "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, value in vars(args).items():
        if name != "gate" and value < (0 if name == "seed" else 1):
            parser.error(f"--{name} must be positive, got {value}")

    print(f"KDA on {jax.default_backend()}: B={args.batch} T={args.length} H={args.heads} "
          f"K=V={args.dim}, float32, L2-normalised q/k")
    gates = ["lower_bound", "softplus"] if args.gate == "both" else [args.gate]
    print(f"{'gate':<12} {'impl':<10} {'time ms':>9} {'rel. error o':>13} {'rel. error state':>17}")
    for gate in gates:
        inputs = random_inputs(jax.random.PRNGKey(args.seed), args.batch, args.length,
                               args.heads, args.dim, gate)
        bound = -5.0 if gate == "lower_bound" else None
        results = {}
        for impl in ("reference", "chunked"):
            fn = jax.jit(lambda impl=impl, **x: kda.kda_attention(
                **x, use_qk_l2norm=True, output_final_state=True, gate_lower_bound=bound,
                impl=impl))
            results[impl] = timed(fn, inputs)
        (o_ref, s_ref), _ = results["reference"]
        for impl, ((o, s), seconds) in results.items():
            error_o, error_s = relative_error(o, o_ref), relative_error(s, s_ref)
            print(f"{gate:<12} {impl:<10} {seconds * 1e3:9.1f} {error_o:13.2e} {error_s:17.2e}")
        speedup = results["reference"][1] / results["chunked"][1]
        print(f"{'':<12} speed of chunked relative to the token-by-token scan: {speedup:.2f}x")


if __name__ == "__main__":
    main()
