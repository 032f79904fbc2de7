"""`moe.kernels.triton.glu`: the Pallas GLU kernels (interpret mode on CPU, Triton lowering for
CUDA, and on GPU through fused_glu) equal the XLA activation and its gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from moe.kernels.triton import glu as glu_kernel
from moe.activations import GLUActivation, fused_glu

A100 = AbstractMesh((), (), abstract_device=AbstractDevice(
    device_kind="NVIDIA A100-SXM4-80GB", platform="gpu", num_cores=108))


def _problem(shape, seed=0):
    """bf16 gate_up [..., 2, M] spanning both soft caps, and a bf16 cotangent [..., M]."""
    gate_up = (12 * jax.random.normal(jax.random.key(seed), shape)).astype(jnp.bfloat16)
    cotangent = jax.random.normal(jax.random.key(seed + 1), shape[:-2] + shape[-1:], jnp.bfloat16)
    return gate_up, cotangent


def _xla(act, gate_up, cotangent):
    def plain(a):
        return act(a[..., 0, :], a[..., 1, :]).astype(a.dtype)
    out, pullback = jax.vjp(plain, gate_up)
    return out, pullback(cotangent)[0]


def _assert_close(ours, ref):
    """Both paths compute in float32 and round once to bf16: at most one bf16 ulp apart."""
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(ours, ref, rtol=2**-7, atol=1e-6)


# Both sides compiled at XLA's default optimisation level, whatever the suite's (conftest). At
# level 0 the interpreted kernel's float32 tanh moves in its last bits (the XLA path's does not),
# and where the SiTU gate saturates (g > ~24 here) the derivative 1 - tanh^2 keeps only those
# bits, so its tiny gradients (~1e-5) moved by several bf16 ulps. Compiled alike, both compute
# the same float32 values.
compiled_alike = functools.partial(jax.jit, static_argnums=0,
                                   compiler_options={"xla_backend_optimization_level": 3})


@pytest.mark.parametrize("kind", ["situ", "swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("shape", [(16, 2, 128), (2, 8, 2, 384)])
def test_kernels_equal_xla_in_interpret_mode(kind, shape):
    act = GLUActivation(kind)
    gate_up, cotangent = _problem(shape)
    out = compiled_alike(functools.partial(glu_kernel.glu_forward, interpret=True))(act, gate_up)
    grad = compiled_alike(functools.partial(glu_kernel.glu_backward, interpret=True))(
        act, gate_up, cotangent)
    ref_out, ref_grad = compiled_alike(_xla)(act, gate_up, cotangent)
    assert out.shape == ref_out.shape and grad.shape == gate_up.shape
    _assert_close(out, ref_out)
    _assert_close(grad, ref_grad)


def test_blocks_tile_widths_that_are_not_powers_of_two():
    assert glu_kernel.block_columns(1024) == 1024
    assert glu_kernel.block_columns(4864) == 256  # 19 x 256: the dense FFN of bench_moe
    assert glu_kernel.block_columns(8192) == 1024


@pytest.mark.parametrize("shape, supported", [
    ((16, 2, 128), True), ((12, 2, 128), False), ((16, 2, 96), False), ((16, 256), False)])
def test_supports_and_refuses_clearly(shape, supported):
    gate_up = jnp.zeros(shape, jnp.bfloat16)
    assert glu_kernel.supports(gate_up) == supported
    if not supported:
        with pytest.raises(ValueError, match=r"gate_up must be \[\.\.\., 2, M\]"):
            glu_kernel.glu_forward(GLUActivation(), gate_up, interpret=True)


def test_kernels_lower_to_triton_for_cuda():
    act = GLUActivation()
    gate_up = jax.ShapeDtypeStruct((131072, 2, 1024), jnp.bfloat16)
    cotangent = jax.ShapeDtypeStruct((131072, 1024), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(A100):
        for fn, args in ((functools.partial(glu_kernel.glu_forward, act), (gate_up,)),
                         (functools.partial(glu_kernel.glu_backward, act), (gate_up, cotangent))):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("xla.gpu.triton") == 1


def _situ_float64(gate_up, cotangent):
    """SiTU-GLU (betas 4, 25) and its gate_up cotangent in float64 numpy: the exact answer."""
    gate_up = np.asarray(gate_up, np.float64)
    gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
    cotangent = np.asarray(cotangent, np.float64)
    t, sigmoid, cap = np.tanh(gate / 4), 1 / (1 + np.exp(-gate)), np.tanh(up / 25)
    gate_branch, up_branch = 4 * t * sigmoid, 25 * cap
    gate_slope = (1 - t * t) * sigmoid + 4 * t * sigmoid * (1 - sigmoid)
    grad = np.stack([cotangent * up_branch * gate_slope,
                     cotangent * gate_branch * (1 - cap * cap)], axis=-2)
    return gate_branch * up_branch, grad


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 2, 1024), (2048, 2, 4864)])
def test_gpu_fused_glu_runs_the_kernels_as_accurately_as_xla(shape):
    """On the GPU the kernels' tanh and exp (libdevice) are not XLA's, so the two differ in
    float32 rounding; where a gradient cancels (|gate| large, 1 - tanh^2 near 0) that shows as
    up to ~3e-5 apart on values of ~1e-4. So both are compared with the exact float64 answer:
    the kernels must be no less accurate than XLA, in the worst element and in L2."""
    act = GLUActivation()
    gate_up, cotangent = _problem(shape)
    step = jax.jit(lambda a, c: jax.vjp(functools.partial(fused_glu, act), a)[1](c)[0])
    assert "triton" in step.lower(gate_up, cotangent).as_text()
    ours, pullback = jax.vjp(functools.partial(fused_glu, act), gate_up)
    xla = _xla(act, gate_up, cotangent)
    exact = _situ_float64(gate_up, cotangent)
    for ours_x, xla_x, exact_x in zip((ours, pullback(cotangent)[0]), xla, exact):
        ours_error = np.asarray(ours_x, np.float64) - exact_x
        xla_error = np.asarray(xla_x, np.float64) - exact_x
        assert np.abs(ours_error).max() <= 1.01 * np.abs(xla_error).max()
        assert np.linalg.norm(ours_error) <= 1.01 * np.linalg.norm(xla_error)


def test_kernels_only_where_arrays_are_whole_on_each_device(monkeypatch):
    from moe import activations  # noqa: PLC0415 (the dispatch rule is private)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gate_up = jnp.zeros((16, 2, 128), jnp.bfloat16)
    assert activations.glu_kernel_runs(gate_up)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        assert not activations.glu_kernel_runs(gate_up)  # jit would gather sharded operands
        seen = []
        jax.shard_map(lambda x: (seen.append(activations.glu_kernel_runs(x)), x)[1],
                      in_specs=jax.P("data"), out_specs=jax.P("data"))(gate_up)
        assert seen == [True]  # inside shard_map the arrays are local
