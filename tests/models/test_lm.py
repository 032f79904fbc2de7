"""The hybrid decoder: interface, parameter counts, causality, packing, decode == prefill, scan,
named scopes of its parts.

XLA compiles are the cost of these tests on a CPU, so the jitted functions live at module level
(one compile per model structure and shape) and the composition tests run KDA through its
recurrent oracle (`impl="reference"`, compiles in a fraction of the chunked op's time; `kda`'s own
tests check chunked == reference). The interface and causality tests use the default path.
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import profiling
from kda.layer import KDAConfig
from models.attention import MLAConfig
from models.config import count_params, preset
from models.lm import (KERNEL_PRIMITIVES, PROFILE_SCOPES, REMAT, HybridLM, _called_jaxprs, aux_loss,
                       layer_plan, lm_head_logits)
from models.paged_cache import PageAllocator, pages_needed
from moe.config import MoEConfig
from moe.experts import StableLatentMoE, update_router_biases
from moe.routing import updated_bias
from experiments.harness import relative_error
from train.step import FAST_COMPILE_OPTIONS

VOCAB = 264
# Five layers: a dense KDA layer, then [KDA, MLA] twice, a scannable run of two groups.
FIVE = dict(num_layers=5, kda_layers=(1, 2, 4), full_attn_layers=(3, 5))
# Two layers, every layer kind: KDA with the dense FFN, then Gated MLA with the MoE.
TWO = dict(num_layers=2, kda_layers=(1,), full_attn_layers=(2,))


def reference_kda_config(**overrides):
    cfg = preset("tiny", **overrides)
    return dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, impl="reference"))


@jax.jit
def forward(model, tokens, segment_ids=None):
    return model(tokens, segment_ids)


@jax.jit
def forward_with_stats(model, tokens):
    return model.forward(tokens)


@jax.jit
def extend(model, tokens, state):
    return model.extend(tokens, state)


def loss_fn(model, tokens):
    logits, stats = model.forward(tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]) + aux_loss(stats)


value_and_grad = jax.jit(nnx.value_and_grad(loss_fn))


def random_tokens(seed, shape):
    return jax.random.randint(jax.random.key(seed), shape, 0, VOCAB, jnp.int32)


def param_count(model_or_abstract) -> int:
    return sum(p.size for p in jax.tree.leaves(nnx.state(model_or_abstract, nnx.Param)))


@pytest.fixture(scope="module")
def two_layers():
    """KDA with a dense FFN, then Gated MLA with the MoE, on the default path (KDA's chunked op)."""
    return HybridLM(preset("tiny", **TWO), rngs=nnx.Rngs(0))


@jax.jit
def logits_and_hidden(model, tokens):
    """The logits and router stats of `model.forward`, those of `forward(return_hidden=True)`
    and the LM head of its hidden states: one program for the interface, causality and
    return_hidden tests."""
    (logits, stats), (hidden, hidden_stats) = (model.forward(tokens),
                                               model.forward(tokens, return_hidden=True))
    return logits, stats, hidden, hidden_stats, model.lm_head(hidden)


@pytest.mark.slow
def test_interface_and_causality(two_layers):
    tokens = random_tokens(1, (2, 12))
    logits = logits_and_hidden(two_layers, tokens)[0]
    assert logits.shape == (2, 12, VOCAB) and logits.dtype == jnp.float32
    changed = tokens.at[:, 7:].set(random_tokens(2, (2, 5)))
    changed_logits = logits_and_hidden(two_layers, changed)[0]
    # Changing a future token never changes an earlier logit, not even by rounding.
    np.testing.assert_array_equal(logits[:, :7], changed_logits[:, :7])
    assert not np.allclose(logits[:, 7:], changed_logits[:, 7:])


@pytest.mark.slow
def test_return_hidden_gives_the_lm_head_input(two_layers):
    """forward(return_hidden=True) returns what the LM head multiplies: the head of it is the
    logits, bit for bit (the input of `train.step.chunked_lm_head_nll`)."""
    logits, stats, hidden, hidden_stats, head_of_hidden = logits_and_hidden(
        two_layers, random_tokens(1, (2, 12)))
    assert hidden.shape == (2, 12, two_layers.cfg.d_model)
    assert hidden.dtype == two_layers.cfg.compute_dtype
    np.testing.assert_array_equal(head_of_hidden, logits)
    for got, want in zip(jax.tree.leaves(hidden_stats), jax.tree.leaves(stats)):
        np.testing.assert_array_equal(got, want)


def test_mixed_precision_dtypes():
    model = nnx.eval_shape(lambda: HybridLM(preset("tiny", dtype="bfloat16"), rngs=nnx.Rngs(0)))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    logits = jax.eval_shape(lambda m, t: m(t), model, jax.ShapeDtypeStruct((1, 4), jnp.int32))
    assert logits.dtype == jnp.float32


COUNT_VARIANTS = {
    "tiny": preset("tiny"),
    "tiny_scanned_plain": preset("tiny", scan_layers=True, residual="plain", **FIVE),
    "tiny_full_attn_res": preset("tiny", residual="full_attn_res"),
    "tiny_kimi_linear_style": preset(
        "tiny",
        kda=KDAConfig(num_heads=2, head_dim=32, gate="softplus"),
        mla=MLAConfig(2, None, 32, 16, 8, 16, output_gate=False),
        moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, shared_hidden=32,
                      activation="swiglu"),
        first_k_dense=0,
    ),
    "small": preset("small"),
    "1b": preset("1b"),
    "kimi_linear_48b": preset("kimi_linear_48b", scan_layers=True),
    "k3": preset("k3", scan_layers=True),
}


