"""The jitted training and evaluation steps, in the functional style.

    train_state = TrainState(model, make_optimizer(...))
    graphdef, state = nnx.split(train_state)          # once
    train_step = make_train_step(graphdef)
    state, metrics = train_step(state, batch)          # state is donated: use the returned one

`train_step` merges the state inside `jax.jit`, so Python module bookkeeping costs nothing per
step, and returns the new state (a plain `jax.jit` over modules would drop the optimizer's
in-place updates). One step:

1. forward and backward in the model's compute dtype against float32 master weights (the MoE
   expert weights read from their compute copies, `TrainState`); loss = mean next-byte
   cross-entropy over `loss_mask` plus the MoE auxiliary loss (zero under QB); with
   `loss_chunk_tokens`, the LM head and the cross-entropy run chunk by chunk under one custom
   VJP (`chunked_lm_head_nll`), so neither the [B, T, vocab] logits nor their gradient exist;
   with `token_loss`, another objective of the targets' per-token log-probs replaces the mean
   NLL (RL's policy loss, `train.rl.learner`);
2. the optimizer update (clipping inside the optax chain, with the gradient norm the finite
   check computed: `train.optim.clip_by_global_norm`), which also rewrites the compute copies;
3. the MoE router-bias update (Quantile Balancing) from the step's router statistics, outside the
   gradient; every replica computes the same bias from the same globally reduced statistics;
4. QK-Clip of the MLA heads when enabled (`train.qk_clip`);
5. steps 2-4 run under `lax.cond` on the loss and the gradient norm being finite; otherwise the
   state passes through unchanged and `skipped_steps` grows by one: a bad batch never touches
   the weights. (A `jnp.where(finite, new, old)` over the state would read the old optimizer
   moments after the in-place update has written the new ones, so XLA would copy every moment
   first; the cond keeps the update in place.) Gradients
   that a GPU kernel wrote in bfloat16 enter the cond in bfloat16 (`gradient_dtypes`);
6. an applied step then checks its new parameters and optimizer state (one read of each, on
   device, no host sync) and reports `nonfinite_state`. Finite gradients and a finite learning
   rate (`OptimConfig` refuses others) leave the state finite unless the update overflows
   float32; the in-place update cannot be undone, so the loop stops on the flag and never
   checkpoints that state (`train.loop`). Keeping the old state for a rollback would hold the
   parameters and moments twice.

Each of these parts runs under its named scope of `models.lm.PROFILE_SCOPES` (`loss`,
`finite_check`, `optimizer`, `router_bias`, `qk_clip`), so a profile can sum time per part.

The model is any `nnx.Module` with `forward(tokens, segment_ids) -> (logits, router_stats)` and
`moe_sites()` (as `models.lm.HybridLM`); `loss_chunk_tokens` also needs `forward(...,
return_hidden=True) -> (LM head input, router_stats)` and an `models.lm.LMHead` as `lm_head`
(its products then run under the `loss` scope).
A batch with images (`train.multimodal`: image_pixels, image_segment_ids, image_positions)
passes them as `forward(..., images=VisionBatch)`; a batch without them runs the text forward,
whose program holds nothing of the vision tower.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.extend import core as jax_core

from core.chunks import merge_chunks, split_chunks
from models.lm import (KERNEL_PRIMITIVES, LMHead, aux_loss, lm_head_backward, lm_head_logits,
                       profile_scope)
from moe.experts import StableLatentMoE, update_router_biases
from moe.routing import max_violation
from train import qk_clip
from train.multimodal import batch_images

Batch = dict[str, jax.Array]
# XLA:CPU options that cut compile time about in half (and slow the compiled step about 2x):
# for programs that run once or a few times (initialisation, tests, smoke runs).
FAST_COMPILE_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


class StepCount(nnx.Variable):
    """A training counter (not a parameter, not optimizer state)."""


class ComputeCopy(nnx.Variable):
    """A parameter rounded to its module's compute dtype (`TrainState.compute_copies`)."""


