"""kda.kernels.triton.short_conv: the Pallas kernels of the KDA layer's short convolution and SiLU
(interpret mode on CPU, Triton lowering for CUDA, and on the GPU through `conv_silu_parts`).

Both paths take the convolution in float32; the kernels also take the SiLU (and its slope) in
float32 before one rounding, where the XLA path rounds the pre-activation to x's dtype first. So
both are compared with the float32 answer, and the kernels must be at least as accurate in the
worst element (the weight's gradient, a sum over every token, is far more accurate: it never
passes through bf16)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from kda import layer as kda_layer
from kda.common import document_index
from kda.kernels.triton import short_conv

A100 = AbstractMesh((), (), abstract_device=AbstractDevice(
    device_kind="NVIDIA A100-SXM4-80GB", platform="gpu", num_cores=108))
WIDTHS = (128, 128, 256)  # q, k, v: the value part twice as wide (grouped value heads)


def _problem(batch, length, widths=WIDTHS, width=4, seed=0):
    """bf16 x [B, T, C], float32 weight [W, C], packed segment ids (several documents a row,
    one of them shorter than the filter), and bf16 cotangents of the parts."""
    keys = jax.random.split(jax.random.key(seed), 3 + len(widths))
    channels = sum(widths)
    x = (2 * jax.random.normal(keys[0], (batch, length, channels))).astype(jnp.bfloat16)
    weight = jax.random.uniform(keys[1], (width, channels), jnp.float32, -0.8, 0.8)
    cuts = jnp.sort(jax.random.randint(keys[2], (batch, 3), 1, length), axis=1)
    cuts = cuts.at[:, 1].set(jnp.minimum(cuts[:, 0] + 2, length - 1))  # a 2-token document
    segment_ids = jnp.sum(jnp.arange(length)[None, :, None] >= cuts[:, None, :], axis=-1)
    grads = tuple(jax.random.normal(k, (batch, length, w), jnp.bfloat16)
                  for k, w in zip(keys[3:], widths))
    return x, weight, segment_ids, grads


def _xla_parts(x, weight, segment_ids, dtype, widths=WIDTHS):
    """The XLA path (`causal_depthwise_conv`, SiLU, split) with x taken in `dtype`."""
    x = x.astype(dtype)
    prefix = jnp.zeros((x.shape[0], weight.shape[0] - 1, x.shape[2]), dtype)
    mixed, _ = kda_layer.causal_depthwise_conv(x, weight, prefix, segment_ids)
    bounds = np.cumsum(widths)[:-1].tolist()
    return tuple(jnp.split(jax.nn.silu(mixed), bounds, axis=-1))


def _vjp(fn, x, weight, grads):
    out, pullback = jax.vjp(fn, x, weight)
    return out, pullback(tuple(g.astype(out[0].dtype) for g in grads))


def _max_error(values, exact):
    return max(float(np.max(np.abs(np.asarray(v, np.float64) - np.asarray(e, np.float64))))
               for v, e in zip(values, exact))


@pytest.mark.slow
@pytest.mark.parametrize("backward", short_conv.BACKWARDS)
@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize("batch,length", [(2, 96), (1, 256)])
def test_kernels_in_interpret_mode_are_at_least_as_accurate_as_xla(backward, documents, batch,
                                                                    length):
    x, weight, segment_ids, grads = _problem(batch, length)
    segment_ids = segment_ids if documents else None
    document = None if segment_ids is None else document_index(segment_ids)
    options = short_conv.KernelOptions(backward=backward)
    parts = short_conv.conv_silu_forward(x, weight, document, WIDTHS, options=options,
                                         interpret=True)
    dx, d_weight = short_conv.conv_silu_backward(x, weight, document, grads, options=options,
                                                 interpret=True)
    assert [p.shape for p in parts] == [(batch, length, w) for w in WIDTHS]
    assert all(p.dtype == jnp.bfloat16 for p in parts) and dx.dtype == jnp.bfloat16
    assert d_weight.shape == weight.shape and d_weight.dtype == jnp.float32

    exact, (exact_dx, exact_dw) = _vjp(
        functools.partial(_xla_parts, segment_ids=segment_ids, dtype=jnp.float32),
        x, weight, grads)
    xla, (xla_dx, xla_dw) = _vjp(
        functools.partial(_xla_parts, segment_ids=segment_ids, dtype=jnp.bfloat16),
        x, weight, grads)
    for ours, theirs, truth in ((parts, xla, exact), ((dx,), (xla_dx,), (exact_dx,))):
        scale = max(float(np.max(np.abs(np.asarray(t, np.float32)))) for t in truth)
        assert _max_error(ours, truth) <= 2**-8 * scale  # one bf16 rounding of the result
        assert _max_error(ours, truth) <= _max_error(theirs, truth)
    dw_scale = float(np.max(np.abs(exact_dw)))
    assert _max_error([d_weight], [exact_dw]) <= 1e-5 * dw_scale
    assert _max_error([d_weight], [exact_dw]) < _max_error([xla_dw], [exact_dw])


def test_documents_never_mix():
    """A token's output and its input's gradient ignore every other document: changing one
    document's inputs changes no other document's outputs."""
    x, weight, segment_ids, _ = _problem(1, 64)
    document = document_index(segment_ids)
    first = np.asarray(document[0]) == 0
    changed = x.at[0, ~first].set(7)
    before = short_conv.conv_silu_forward(x, weight, document, WIDTHS, interpret=True)
    after = short_conv.conv_silu_forward(changed, weight, document, WIDTHS, interpret=True)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(np.asarray(b)[0, first], np.asarray(a)[0, first])


@pytest.mark.parametrize("x_shape,widths,width,message", [
    ((2, 64), (64,), 4, r"x must be \[B, T, C\]"),
    ((2, 64, 256), (128, 64), 4, "must add up to C = 256"),
    ((2, 64, 160), (128, 32), 4, "multiple of 64"),
    ((2, 48, 256), (128, 128), 4, "T must be a multiple of 32"),
])
def test_refuses_what_it_cannot_tile_and_says_so(x_shape, widths, width, message):
    assert short_conv.refusal(x_shape, widths, width) is not None
    x = jnp.zeros(x_shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        short_conv.conv_silu_forward(x, jnp.zeros((width, x_shape[-1])), None, widths,
                                     interpret=True)


def test_kernels_lower_to_triton_for_cuda_at_the_1b_shape():
    """The `1b` preset's KDA layer: 4 x 4096 tokens, q, k and v of 16 heads of 128; the
    two-pass backward is two kernels, the recomputing one one."""
    x = jax.ShapeDtypeStruct((4, 4096, 6144), jnp.bfloat16)
    weight = jax.ShapeDtypeStruct((4, 6144), jnp.float32)
    document = jax.ShapeDtypeStruct((4, 4096), jnp.int32)
    grads = tuple(jax.ShapeDtypeStruct((4, 4096, 2048), jnp.bfloat16) for _ in range(3))
    widths = (2048, 2048, 2048)
    with jax.sharding.use_abstract_mesh(A100):
        forward = jax.jit(lambda x, w, d: short_conv.conv_silu_forward(x, w, d, widths))
        cases = [(forward, (x, weight, document), 1)]
        for scheme, kernels in (("two_pass", 2), ("recompute", 1)):
            options = short_conv.KernelOptions(backward=scheme)
            backward = jax.jit(lambda x, w, d, *g, options=options:
                               short_conv.conv_silu_backward(x, w, d, g, options=options))
            cases.append((backward, (x, weight, document, *grads), kernels))
        for fn, args, kernels in cases:
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == kernels


@pytest.mark.slow
def test_layer_path_takes_the_kernels_and_their_gradients(monkeypatch):
    """`conv_silu_parts` with the kernels chosen (as on a GPU, interpreted here) gives the
    kernels' parts, and `jax.grad` through it the kernels' dx and weight gradient."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for name in ("conv_silu_forward", "conv_silu_backward"):
        monkeypatch.setattr(short_conv, name,
                            functools.partial(getattr(short_conv, name), interpret=True))
    x, weight, segment_ids, grads = _problem(2, 64)
    assert kda_layer.short_conv_kernel_runs(x.shape, WIDTHS, 4)
    parts, (dx, d_weight) = _vjp(
        lambda x, w: kda_layer.conv_silu_parts(x, w, segment_ids, WIDTHS), x, weight, grads)
    document = document_index(segment_ids)
    expected = short_conv.conv_silu_forward(x, weight, document, WIDTHS)
    expected_dx, expected_dw = short_conv.conv_silu_backward(x, weight, document, grads)
    for ours, theirs in zip((*parts, dx, d_weight), (*expected, expected_dx, expected_dw)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_kernels_only_on_a_gpu_for_tileable_shapes_and_whole_arrays(monkeypatch):
    assert not kda_layer.short_conv_kernel_runs((2, 64, 512), WIDTHS, 4)  # a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert kda_layer.short_conv_kernel_runs((2, 64, 512), WIDTHS, 4)
    assert not kda_layer.short_conv_kernel_runs((2, 60, 512), WIDTHS, 4)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):  # jit would gather the sharded operands whole onto each device
        assert not kda_layer.short_conv_kernel_runs((2, 64, 512), WIDTHS, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("backward", short_conv.BACKWARDS)
def test_gpu_kernels_at_the_1b_shape_are_at_least_as_accurate_as_xla(monkeypatch, backward):
    monkeypatch.setattr(short_conv, "OPTIONS", short_conv.KernelOptions(backward=backward))
    widths = (2048, 2048, 2048)
    x, weight, segment_ids, grads = _problem(4, 4096, widths=widths)

    def run(parts_fn):
        return jax.jit(lambda x, w, s, g: _vjp(lambda x, w: parts_fn(x, w, s), x, w, g))

    kernels = run(lambda x, w, s: kda_layer.conv_silu_parts(x, w, s, widths))
    assert "triton" in kernels.lower(x, weight, segment_ids, grads).as_text()
    parts, (dx, d_weight) = kernels(x, weight, segment_ids, grads)
    exact, (exact_dx, exact_dw) = run(functools.partial(
        _xla_parts, dtype=jnp.float32, widths=widths))(x, weight, segment_ids, grads)
    xla, (xla_dx, _) = run(functools.partial(
        _xla_parts, dtype=jnp.bfloat16, widths=widths))(x, weight, segment_ids, grads)
    assert _max_error(parts, exact) <= _max_error(xla, exact)
    assert _max_error([dx], [exact_dx]) <= _max_error([xla_dx], [exact_dx])
    assert _max_error([d_weight], [exact_dw]) <= 1e-4 * float(np.max(np.abs(exact_dw)))


def test_kernel_options_print_as_blocks_and_refuse_unknown_backwards():
    """`TOKENSxCHANNELS/WARPSw`, and the backward scheme unless it is the default two-pass one
    (the form `experiments.bench_short_conv --tiles` parses)."""
    assert str(short_conv.OPTIONS) == "32x64/4w"
    assert str(short_conv.KernelOptions(backward="recompute")) == "32x64/4w/recompute"
    with pytest.raises(ValueError, match="backward must be one of"):
        short_conv.KernelOptions(backward="fast")