@pytest.mark.parametrize("name", sorted(COUNT_VARIANTS))
def test_analytic_count_equals_eval_shape(name):
    cfg = COUNT_VARIANTS[name]
    abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    counts = count_params(cfg)
    assert param_count(abstract) == counts["total"] + counts["embedding"] + counts["vision"]


def test_scan_plan_of_k3():
    plan = layer_plan(preset("k3", scan_layers=True))
    # Layer 0 (dense FFN) alone, [KDA, KDA, MLA, KDA] x 22, then layers 89..92 one by one.
    assert [(p.first, p.size, p.repeats) for p in plan] == (
        [(0, 1, 1), (1, 4, 22)] + [(i, 1, 1) for i in range(89, 93)]
    )


@pytest.fixture(scope="module")
def two_layers_reference():
    """The two-layer model, KDA through its recurrent oracle, nothing rematerialised."""
    return HybridLM(reference_kda_config(**TWO), rngs=nnx.Rngs(6))


@pytest.mark.slow
def test_packed_documents_equal_separate_runs(two_layers_reference):
    model = two_layers_reference
    lengths = (5, 4, 3)
    packed_row = random_tokens(3, (1, sum(lengths)))
    segments = jnp.repeat(jnp.arange(1, 4), jnp.array(lengths), total_repeat_length=12)
    # Row 0 is the packed row; rows 1..3 each hold one document alone (padded at the end, which
    # a causal model never looks at).
    starts = np.cumsum((0,) + lengths[:-1])
    rows = [packed_row[0]] + [
        jnp.pad(packed_row[0, s : s + n], (0, 12 - n)) for s, n in zip(starts, lengths)
    ]
    segment_ids = jnp.stack([segments] + [jnp.ones(12, jnp.int32)] * 3)
    logits = forward(model, jnp.stack(rows), segment_ids)
    for row, (start, length) in enumerate(zip(starts, lengths), start=1):
        np.testing.assert_allclose(
            logits[0, start : start + length], logits[row, :length], rtol=1e-5, atol=1e-5
        )