class TrainState(nnx.Module):
    """What the training step updates: the model (parameters and router biases), the optimizer
    state, the number of steps skipped for a non-finite loss or gradient, and `compute_copies`:
    the MoE expert weights rounded to the compute dtype, keyed by their path in the model
    (`state_path_key`).

    The grouped GEMM kernels read the expert weights in bf16, so the forward would cast them from
    float32 every step, a float32 read and a bf16 write of every expert weight
    (`benchmarks/train_h200.md`). The step's update writes the copies instead, from the new
    weights it already holds, and the forward reads them (`_read_compute_copy`).
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation):
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self.skipped_steps = StepCount(jnp.zeros((), jnp.int32))
        self.compute_copies = nnx.Dict({
            state_path_key(path): ComputeCopy(param[...].astype(dtype),
                                              out_sharding=param.get_metadata().get("out_sharding"),
                                              eager_sharding=False)
            for path, param, dtype in _kernel_weights(model)})

    def refresh_compute_copies(self) -> None:
        """Rewrites every compute copy from the model's current parameters."""
        for path, param, dtype in _kernel_weights(self.model):
            self.compute_copies[state_path_key(path)][...] = param[...].astype(dtype)


def _kernel_weights(model: nnx.Module):
    """(path in the model's state, parameter, compute dtype) of each MoE kernel weight stored
    wider than its module computes in."""
    for module_path, module in nnx.iter_modules(model):
        if not isinstance(module, StableLatentMoE):
            continue
        for name, param in module.kernel_weights().items():
            if jnp.dtype(param.dtype).itemsize > jnp.dtype(module.dtype).itemsize:
                yield (*module_path, name), param, jnp.dtype(module.dtype)


def state_path_key(path: tuple) -> str:
    """A key for the state path ("layers", 3, "ffn", "expert_w_in"): "layers.3.ffn.expert_w_in"."""
    return ".".join(str(part) for part in path)


@jax.custom_vjp
def _read_compute_copy(param: jax.Array, copy: jax.Array) -> jax.Array:
    """The compute copy of `param` (its value), with `param`'s gradient: the cotangent of the
    copy, in param's dtype (the gradient of a cast)."""
    return copy


def _read_compute_copy_forward(param, copy):
    return copy, jnp.zeros((0,), param.dtype)  # an empty array that carries param's dtype


def _read_compute_copy_backward(empty_of_param_dtype, d_copy):
    return d_copy.astype(empty_of_param_dtype.dtype), None


_read_compute_copy.defvjp(_read_compute_copy_forward, _read_compute_copy_backward)


def _through_compute_copies(params: nnx.State, copies: dict[str, jax.Array]) -> nnx.State:
    """params with each parameter that has a compute copy read through it (`_read_compute_copy`)."""
    def read(path, value):
        key = state_path_key(tuple(part.key for part in path
                                   if isinstance(part, jax.tree_util.DictKey)))
        return value if key not in copies else _read_compute_copy(value, copies[key])
    return jax.tree_util.tree_map_with_path(read, params)


def stacked_axes(model: nnx.Module) -> Callable[[tuple[str, ...]], int]:
    """For `train.optim`: the number of scan-stacked leading axes of the parameter at a path.

    HybridLM stacks the layers of a repeated group (`model.plan`, `models.lm.layer_plan`) on one
    leading axis; parameters of other models have none.
    """
    stacked_groups = {
        str(index) for index, plan in enumerate(getattr(model, "plan", ())) if plan.repeats > 1
    }
    return lambda path: int(len(path) > 1 and path[0] == "groups" and path[1] in stacked_groups)


