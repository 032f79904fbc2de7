"""Times the score-tile backward kernel of KDA's preparation with two and four warpgroups.

`kda.kernels.mosaic_gpu.score_backward.score_backward` ([token, key] orientation, one program a
chunk) with two warpgroups (two programs an SM) and, where K = 128, with four (one program an SM),
on random inputs of the shapes and dtypes the preparation's VJP hands it (q, k [B, T, H, K] bf16;
per-chunk gates and cotangents [B, H, T/64, 64, K]; dAkk [B, H, T/64, 64, 64] bf16, zero on and
above the diagonal), and the relative L2 difference of each variant's dq, dk and
dg from the two-warpgroup ones. Earlier kernels' numbers: `benchmarks/kda_notes.md`.

    python -m experiments.bench_score_backward                  # a Hopper GPU: 8x2048x16x128
    MOSAIC_GPU_DUMP_PTXAS=1 python -m experiments.bench_score_backward --repeats 1  # + registers
    python -m experiments.bench_score_backward --smoke          # CPU: interpret mode, 2 chunks

At K = 128 it compiles two kernels, in this order (ptxas's reports come in it): two warpgroups
(two programs an SM need at most 128 registers a thread), then four (one program an SM,
likewise). It prints its times; it writes no table.
"""

import argparse
import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import AbstractDevice, AbstractMesh

from experiments.harness import median_seconds, relative_error
from kda.chunked import ChunkedInputs
from kda.kernels.mosaic_gpu.score_backward import SLAB, score_backward
from kda.kernels.mosaic_gpu.tiles import CHUNK

LOWER_BOUND = -5.0


def kernels(dim):
    """name -> kernel: two warpgroups a chunk first, then K / 32 (where that is more)."""
    return {f"{warpgroups} warpgroups a chunk": functools.partial(score_backward,
                                                                  warpgroups=warpgroups)
            for warpgroups in sorted({2, dim // SLAB})}


def kernel_inputs(seed, batch, length, heads, dim):
    """The positional arguments of `score_backward` (one document a row, group 1)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 10))
    num_chunks = length // CHUNK
    chunked = (batch, heads, num_chunks)
    normal = lambda shape, dtype=jnp.float32: jax.random.normal(  # noqa: E731
        next(keys), shape).astype(dtype)
    tokens = jnp.arange(CHUNK)
    dakk = jnp.where(tokens[:, None] > tokens[None, :], normal((*chunked, CHUNK, CHUNK)), 0.0)
    cotangents = ChunkedInputs(W=None, U=None, q_from_state=normal((*chunked, CHUNK, dim)),
                               k_to_state=normal((*chunked, CHUNK, dim)),
                               chunk_decay=normal((*chunked, dim)),
                               Aqk=normal((*chunked, CHUNK, CHUNK), jnp.bfloat16))
    g = jax.random.uniform(next(keys), (*chunked, CHUNK, dim), minval=LOWER_BOUND, maxval=0.0)
    G = jnp.cumsum(g, axis=-2)  # as the forward saves it
    factor = jnp.full((batch, heads, length), dim**-0.5, jnp.float32)
    return (normal((batch, length, heads, dim), jnp.bfloat16),
            normal((batch, length, heads, dim), jnp.bfloat16), G,
            jnp.zeros((batch, length), jnp.float32), factor * dim**-0.5, factor,
            dakk.astype(jnp.bfloat16), normal((*chunked, CHUNK, dim)), cotangents)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x2048x16x128", help="BxTxHxK (T a multiple of 64)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: interpret mode at 1x128x1xK, one timed call")
    options = parser.parse_args(argv)
    batch, length, heads, dim = (int(x) for x in options.shape.split("x"))
    context = contextlib.nullcontext()
    repeats, warmup = options.repeats, 3
    if options.smoke:
        batch, length, heads, repeats, warmup = 1, 128, 1, 1, 0
        hopper = AbstractMesh((), (), abstract_device=AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
        context = contextlib.ExitStack()
        context.enter_context(jax.sharding.use_abstract_mesh(hopper))
        context.enter_context(plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()))
    inputs = kernel_inputs(0, batch, length, heads, dim)
    print(f"score-tile backward, {batch}x{length}x{heads}x{dim}, median of {repeats}")
    reference = None
    with context:
        for name, kernel in kernels(dim).items():
            run = jax.jit(functools.partial(kernel, lower_bound=LOWER_BOUND, group=1))
            milliseconds = 1e3 * median_seconds(lambda run=run: run(*inputs), repeats, warmup)
            outputs = jax.block_until_ready(run(*inputs))
            if reference is None:
                reference = outputs
            differences = ", ".join(f"{output} {relative_error(new, old):.1e}"
                                    for output, new, old in zip(("dq", "dk", "dg"), outputs,
                                                                reference))
            print(f"  {name}: {milliseconds:.3f} ms (relative to two warpgroups: {differences})")


if __name__ == "__main__":
    main()