def decode_logits(model, tokens, page_size=2):
    """Logits of tokens [B, T] decoded one token per `extend` call (one compiled program)."""
    batch, length = tokens.shape
    max_pages = -(-length // page_size)
    allocator = PageAllocator(pages_needed(batch, length, page_size), page_size, batch, max_pages)
    state = model.init_decode_state(batch, num_pages=allocator.num_pages, page_size=page_size,
                                    max_pages_per_seq=max_pages)
    pieces, start = [], 0
    for stop in range(1, length + 1):
        for row in range(batch):
            allocator.reserve(row, stop)
        state = dataclasses.replace(state, block_tables=jnp.asarray(allocator.block_tables))
        logits, state = extend(model, tokens[:, start:stop], state)
        pieces.append(logits)
        start = stop
    np.testing.assert_array_equal(state.lengths, [length] * batch)
    return jnp.concatenate(pieces, axis=1)


@pytest.mark.slow
def test_decode_equals_prefill_with_scanned_layers(scanned_without_dense):
    # Unscanned decoding is checked by test_generate (greedy == argmax of the forward), multi-token
    # chunks by test_prefill (chunked prefill == the forward): the layers' scan is the same for
    # any chunk length. The reference logits come from `forward_with_stats`, the program the
    # router bias test runs.
    model = scanned_without_dense
    tokens = random_tokens(5, (2, 8))
    np.testing.assert_allclose(
        decode_logits(model, tokens), forward_with_stats(model, tokens)[0],
        rtol=2e-5, atol=2e-5,
    )


def restacked(plan, source: dict, target: dict) -> dict:
    """`target` (a scanned model's pure param dict) filled from an unscanned model's `source`."""
    target = dict(target, groups=dict(target["groups"]))
    for key in ("embed", "final_read", "final_norm", "lm_head"):
        target[key] = source[key]
    for index, group in enumerate(plan):
        if group.repeats == 1:
            target["groups"][index] = source["groups"][group.first]
            continue
        layers = {}
        for offset in range(group.size):
            copies = [source["groups"][group.first + r * group.size + offset]["layers"][0]
                      for r in range(group.repeats)]
            layers[offset] = jax.tree.map(lambda *xs: jnp.stack(xs), *copies)
        target["groups"][index] = {"layers": layers}
    return target


REMAT_TOKENS = random_tokens(10, (2, 8))


@pytest.fixture(scope="module")
def five_layers():
    """The five-layer model, nothing scanned or rematerialised."""
    return HybridLM(reference_kda_config(**FIVE), rngs=nnx.Rngs(6))


@pytest.fixture(scope="module")
def scanned_gradient(five_layers):
    """(the scanned, fully rematerialised five-layer model holding `five_layers`' weights, its
    gradient program compiled as `train.step` compiles it, that program's (loss, grads) at
    REMAT_TOKENS). One compile serves the equality test and the profiling scopes test."""
    scanned = HybridLM(reference_kda_config(scan_layers=True, remat="full", **FIVE),
                       rngs=nnx.Rngs(7))
    assert [(p.size, p.repeats) for p in scanned.plan] == [(1, 1), (2, 2)]
    state = nnx.state(scanned, nnx.Param)
    nnx.replace_by_pure_dict(state, restacked(scanned.plan, nnx.to_pure_dict(
        nnx.state(five_layers, nnx.Param)), nnx.to_pure_dict(state)))
    nnx.update(scanned, state)
    compiled = value_and_grad.lower(scanned, REMAT_TOKENS).compile(FAST_COMPILE_OPTIONS)
    return scanned, compiled, compiled(scanned, REMAT_TOKENS)


@pytest.mark.slow
def test_scanned_rematted_equals_unscanned_forward_and_gradients(five_layers, scanned_gradient):
    scanned, _, (loss_scanned, grads_scanned) = scanned_gradient
    loss_plain, grads_plain = value_and_grad(five_layers, REMAT_TOKENS)
    np.testing.assert_allclose(loss_scanned, loss_plain, rtol=1e-6)
    expected = restacked(scanned.plan, nnx.to_pure_dict(grads_plain),
                         nnx.to_pure_dict(grads_scanned))
    assert_grads_close(nnx.to_pure_dict(grads_scanned), expected)


def assert_grads_close(got, want):
    """float32 agreement up to summation order (relative to each tensor's largest entry), except
    the MoE router weight: `moe.routing.router_scores` computes its logits from bf16 pieces, so
    that gradient is only bf16-accurate (one ulp is 2^-8)."""
    want_leaves = jax.tree.leaves(want)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], want_leaves):
        name = jax.tree_util.keystr(path)
        rtol = 2**-7 if name.endswith("['router']") else 1e-4
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-4 * np.abs(w).max(), err_msg=name)