def masked_sum(nll: jax.Array, loss_mask: jax.Array):
    """(sum of nll [B, T] over loss_mask [B, T], the mask's sum): two float32 scalars."""
    return jnp.sum(nll * loss_mask), jnp.sum(loss_mask)


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Softmax cross-entropy of logits [..., V] (float32) against integer targets [...]: [...].

    As `optax.softmax_cross_entropy_with_integer_labels`, with a backward that writes
    (softmax - one_hot(target)) * cotangent in one elementwise pass over the logits. Autodiff's
    backward scatters the target's term into the float32 [..., V] cotangent after writing it,
    which keeps XLA from fusing the LM head's cast to bf16 into that pass: one more float32
    write and read of the whole [tokens, V] cotangent (`benchmarks/train_h200.md`).
    """
    return _cross_entropy_forward(logits, targets)[0]


def _cross_entropy_forward(logits, targets):
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_normalizer - target_logit, (logits, targets, log_normalizer)


def _cross_entropy_backward(saved, d_nll):
    logits, targets, log_normalizer = saved
    vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    one_hot = (vocab == targets[..., None]).astype(logits.dtype)
    d_logits = (jnp.exp(logits - log_normalizer[..., None]) - one_hot) * d_nll[..., None]
    return d_logits, None


cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_lm_head_nll(hidden: jax.Array, kernel: jax.Array, targets: jax.Array,
                        chunk_tokens: int) -> jax.Array:
    """`cross_entropy(lm_head_logits(hidden, kernel), targets)` without the [B, T, V] logits.

    hidden: [B, T, D] (the LM head's input, in its compute dtype); kernel: [D, V]; targets:
    [B, T] int; chunk_tokens: positions per chunk along T (the last chunk padded). Returns the
    per-token NLL [B, T] float32.

    The forward maps over chunks of [B, chunk_tokens] tokens, computing each chunk's float32
    logits and keeping only their log-normalizer [B, T]; the backward recomputes each chunk's
    logits and runs the full path's arithmetic on it (`cross_entropy`'s backward, then
    `lm_head_backward`, which rounds d logits to hidden's dtype), summing d kernel over chunks in
    float32. The kernel is cast to hidden's dtype once, not per chunk. Memory: O(B *
    chunk_tokens * V) instead of O(B * T * V), for one more head product (the recomputed
    logits). With one chunk it is the full path bit for bit; with several, equal to float32
    rounding (XLA may round other shapes differently; d kernel is summed chunk by chunk).
    """
    return _chunked_lm_head_nll_forward(hidden, kernel, targets, chunk_tokens)[0]


def chunked_lm_head_eval(hidden: jax.Array, kernel: jax.Array, targets: jax.Array,
                         chunk_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Per-token NLL [B, T] float32 and argmax predictions [B, T] int32 of the LM head over
    hidden [B, T, D], chunk by chunk as `chunked_lm_head_nll` (for evaluation: no gradient)."""
    kernel = kernel.astype(hidden.dtype)

    def one_chunk(x, chunk_targets):
        logits = lm_head_logits(x, kernel)
        return cross_entropy(logits, chunk_targets), jnp.argmax(logits, -1).astype(jnp.int32)

    return _map_chunks(one_chunk, chunk_tokens, hidden, targets)