@pytest.fixture(scope="module")
def gradients_without_remat(two_layers_reference):
    """The two-layer model's gradients at REMAT_TOKENS, nothing recomputed."""
    return nnx.to_pure_dict(value_and_grad(two_layers_reference, REMAT_TOKENS)[1])


@pytest.mark.slow
def test_dots_remat_keeps_gradients(gradients_without_remat):
    rematted = HybridLM(reference_kda_config(remat="dots", **TWO), rngs=nnx.Rngs(6))
    _, got = value_and_grad(rematted, REMAT_TOKENS)
    assert_grads_close(nnx.to_pure_dict(got), gradients_without_remat)


def _host_offloads(jaxpr) -> list:
    """The avals that `jaxpr` (nested jaxprs included) moves to pinned host memory."""
    return [var.aval for eqn in _equations(jaxpr) if eqn.primitive.name == "device_put"
            for var in eqn.outvars if var.aval.memory_space == jax.memory.Space.Host]


@pytest.mark.slow
def test_offload_remat_keeps_gradients_and_sends_each_layer_input_to_host(
        gradients_without_remat):
    offload = HybridLM(reference_kda_config(remat="offload", **TWO), rngs=nnx.Rngs(6))
    _, got = value_and_grad(offload, REMAT_TOKENS)
    assert_grads_close(nnx.to_pure_dict(got), gradients_without_remat)
    # The backward pass finds each layer's [B, T, D] input in host memory, nothing else.
    moved = _host_offloads(jax.make_jaxpr(nnx.grad(loss_fn))(offload, REMAT_TOKENS).jaxpr)
    assert [aval.shape for aval in moved] == [(2, 8, offload.cfg.d_model)] * TWO["num_layers"]


@pytest.fixture(scope="module")
def scanned_without_dense():
    """No dense layer: layer 0 is a lone MoE layer, layers 1..4 two stacked [KDA, MLA] groups."""
    return HybridLM(reference_kda_config(scan_layers=True, first_k_dense=0, **FIVE),
                    rngs=nnx.Rngs(12))


@pytest.mark.slow
def test_router_bias_update_reaches_every_moe_layer(scanned_without_dense):
    model = scanned_without_dense
    _, stats = forward_with_stats(model, random_tokens(13, (2, 8)))
    sites = model.moe_sites()
    assert [stacked for _, stacked in sites] == [False, True, True] and len(stats) == 3
    before = [np.asarray(moe.router_bias[...]) for moe, _ in sites]
    expected = [  # each site on its own (a stacked one slice by slice)
        (jax.vmap(update) if stacked else update)(moe.router_bias[...], site_stats)
        for (moe, stacked), site_stats in zip(sites, stats)
        for update in [functools.partial(updated_bias, moe.cfg)]
    ]
    update_router_biases([moe for moe, _ in sites], stats)
    for (moe, stacked), old, want in zip(sites, before, expected):
        new = np.asarray(moe.router_bias[...])
        assert new.shape == old.shape == ((2,) if stacked else ()) + (8,)
        assert not np.allclose(new, old)  # QB moves the zero-initialised bias
        np.testing.assert_allclose(new, want, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="RouterStats"):
        update_router_biases([moe for moe, _ in sites], stats[:-1])


def test_bad_inputs_raise(two_layers):
    with pytest.raises(ValueError, match="tokens"):
        two_layers(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        two_layers(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 3), jnp.int32))