def check_chunk_tokens(chunk_tokens, name: str = "chunk_tokens") -> None:
    """Raises ValueError naming `name` unless chunk_tokens is a positive int."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"{name} must be a positive int, got {chunk_tokens!r}")


def _map_chunks(fn, chunk_tokens: int, *arrays: jax.Array):
    """fn(*chunks of arrays) -> outputs [B, chunk_tokens, ...], one chunk at a time (`lax.map`)
    over arrays [B, T, ...]; returns the outputs [B, T, ...]."""
    check_chunk_tokens(chunk_tokens)
    length = arrays[0].shape[1]
    chunks = [split_chunks(a, chunk_tokens) for a in arrays]
    outputs = jax.lax.map(lambda xs: fn(*xs), chunks)
    return jax.tree.map(lambda y: merge_chunks(y, length), outputs)


def _chunked_lm_head_nll_forward(hidden, kernel, targets, chunk_tokens):
    compute_kernel = kernel.astype(hidden.dtype)

    def one_chunk(x, chunk_targets):
        nll, (_, _, log_normalizer) = _cross_entropy_forward(lm_head_logits(x, compute_kernel),
                                                             chunk_targets)
        return nll, log_normalizer

    nll, log_normalizer = _map_chunks(one_chunk, chunk_tokens, hidden, targets)
    return nll, (hidden, kernel, targets, log_normalizer)


def _chunked_lm_head_nll_backward(chunk_tokens, saved, d_nll):
    hidden, kernel, targets, log_normalizer = saved
    compute_kernel = kernel.astype(hidden.dtype)

    def one_chunk(d_kernel, chunk):
        x, chunk_targets, chunk_log_normalizer, chunk_d_nll = chunk
        logits = lm_head_logits(x, compute_kernel)
        d_logits, _ = _cross_entropy_backward((logits, chunk_targets, chunk_log_normalizer),
                                              chunk_d_nll)
        d_x, d_chunk_kernel = lm_head_backward(x, compute_kernel, d_logits)
        return d_kernel + d_chunk_kernel, d_x

    chunks = [split_chunks(a, chunk_tokens) for a in (hidden, targets, log_normalizer, d_nll)]
    d_kernel, d_hidden = jax.lax.scan(one_chunk, jnp.zeros(kernel.shape, jnp.float32), chunks)
    return merge_chunks(d_hidden, hidden.shape[1]), d_kernel.astype(kernel.dtype), None


chunked_lm_head_nll.defvjp(_chunked_lm_head_nll_forward, _chunked_lm_head_nll_backward)


# Calls whose outputs are their body's outputs (the key of the body among the equation's
# parameters): `plgpu.kernel` wraps its `mpmd_map` in a `custom_vmap_call`, and `jax.checkpoint`
# (each layer under a remat policy) is `remat2`.
_CALL_BODIES = {"jit": "jaxpr", "closed_call": "call_jaxpr", "custom_vmap_call": "call",
                "remat2": "jaxpr"}
# Ops that move values without changing them.
_LAYOUT_PRIMITIVES = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy"})
_NARROW_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def gradient_dtypes(jaxpr: jax_core.Jaxpr, params):
    """The dtype each gradient of `params` is exactly held in (a pytree like params), from the
    jaxpr that computes them: its last outputs, flattened as params (`jax.grad`'s or
    `jax.value_and_grad`'s).

    A gradient that is only the upcast of a GPU kernel's bfloat16 or float16 output (through ops
    that move values without changing them: reshapes, transposes; and into the bodies of calls
    and checkpoints) holds exactly what the kernel wrote, so that narrower dtype holds it exactly;
    every other gradient keeps its dtype. The rule asks for a kernel because a kernel's output is
    written in its own dtype, while XLA may keep an XLA op's result in float32 where the program
    casts it down and up again (its excess-precision simplification), so the same cast could lose
    what XLA kept.

    Why: the update runs under `lax.cond`, and XLA cannot move an upcast into a cond's branch, so
    float32 gradients would be written before it and read again inside (the `1b` step's MoE
    expert weights: 3.0B of its 3.7B parameters). Passed narrow, they are read at half the bytes
    and upcast inside the update's own fusions.
    """
    producers = _producers(jaxpr)
    leaves, treedef = jax.tree.flatten(params)
    gradients = jaxpr.outvars[len(jaxpr.outvars) - len(leaves):]
    return treedef.unflatten([_kernel_written_dtype(producers, gradient) or jnp.dtype(leaf.dtype)
                              for gradient, leaf in zip(gradients, leaves, strict=True)])


def _producers(jaxpr: jax_core.Jaxpr) -> dict:
    """Each variable a jaxpr's equations define -> the equation."""
    return {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}


def _defining_equation(producers: dict, var):
    """The equation that computes `var`, looked for inside the bodies of calls, and the producers
    of the jaxpr it is in; (None, producers) for an input, a constant or a literal."""
    while isinstance(var, jax_core.Var) and var in producers:
        eqn = producers[var]
        if eqn.primitive.name not in _CALL_BODIES:
            return eqn, producers
        body = eqn.params[_CALL_BODIES[eqn.primitive.name]]
        body = getattr(body, "jaxpr", body)  # a closed jaxpr's open one
        producers, var = _producers(body), body.outvars[eqn.outvars.index(var)]
    return None, producers


def _kernel_written_dtype(producers: dict, gradient):
    """The narrow dtype `gradient` was upcast from, if what was upcast is a kernel's output."""
    upcast, producers = _defining_equation(producers, gradient)
    if upcast is None or upcast.primitive.name != "convert_element_type":
        return None
    source = upcast.invars[0]
    dtype = jnp.dtype(source.aval.dtype)
    if dtype not in _NARROW_FLOATS or dtype.itemsize >= jnp.dtype(gradient.aval.dtype).itemsize:
        return None
    return dtype if _written_by_kernel(producers, source) else None


def _written_by_kernel(producers: dict, var) -> bool:
    """Whether `var` is an output of one of `models.lm.KERNEL_PRIMITIVES` (through layout ops and
    into the bodies of calls)."""
    while True:
        eqn, producers = _defining_equation(producers, var)
        if eqn is None or eqn.primitive.name in KERNEL_PRIMITIVES:
            return eqn is not None
        if eqn.primitive.name not in _LAYOUT_PRIMITIVES:
            return False
        var = eqn.invars[0]


def moe_max_violation(model: nnx.Module, router_stats) -> jax.Array:
    """MaxVio of every MoE layer of one step, float32 [num MoE layers] (scanned ones unrolled)."""
    per_site = []
    for (moe, stacked), stats in zip(model.moe_sites(), router_stats):
        def one_layer(expert_ids, copy_mask, num_experts=moe.cfg.num_experts):
            return max_violation(expert_ids, num_experts, copy_mask)

        if stacked:
            per_site.append(jax.vmap(one_layer)(stats.expert_ids, stats.copy_mask))
        else:
            per_site.append(one_layer(stats.expert_ids, stats.copy_mask)[None])
    return jnp.concatenate(per_site) if per_site else jnp.zeros((0,), jnp.float32)


def _forward_options(model: nnx.Module, loss_chunk_tokens: int | None, batch: Batch) -> dict:
    """The keyword arguments of `model.forward` for the loss: the batch's images, if it has
    any (`train.multimodal.batch_images`); with `loss_chunk_tokens`, ask for the LM head's input
    (`return_hidden`), which needs a model with an `LMHead` as `lm_head`."""
    images = batch_images(batch)
    options = {} if images is None else dict(images=images)
    if loss_chunk_tokens is None:
        return options
    check_chunk_tokens(loss_chunk_tokens, "loss_chunk_tokens")
    if not isinstance(getattr(model, "lm_head", None), LMHead):
        raise ValueError(
            f"loss_chunk_tokens={loss_chunk_tokens} needs a model whose `lm_head` is a "
            f"models.lm.LMHead and whose forward takes return_hidden=True (as HybridLM); "
            f"{type(model).__name__} has none: set loss_chunk_tokens=None")
    return dict(options, return_hidden=True)