@pytest.mark.slow
def test_remat_checkpoints_each_scanned_layer_on_its_own():
    # One checkpoint over a whole scanned group made its backward rematerialise all the group's
    # layers at once (69.8 instead of 45.2 GiB of temporaries in experiments.bench_train's `1b`
    # step at 4 x 4096).
    checkpoint = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive
    model = HybridLM(reference_kda_config(scan_layers=True, remat="dots", **FIVE),
                     rngs=nnx.Rngs(14))
    assert [(p.size, p.repeats) for p in model.plan] == [(1, 1), (2, 2)]
    jaxpr = jax.make_jaxpr(lambda model, tokens: model(tokens))(model, random_tokens(15, (2, 8)))
    (scan,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    scanned_body = [eqn.primitive for eqn in scan.params["jaxpr"].eqns]
    assert [eqn.primitive for eqn in jaxpr.eqns].count(checkpoint) == 1  # the lone layer 0
    assert scanned_body.count(checkpoint) == 2  # the group's two layers, one checkpoint each


@pytest.mark.slow
def test_compiled_gradient_names_each_part_in_forward_and_backward_ops(scanned_gradient):
    # What experiments.profiling.scope_times reads: the scopes survive into the compiled HLO's
    # op_name metadata, in a lone layer (KDA, dense FFN) and in a scanned group (KDA, MLA, MoE),
    # all rematerialised; backward op_names read "transpose(jvp(kda))/..." or, under the
    # checkpoint and in scanned bodies, "transpose(jvp())/while/body/eval_jaxpr/checkpoint/kda/...".
    _, compiled, _ = scanned_gradient
    found = collections.defaultdict(set)
    for op in profiling.hlo_instructions(compiled.as_text()).values():
        scope = profiling.scope_of(op.op_name, PROFILE_SCOPES)
        direction = "backward" if "transpose(" in op.op_name else "forward"
        found[scope].add(direction + (" scanned" if "/while/body/" in op.op_name else ""))
    lone, scanned = {"forward", "backward"}, {"forward scanned", "backward scanned"}
    expected = dict(embed=lone, attention=scanned, dense_ffn=lone, kda=lone | scanned,
                    moe=scanned, attn_res=lone | scanned, lm_head=lone)
    for scope, directions in expected.items():
        assert directions <= found[scope], (scope, found[scope])


def _plain_logits(x, kernel):
    return jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)


def _logits_grads(logits_fn, x, kernel, targets):
    def loss(x, kernel):
        logits = logits_fn(x, kernel)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    return jax.grad(loss, argnums=(0, 1))(x, kernel)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-6)])
def test_lm_head_logits_match_autodiff(dtype, tolerance):
    """Forward exactly the plain product; gradients within the precision of the compute dtype
    (in bf16 the backward rounds d logits, where autodiff multiplies it in float32)."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (2, 8, 64)).astype(dtype)
    kernel = 0.1 * jax.random.normal(keys[1], (64, 300))
    targets = jax.random.randint(keys[2], (2, 8), 0, 300)
    np.testing.assert_array_equal(lm_head_logits(x, kernel), _plain_logits(x, kernel))
    got = _logits_grads(lm_head_logits, x, kernel, targets)
    want = _logits_grads(_plain_logits, x, kernel, targets)
    for name, g, w in zip(("x", "kernel"), got, want):
        assert g.dtype == w.dtype, name
        assert relative_error(g, w) <= tolerance, name


def test_lm_head_backward_multiplies_in_the_compute_dtype():
    """Both backward products take bf16 operands (autodiff's would take the float32 d logits)."""
    x = jnp.ones((4, 16), jnp.bfloat16)
    kernel = jnp.ones((16, 32), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, k: _logits_grads(lm_head_logits, x, k, jnp.zeros(4, int)))(
        x, kernel)
    dots = []

    def collect(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append([v.aval.dtype for v in eqn.invars])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                collect(sub)

    collect(jaxpr.jaxpr)
    assert len(dots) == 3  # the forward's product and the backward's two
    assert all(dtypes == [jnp.bfloat16, jnp.bfloat16] for dtypes in dots), dots


def _equations(jaxpr):
    """Every equation of `jaxpr`, nested jaxprs' included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in _called_jaxprs(eqn.params):
            yield from _equations(inner)


def _primitive_counts(jaxpr) -> collections.Counter:
    """Equations per primitive name in `jaxpr`, nested jaxprs included."""
    return collections.Counter(eqn.primitive.name for eqn in _equations(jaxpr))


def _kernel_launches(jaxpr) -> int:
    """Kernel launches (`KERNEL_PRIMITIVES` equations) in `jaxpr`, nested jaxprs included."""
    counts = _primitive_counts(jaxpr)
    return sum(counts[name] for name in KERNEL_PRIMITIVES)


def _launches_under_each_policy(loss, *args) -> dict:
    """Kernel launches of `loss`'s forward alone and of its gradient under `dots` and
    `dots_kernels` checkpoints (traced only: GPU kernels trace on any backend)."""
    grads = lambda policy: jax.make_jaxpr(jax.grad(  # noqa: E731
        jax.checkpoint(loss, policy=REMAT[policy]), argnums=tuple(range(len(args)))))(*args)
    return dict(forward=_kernel_launches(jax.make_jaxpr(loss)(*args).jaxpr),
                **{policy: _kernel_launches(grads(policy).jaxpr)
                   for policy in ("dots", "dots_kernels")})


def test_dots_kernels_remat_runs_each_kernel_forward_once():
    # KDA by its Mosaic GPU kernels under a layer's checkpoint. `dots` cannot see into the
    # kernels' custom VJPs, so its backward pass launches every forward kernel again to rebuild
    # their residuals; keeping the kernels' outputs does not.
    from kda.kernels.mosaic_gpu.op import mosaic_gpu_kda

    def loss(q, g):
        o, _ = mosaic_gpu_kda(q, q, q, g, jnp.full(q.shape[:3], 0.5), scale=0.125,
                              use_qk_l2norm=True, gate_lower_bound=-5.0)
        return jnp.sum(o.astype(jnp.float32))

    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    launches = _launches_under_each_policy(loss, q, jnp.full(q.shape, -1.0))
    assert launches["forward"] >= 2  # the preparation and the recurrence
    assert launches["dots"] == launches["dots_kernels"] + launches["forward"]


def test_dots_kernels_remat_keeps_a_kernel_called_through_a_custom_vjp():
    # The MoE's grouped GEMM is a custom VJP whose forward rule calls the custom-VJP function
    # itself: the policy sees one `custom_vjp_call`, and keeping the kernels' outputs must reach
    # inside it (the first H200 run of `dots_kernels` still ran the MoE's GEMMs twice).
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def double_kernel(x):
        def body(x_ref, out_ref):
            out_ref[...] = x_ref[...] * 2

        return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    @jax.custom_vjp
    def doubled(x):
        return double_kernel(x)

    doubled.defvjp(lambda x: (doubled(x), None), lambda _, cotangent: (2 * cotangent,))
    launches = _launches_under_each_policy(lambda x: jnp.sum(jnp.tanh(doubled(x))),
                                           jnp.ones((128, 128)))
    assert launches == dict(forward=1, dots=2, dots_kernels=1)


def test_dots_kernels_remat_keeps_the_expert_weights_in_the_compute_dtype():
    # Named by the MoE (`moe.experts.EXPERT_WEIGHTS_NAME`) and kept: the backward pass casts no
    # float32 expert weight to bfloat16 again.
    cfg = preset("tiny")
    layer = StableLatentMoE(cfg.d_model, cfg.moe, dtype=jnp.bfloat16, rngs=nnx.Rngs(16))
    weight_shapes = {layer.expert_w_in[...].shape, layer.expert_w_out[...].shape}
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.key(17), (1, 32, cfg.d_model))

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0].astype(jnp.float32))

    def weight_casts(policy):
        rematted = loss if policy is None else jax.checkpoint(loss, policy=REMAT[policy])
        jaxpr = jax.make_jaxpr(jax.grad(rematted, argnums=1))(state, x).jaxpr
        return sum(eqn.primitive.name == "convert_element_type"
                   and eqn.params["new_dtype"] == jnp.bfloat16
                   and eqn.invars[0].aval.shape in weight_shapes for eqn in _equations(jaxpr))

    assert weight_casts(None) == weight_casts("dots_kernels") == 2
    assert weight_casts("dots") == 4


def test_dots_kernels_remat_keeps_the_moe_routing_and_permutation():
    # The top-k, the sort into expert order and its inverse: named by the MoE
    # (`moe.routing.PERMUTATION_NAME`) and kept, so the backward pass runs none of them again.
    cfg = preset("tiny")
    graphdef, state = nnx.split(StableLatentMoE(cfg.d_model, cfg.moe, rngs=nnx.Rngs(16)))
    x = jax.random.normal(jax.random.key(17), (1, 32, cfg.d_model))

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0].astype(jnp.float32))

    def counts(policy):
        rematted = loss if policy is None else jax.checkpoint(loss, policy=REMAT[policy])
        return _primitive_counts(jax.make_jaxpr(jax.grad(rematted, argnums=1))(state, x).jaxpr)

    unrematted = counts(None)
    for name in ("top_k", "sort", "scatter"):
        assert unrematted[name] >= 1, name
        assert counts("dots_kernels")[name] == unrematted[name], name
        assert counts("dots")[name] > unrematted[name], name


def _moe_loss(token_chunk, policy=None):
    """(loss(state, x) = sum(y * cotangent) of the tiny preset's MoE layer, whole or in chunks
    of `token_chunk` positions, under a checkpoint with REMAT[policy]; its state)."""
    cfg = preset("tiny")
    layer = StableLatentMoE(cfg.d_model, dataclasses.replace(cfg.moe, token_chunk=token_chunk),
                            dtype=jnp.float32, rngs=nnx.Rngs(16))
    graphdef, state = nnx.split(layer)
    segment_ids = jnp.array([[1] * 9 + [0] * 3, [1] * 12])
    cotangent = jax.random.normal(jax.random.key(18), (2, 12, cfg.d_model))

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, segment_ids)[0] * cotangent)

    return (loss if policy is None else jax.checkpoint(loss, policy=REMAT[policy])), state


MOE_X = jax.random.normal(jax.random.key(17), (2, 12, preset("tiny").d_model))


@pytest.fixture(scope="module")
def whole_moe_gradients():
    loss, state = _moe_loss(None)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(state, MOE_X)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots_kernels"])
def test_moe_token_chunks_under_remat_give_the_whole_layers_gradients(whole_moe_gradients,
                                                                      policy):
    loss, state = _moe_loss(5, policy)  # 12 positions: chunks of 5, 5 and 2 (+ 3 padding)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, MOE_X)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads),
                                 jax.tree.leaves(whole_moe_gradients), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


def test_dots_kernels_remat_keeps_the_moe_routing_and_loops_over_the_token_chunks():
    # With `MoEConfig.token_chunk` the routing's top-k runs on all tokens, outside the chunks:
    # dots_kernels keeps it, full runs it again. The dispatch's sort and scatter run in each
    # chunk (`core.chunks.map_chunks`), whose forward and backward are loops holding the chunk's
    # work twice each (chunk 0, then the loop's body), whatever the policy and the number of
    # chunks (3 of 5 positions, 4 of 3).
    def counts(token_chunk, policy):
        loss, state = _moe_loss(token_chunk, policy)
        return _primitive_counts(jax.make_jaxpr(jax.grad(loss, argnums=1))(state, MOE_X).jaxpr)

    whole, kept, full = counts(None, None), counts(5, "dots_kernels"), counts(5, "full")
    assert whole["top_k"] >= 1 and kept["top_k"] == whole["top_k"] < full["top_k"]
    more_chunks = counts(3, "full")
    for name in ("sort", "scatter"):
        assert whole[name] >= 1, name
        assert kept[name] == full[name] == more_chunks[name] == 2 * 2 * whole[name], name