def _head_operands(model: nnx.Module, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hidden [B, T, D] in the LM head's dtype, its kernel [D, V]) for `chunked_lm_head_nll`."""
    return hidden.astype(model.lm_head.dtype), model.lm_head.kernel[...]


def _token_nll(model: nnx.Module, outputs: jax.Array, targets: jax.Array,
               loss_chunk_tokens: int | None) -> jax.Array:
    """Per-token NLL [B, T] float32 of targets [B, T] from the model's forward outputs: logits
    [B, T, V] (`cross_entropy`), or with `loss_chunk_tokens` the LM head's input [B, T, D]
    (`chunked_lm_head_nll`: no [B, T, V] logits)."""
    if loss_chunk_tokens is None:
        return cross_entropy(outputs.astype(jnp.float32), targets)
    return chunked_lm_head_nll(*_head_operands(model, outputs), targets, loss_chunk_tokens)


# A per-token objective for `make_train_step`: (logp [B, T] float32 of the batch's targets, the
# batch) -> (scalar loss, {name: float32 scalar metric}); e.g. `train.rl.losses.policy_loss`
# with its config bound.
TokenLoss = Callable[[jax.Array, Batch], tuple[jax.Array, dict[str, jax.Array]]]
# The metrics the step reports itself, which a token loss's metrics may not reuse.
STEP_METRICS = frozenset({"loss", "aux_loss", "grad_norm", "targets", "skipped", "max_vio",
                          "qk_max_logit", "skipped_steps", "nonfinite_state"})


def _objective(nll: jax.Array, batch: Batch, token_loss: TokenLoss | None):
    """(loss, number of targets in the loss mask, the token loss's metrics) from per-token NLL
    [B, T]: the masked mean NLL, or `token_loss(-nll, batch)`."""
    if token_loss is None:
        summed, count = masked_sum(nll, batch["loss_mask"])
        return summed / jnp.maximum(count, 1.0), count, {}
    loss, metrics = token_loss(-nll, batch)
    clashes = STEP_METRICS & set(metrics)
    if clashes:
        raise ValueError(f"token_loss's metrics {sorted(clashes)} clash with the step's own "
                         f"metrics {sorted(STEP_METRICS)}: rename them")
    return loss, jnp.sum(batch["loss_mask"]), metrics


def make_train_step(
    graphdef: nnx.GraphDef,
    *,
    qk_clip_tau: float | None = None,
    loss_chunk_tokens: int | None = None,
    token_loss: TokenLoss | None = None,
    state_shardings=None,
    compiler_options: dict | None = None,
) -> Callable[[nnx.State, Batch], tuple[nnx.State, dict[str, jax.Array]]]:
    """The jitted step `(state, batch) -> (new state, metrics)` of a split `TrainState`.

    qk_clip_tau: apply QK-Clip at this logit threshold (None: off).
    loss_chunk_tokens: compute the LM head and the loss in chunks of this many positions
        (`chunked_lm_head_nll`: no [B, T, vocab] logits); None: the full logits.
    token_loss: train on `token_loss(logp, batch)` (`TokenLoss`) instead of the masked mean NLL,
        with logp [B, T] float32 the log-probs of the batch's targets through the same head
        (chunked with loss_chunk_tokens); the batch may carry the extra arrays it reads. The MoE
        auxiliary loss is added as usual, everything after the loss (optimizer, router bias,
        QK-Clip, finite checks) is unchanged, and its metrics join the step's. None: the NLL.
    state_shardings: shardings of the state on a mesh (`core.sharding.state_shardings`), kept
        for the returned state; None leaves placement to the compiler.
    compiler_options: XLA options for the compile (e.g. FAST_COMPILE_OPTIONS).
    The input state is donated. Metrics (float32 unless noted): loss (cross-entropy, nats per
    target; with token_loss, its loss), aux_loss, grad_norm (before clipping), targets (number of
    target tokens: the loss mask's sum), skipped (1.0 when this step was discarded),
    skipped_steps (int32, total), nonfinite_state (1.0 when the step was applied and left a
    non-finite parameter or optimizer value: the caller must not keep that state), max_vio [MoE
    layers], with QK-Clip qk_max_logit [MLA layers, heads], and token_loss's metrics.
    """

    def step(state: nnx.State, batch: Batch):
        train_state = nnx.merge(graphdef, state)
        graph, params, rest = nnx.split(train_state.model, nnx.Param, ...)
        copies = {key: copy[...] for key, copy in train_state.compute_copies.items()}

        def loss_fn(params):
            model = nnx.merge(graph, _through_compute_copies(params, copies), rest)
            inputs = (batch["tokens"], batch["segment_ids"])
            options = _forward_options(model, loss_chunk_tokens, batch)
            if qk_clip_tau is None:
                output, captured = model.forward(*inputs, **options), {}
            else:
                output, captured = qk_clip.capture_forward(model, *inputs, **options)
            outputs, router_stats = output
            with profile_scope("loss"):
                nll = _token_nll(model, outputs, batch["targets"], loss_chunk_tokens)
                loss, count, loss_metrics = _objective(nll, batch, token_loss)
                auxiliary = aux_loss(router_stats)
            aux = (loss, auxiliary, count,
                   jax.lax.stop_gradient((router_stats, captured, loss_metrics)))
            return loss + auxiliary, aux

        # Traced once as a jaxpr, read for the gradients' dtypes, then run.
        backward, shapes = jax.make_jaxpr(jax.value_and_grad(loss_fn, has_aux=True),
                                          return_shape=True)(params)
        (_, (loss, auxiliary, count, (router_stats, captured, loss_metrics))), grads = (
            jax.tree.unflatten(
                jax.tree.structure(shapes),
                jax_core.jaxpr_as_fun(backward)(*jax.tree.leaves(params))))
        with profile_scope("finite_check"):
            grad_norm = optax.tree.norm(grads)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        narrow_grads = jax.tree.map(lambda grad, dtype: grad.astype(dtype), grads,
                                    gradient_dtypes(backward.jaxpr, params))
        metrics = dict(
            loss=loss,
            aux_loss=auxiliary,
            grad_norm=grad_norm,
            targets=count,
            skipped=1.0 - finite.astype(jnp.float32),
            max_vio=moe_max_violation(train_state.model, router_stats),
            **loss_metrics,
        )
        head_max = []
        if qk_clip_tau is not None:
            with profile_scope("qk_clip"):
                head_max = [
                    qk_clip.max_logits(layer.cfg, *captured[path], batch["segment_ids"])
                    for path, layer in qk_clip.mla_layers(train_state.model)
                ]
            metrics["qk_max_logit"] = jnp.stack(head_max) if head_max else jnp.zeros((0, 0))

        def apply_updates(state: nnx.State) -> nnx.State:
            updated = nnx.merge(graphdef, state)
            model = updated.model
            with profile_scope("optimizer"):
                exact_grads = jax.tree.map(lambda narrow, grad: narrow.astype(grad.dtype),
                                           narrow_grads, grads)
                updated.optimizer.update(model, exact_grads, grad_norm=grad_norm)
            with profile_scope("router_bias"):
                update_router_biases([moe for moe, _ in model.moe_sites()], router_stats)
            with profile_scope("qk_clip"):
                for (_, layer), logits_h in zip(qk_clip.mla_layers(model), head_max):  # [] if off
                    qk_clip.clip_query_key(layer, logits_h, qk_clip_tau)
            with profile_scope("optimizer"):  # last, after every change to the parameters
                updated.refresh_compute_copies()
            with profile_scope("finite_check"):
                state_finite = all_finite(nnx.state(updated.model, nnx.Param),
                                          nnx.state(updated.optimizer))
            return nnx.state(updated), state_finite

        new_state, state_finite = jax.lax.cond(
            finite, apply_updates, lambda state: (state, jnp.array(True)), state)
        kept = nnx.merge(graphdef, new_state)
        kept.skipped_steps[...] += (~finite).astype(jnp.int32)
        metrics["skipped_steps"] = kept.skipped_steps[...]
        metrics["nonfinite_state"] = 1.0 - state_finite.astype(jnp.float32)
        return nnx.state(kept), metrics

    placement = {} if state_shardings is None else {"out_shardings": (state_shardings, None)}
    return jax.jit(step, donate_argnums=0, compiler_options=compiler_options, **placement)


def all_finite(*trees) -> jax.Array:
    """bool []: every floating-point leaf of `trees` is finite (integers always are)."""
    checks = [jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(trees)
              if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return jnp.stack(checks).all() if checks else jnp.array(True)


def make_eval_step(
    graphdef: nnx.GraphDef, *, loss_chunk_tokens: int | None = None,
    compiler_options: dict | None = None,
) -> Callable[[nnx.State, Batch], dict[str, jax.Array]]:
    """Jitted `(state, batch) -> {nll, targets, predictions}` of a split `TrainState`, without
    updating anything: summed next-token NLL (nats), the number of targets, and the argmax
    next-token predictions [B, T] int32 (for task accuracy). loss_chunk_tokens: as
    `make_train_step`'s (`chunked_lm_head_eval`)."""

    def evaluate(state: nnx.State, batch: Batch):
        model = nnx.merge(graphdef, state).model
        per_token, predictions = _token_nll_and_predictions(model, batch, loss_chunk_tokens)
        nll, count = masked_sum(per_token, batch["loss_mask"])
        return dict(nll=nll, targets=count, predictions=predictions)

    return jax.jit(evaluate, compiler_options=compiler_options)


def _token_nll_and_predictions(model: nnx.Module, batch: Batch, loss_chunk_tokens: int | None):
    """The model's per-token NLL [B, T] float32 of the batch's targets and its argmax next-token
    predictions [B, T] int32, without a gradient (`chunked_lm_head_eval` with
    loss_chunk_tokens)."""
    outputs, _ = model.forward(batch["tokens"], batch["segment_ids"],
                               **_forward_options(model, loss_chunk_tokens, batch))
    if loss_chunk_tokens is None:
        return (cross_entropy(outputs.astype(jnp.float32), batch["targets"]),
                jnp.argmax(outputs, -1).astype(jnp.int32))
    return chunked_lm_head_eval(*_head_operands(model, outputs), batch["targets"],
                                loss_chunk_tokens)


def make_token_logp(
    graphdef: nnx.GraphDef, *, loss_chunk_tokens: int | None = None,
    compiler_options: dict | None = None,
) -> Callable[[nnx.State, Batch], jax.Array]:
    """Jitted `(state, batch) -> logp [B, T] float32`: the log-probability of each of the batch's
    targets under the model, as the train step's loss computes it (for RL: the frozen reference
    policy's and the behaviour policy's log-probs). graphdef: of a split `TrainState` or of a
    bare model (a reference policy needs no optimizer state); state: its state.
    loss_chunk_tokens: as `make_train_step`'s (no [B, T, vocab] logits)."""

    def token_logp(state: nnx.State, batch: Batch):
        merged = nnx.merge(graphdef, state)
        model = merged.model if isinstance(merged, TrainState) else merged
        return -_token_nll_and_predictions(model, batch, loss_chunk_tokens)[0]

    return jax.jit(token_logp, compiler_options=compiler_options)
