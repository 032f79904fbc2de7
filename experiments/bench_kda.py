"""Times KDA implementations side by side, in one process, and writes a markdown table.

    python -m experiments.bench_kda              # this backend: chunked vs reference, T = 1K/4K/16K
    python -m experiments.bench_kda --gpu        # H200 shapes: our ops and kernels, fla, jla, cuDNN
    python -m experiments.bench_kda --gpu --profile   # also the top device ops at the first shape
    python -m experiments.bench_kda --gpu --device-time   # also each call's summed device time
    python -m experiments.bench_kda --gpu --resume        # after a cut-short run: the other shapes
    python -m experiments.bench_kda --gpu --long          # T = 256K..1M: whole and in segments

Shapes are BxTxHxD (q, k, v [B, T, H, D], K = V = D). Every contender gets the same inputs (bf16
q/k/v on GPU, float32 on CPU; lower-bound gates in [-5, 0); L2-normalised q and k); forward and
forward+backward (the gradient of sum(o * do)) are timed after a warm-up, all contenders of a
shape in turns (`time_contenders`: a drift of the GPU's clocks falls on all), the outputs'
relative L2 error is measured against our chunked op (or, in a run without it, the first other
KDA contender's, `error_anchor`), and memory comes from XLA's analysis of the compiled
forward+backward (torch's peak for fla). Peers that are not installed are skipped with a note.
The table goes to `benchmarks/kda_<card>.md` with `--gpu` (`benchmarks/kda_<backend>.md` else),
and each shape's results, once timed, to the JSON file beside it (`OUT.json`), from which
`--resume` takes them instead of timing those shapes again (a run cut short, or shapes spread
over several jobs: all contenders of a shape are always timed in one process).
"""

import argparse
import collections
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import kda
from experiments.harness import (cell, command_line, compiled_once, compiled_peak_mib, device_ms,
                                 gpu_table, package_version, relative_error, report_preamble,
                                 speedup, table_row, timing_cells, write_json, write_markdown)
from experiments.profiling import ops_markdown, profile_device_ops
from kda.chunked import CHUNK_SIZE, chunk_recurrence, prepare_chunks
from kda.kernels.triton import op as triton_path
from kda.kernels.mosaic_gpu.op import kernel_recurrence
from kda.kernels.mosaic_gpu.common import recurrence_operands
from kda.kernels.mosaic_gpu.prepare import prepare_chunks_kernel
from kda.kernels.mosaic_gpu.sequence_parallel import choose_num_segments
from kda.segments import is_segment_size, kda_attention_in_segments

CPU_SHAPES = ["1x1024x4x64", "1x4096x4x64", "1x16384x4x64"]
GPU_SHAPES = ["8x2048x16x128", "2x8192x16x128", "1x32768x16x128", "1x65536x32x128",
              "16x4096x32x128"]
# `--long`: one sequence of up to a million tokens, the op whole and in recomputed segments
# (`kda.segments`), against jla.
LONG_SHAPES = ["1x262144x16x128", "1x524288x16x128", "1x1048576x16x128"]
LONG_SEGMENT_TOKENS = 131072
# The token-by-token oracle is a scan over T: beyond this many tokens it only measures patience.
REFERENCE_MAX_TOKENS = 16384


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    length: int
    heads: int
    dim: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        try:
            return cls(*(int(part) for part in text.lower().split("x")))
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"shape must be BxTxHxD with four integers (e.g. 2x8192x16x128), got {text!r}")

    def __str__(self):
        return f"{self.batch}x{self.length}x{self.heads}x{self.dim}"


@dataclasses.dataclass
class Timing:
    forward_ms: float | None = None
    forward_backward_ms: float | None = None
    error: float | None = None  # relative error of the output against `error_anchor`'s
    peak_mib: float | None = None
    # The device ops' time of one call (`--device-time`): what is left without host launch work.
    forward_device_ms: float | None = None
    forward_backward_device_ms: float | None = None
    note: str = ""


def make_inputs(shape: Shape, dtype, seed: int = 0) -> dict[str, np.ndarray]:
    """Numpy inputs in FLA layout with lower-bound gates in [-5, 0) and beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    b, t, h, d = shape.batch, shape.length, shape.heads, shape.dim
    raw_gate = rng.standard_normal((b, t, h, d), np.float32)
    return dict(
        q=rng.standard_normal((b, t, h, d), np.float32).astype(dtype),
        k=rng.standard_normal((b, t, h, d), np.float32).astype(dtype),
        v=rng.standard_normal((b, t, h, d), np.float32).astype(dtype),
        g=(-5.0 / (1.0 + np.exp(-raw_gate))).astype(np.float32),
        beta=(1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h), np.float32)))),
        do=rng.standard_normal((b, t, h, d), np.float32).astype(dtype),
    )


@dataclasses.dataclass
class Contender:
    """One contender at one shape, compiled and ready: the calls to time (each returns what `sync`
    waits for; `forward_backward` None where only a forward is timed), its output (None for the
    rows that time a part alone) and what was measured without timing calls (peak memory, device
    times, a note); `time_contenders` fills in the times."""

    forward: Callable[[], object]
    forward_backward: Callable[[], object] | None
    sync: Callable[[object], None]
    output: np.ndarray | None
    timing: "Timing"


# Warm-up before the rounds, in seconds: an idle GPU clocks down, and a few calls of a millisecond
# do not bring it back up. Rounds: the contenders are timed in turns, so that a drift of the
# clocks in the run falls on all of them alike (`benchmarks/kda_notes.md` has the numbers).
WARMUP_SECONDS, ROUNDS = 0.25, 5


def _calls(contender: Contender) -> list[tuple[str, Callable[[], object]]]:
    return [(field, call) for field, call in (("forward_ms", contender.forward),
                                              ("forward_backward_ms", contender.forward_backward))
            if call is not None]


def time_contenders(contenders: dict[str, Contender], repeats: int, rounds: int = ROUNDS):
    """Sets each contender's forward_ms and forward_backward_ms to the median wall time of
    `repeats` calls (each waited for), taken in `rounds` turns over all contenders (one untimed
    call first in each turn), after `WARMUP_SECONDS` of calls of all of them. Each turn starts
    one contender further down the list, so that what the first calls after a switch pay (after a
    long call of another contender, say) does not fall on one contender alone."""
    started = time.perf_counter()
    while True:
        for contender in contenders.values():
            for _, call in _calls(contender):
                contender.sync(call())
        if time.perf_counter() - started >= WARMUP_SECONDS:
            break
    samples = collections.defaultdict(list)
    rounds = max(1, min(rounds, repeats))
    names = list(contenders)
    for turn in range(rounds):
        per_turn = repeats // rounds + (turn < repeats % rounds)
        first = turn % len(names)
        for name in names[first:] + names[:first]:
            contender = contenders[name]
            for field, call in _calls(contender):
                contender.sync(call())
                for _ in range(per_turn):
                    start = time.perf_counter()
                    contender.sync(call())
                    samples[name, field].append((time.perf_counter() - start) * 1e3)
    for (name, field), times in samples.items():
        setattr(contenders[name].timing, field, statistics.median(times))


def _operands(inputs) -> list[jax.Array]:
    """[q, k, v, g, beta] on the device."""
    return [jnp.asarray(inputs[name]) for name in ("q", "k", "v", "g", "beta")]


def _arrays(inputs) -> tuple[list[jax.Array], jax.Array]:
    """([q, k, v, g, beta], d_o) on the device."""
    return _operands(inputs), jnp.asarray(inputs["do"])


def gradient(attention: Callable) -> Callable:
    """`([q, k, v, g, beta], d_o) -> gradients` of `sum(attention(q, k, v, g, beta) * d_o)`."""
    def loss(xs, d_o):
        return jnp.sum(attention(*xs).astype(jnp.float32) * d_o.astype(jnp.float32))
    return jax.grad(loss)


def bench_jax(attention: Callable, inputs, device_time: bool = False) -> Contender:
    """`attention(q, k, v, g, beta) -> o` and the gradient of `sum(o * do)`; with `device_time`,
    also each one's summed device ops (`device_ms`)."""
    args, d_o = _arrays(inputs)
    forward = compiled_once(attention, *args)
    backward = compiled_once(gradient(attention), args, d_o)
    timing = Timing(peak_mib=compiled_peak_mib(backward))
    if device_time:
        timing.forward_device_ms = device_ms(attention, args)
        timing.forward_backward_device_ms = device_ms(gradient(attention), (args, d_o))
    return Contender(lambda: forward(*args), lambda: backward(args, d_o), jax.block_until_ready,
                     np.asarray(forward(*args), np.float32), timing)


def ours(impl: str, segment_tokens: int | None = None) -> Callable:
    """Our op by `impl`; with `segment_tokens`, in recomputed segments of that many tokens."""
    def attention(q, k, v, g, beta):
        options = dict(use_qk_l2norm=True, gate_lower_bound=-5.0, impl=impl)
        if segment_tokens is None:
            return kda.kda_attention(q, k, v, g, beta, **options)[0]
        return kda_attention_in_segments(q, k, v, g, beta, segment_tokens=segment_tokens,
                                         **options)[0]
    return attention


def segmented_name(impl: str, segment_tokens: int) -> str:
    size = f"{segment_tokens // 1024}K" if segment_tokens % 1024 == 0 else str(segment_tokens)
    return f"{impl}, segments of {size}"


# The options of every timed call: no documents, L2-normalised q and k, bounded gates.
PREPARATION_OPTIONS = dict(segment_ids=None, use_qk_l2norm=True, gate_lower_bound=-5.0)


def plain_preparation(q, k, v, g, beta):
    """`prepare_chunks` in plain JAX, cast to what the recurrence kernel reads."""
    return recurrence_operands(prepare_chunks(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                                              chunk_size=CHUNK_SIZE, **PREPARATION_OPTIONS))


def kernel_preparation(q, k, v, g, beta):
    return prepare_chunks_kernel(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                                 **PREPARATION_OPTIONS)


def triton_preparation(q, k, v, g, beta):
    return triton_path.prepare_chunks_kernel(q, k, v, g, beta, scale=q.shape[-1] ** -0.5,
                                             **PREPARATION_OPTIONS)


def bench_preparation(prepare: Callable, inputs) -> Contender:
    """Only the chunk preparation, forward (the kernel has no backward of its own).

    `prepare(q, k, v, g, beta)` returns the recurrence kernel's operands.
    """
    args = _operands(inputs)
    forward = compiled_once(prepare, *args)
    timing = Timing(peak_mib=compiled_peak_mib(forward),
                    note="chunk preparation alone (forward); memory of the forward")
    return Contender(lambda: forward(*args), None, jax.block_until_ready, None, timing)


def bench_recurrence(recurrence: Callable, inputs) -> Contender:
    """Only the recurrence over chunks, on inputs prepared once: a kernel's own share.

    `recurrence` has the contract of `kda.chunked.chunk_recurrence`; the backward is timed on the
    gradient of `sum(o) + sum(final_state)` with respect to the prepared chunks and state.
    """
    args = _operands(inputs)
    chunks = jax.jit(lambda q, k, v, g, beta: prepare_chunks(
        q, k, v, g, beta, scale=q.shape[-1] ** -0.5, chunk_size=CHUNK_SIZE,
        **PREPARATION_OPTIONS))(*args)
    batch, heads, _, _, key_dim = chunks.W.shape
    state = jnp.zeros((batch, heads, key_dim, chunks.U.shape[-1]), jnp.float32)
    out_dtype = args[2].dtype
    forward = compiled_once(lambda c, s: recurrence(c, s, out_dtype), chunks, state)

    def loss(c, s):
        o, final_state = recurrence(c, s, out_dtype)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final_state)

    backward = compiled_once(jax.grad(loss, argnums=(0, 1)), chunks, state)
    timing = Timing(peak_mib=compiled_peak_mib(backward),
                    note="recurrence over chunks alone, on prepared inputs")
    return Contender(lambda: forward(chunks, state), lambda: backward(chunks, state),
                     jax.block_until_ready, None, timing)


def bench_kernel_recurrence(inputs) -> Contender:
    """`bench_recurrence` of the Mosaic GPU recurrence (forward and reversed kernels, each over
    the P sequence segments `choose_num_segments` picks for this grid), P in the note."""
    contender = bench_recurrence(kernel_recurrence, inputs)
    batch, length, heads, dim = inputs["v"].shape
    num_segments = choose_num_segments(batch * heads, -(-length // CHUNK_SIZE), dim, dim)
    contender.timing.note += f"; P = {num_segments}"
    return contender


def jla_attention() -> Callable:
    from jla.ops.mosaic_gpu.kda import kda as jla_kda  # noqa: PLC0415 (optional peer)

    def attention(q, k, v, g, beta):
        return jla_kda(q, k, v, g, beta, use_qk_l2norm=True)[0]
    return attention


def cudnn_attention(q, k, v, g, beta):
    """Causal softmax attention on the same q, k, v (no gate): the quadratic baseline."""
    del g, beta
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def bench_fla(inputs) -> Contender:
    """fla-core's Triton `chunk_kda` (safe_gate=True, lower_bound=-5) on the same inputs."""
    import torch  # noqa: PLC0415 (optional peer)
    from fla.ops.kda import chunk_kda as fla_chunk_kda  # noqa: PLC0415

    def tensor(name, grad):
        x = torch.from_numpy(np.asarray(inputs[name], np.float32)).cuda()
        if name in ("q", "k", "v", "do"):  # gates and beta stay float32, as in our call
            x = x.to(torch.bfloat16)
        return x.requires_grad_(grad)

    q, k, v, g, beta = (tensor(name, True) for name in ("q", "k", "v", "g", "beta"))
    d_o = tensor("do", False)

    def output():
        return fla_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, safe_gate=True,
                             lower_bound=-5.0)[0]

    def forward():
        with torch.no_grad():
            return output()

    def forward_backward():
        output().backward(d_o)
        return None

    def sync(_):
        torch.cuda.synchronize()

    torch.cuda.reset_peak_memory_stats()
    forward_backward()  # also its first call's autotuning, before any timing
    sync(None)
    timing = Timing(peak_mib=torch.cuda.max_memory_allocated() / 2**20)
    return Contender(forward, forward_backward, sync, forward().float().cpu().numpy(), timing)


PEERS = ("jla", "fla", "cudnn")
# The row of cuDNN's causal softmax attention: a speed reference that computes something else,
# so no output error is measured for it or against it.
SOFTMAX_ATTENTION = "cuDNN attention"


def contenders(gpu: bool, impls: list[str], peers=PEERS, parts=True,
               device_time=False, segment_tokens: int | None = None) -> dict[str, Callable]:
    """name -> bench(inputs) -> `Contender`; `parts`: also the recurrence and the preparation
    alone, for each of our kernels (GPU only); `device_time`: also the device-op time of the
    whole-op JAX contenders (`bench_jax`); `segment_tokens`: also each of our impls in recomputed
    segments of that many tokens (`kda.segments`)."""
    whole_op = functools.partial(bench_jax, device_time=device_time)
    table = {impl: (lambda inputs, impl=impl: whole_op(ours(impl), inputs)) for impl in impls}
    if segment_tokens is not None:
        table.update({segmented_name(impl, segment_tokens): (
            lambda inputs, impl=impl: whole_op(ours(impl, segment_tokens), inputs))
            for impl in impls})
    if gpu and parts:
        # The sequential part alone, plain JAX against our kernel: how much the kernel saves.
        table["recurrence: chunked scan"] = functools.partial(bench_recurrence,
                                                              chunk_recurrence)
        if "mosaic_gpu" in impls:
            table["recurrence: mosaic_gpu"] = bench_kernel_recurrence
        if triton_path.NAME in impls:
            table["recurrence: triton"] = functools.partial(bench_recurrence,
                                                            triton_path.kernel_recurrence)
        # The parallel part alone, plain JAX against our kernel (bounded gates).
        table["preparation: plain JAX"] = functools.partial(bench_preparation,
                                                            plain_preparation)
        if "mosaic_gpu" in impls:
            table["preparation: mosaic_gpu"] = functools.partial(bench_preparation,
                                                                 kernel_preparation)
        if triton_path.NAME in impls:
            table["preparation: triton"] = functools.partial(bench_preparation,
                                                             triton_preparation)
    if gpu:
        if "jla" in peers:
            table["jla mosaic_gpu"] = lambda inputs: whole_op(jla_attention(), inputs)
        if "fla" in peers:
            table["fla chunk_kda"] = bench_fla
        if "cudnn" in peers:
            table[SOFTMAX_ATTENTION] = functools.partial(whole_op, cudnn_attention)
    return table


def run(shapes: list[Shape], table: dict[str, Callable], dtype, repeats: int,
        on_progress: Callable[[dict], None], timed: dict[str, dict[str, Timing]] | None = None,
        on_shape_timed: Callable[[str, dict[str, Timing]], None] = lambda shape, rows: None):
    """Times every contender on every shape (all of a shape's in turns, `time_contenders`), and
    measures each KDA output's error against `error_anchor`'s; calls `on_progress(results)` after
    each contender is ready and after each shape is timed, and `on_shape_timed(shape, {name:
    Timing})` after each shape is timed. Shapes in `timed` (shape -> {name: Timing}, from a run
    being resumed) are not timed again: their rows are taken as they are."""
    anchor = error_anchor(list(table))
    results: dict[tuple[str, str], Timing] = {}
    for shape in shapes:
        if str(shape) in (timed or {}):
            results.update({(str(shape), name): timing
                            for name, timing in timed[str(shape)].items()})
            print(f"{shape}: kept from the run being resumed", flush=True)
            continue
        inputs = make_inputs(shape, dtype)
        ready: dict[str, Contender] = {}
        for name, bench in table.items():
            if name == "reference" and shape.batch * shape.length > REFERENCE_MAX_TOKENS:
                results[(str(shape), name)] = Timing(note=f"skipped: > {REFERENCE_MAX_TOKENS} "
                                                          "tokens")
                continue
            # Getting a contender ready (compiling; fla's first calls autotune) takes seconds to
            # minutes a row, so say which one a run is waiting on.
            print(f"{shape} {name}: getting ready", flush=True)
            start = time.perf_counter()
            try:
                contender = bench(inputs)
                for _, call in _calls(contender):  # a call that fails does so here, not timed
                    contender.sync(call())
            except Exception as error:  # a peer that is missing or fails must not stop the run
                results[(str(shape), name)] = Timing(note=f"{type(error).__name__}: "
                                                          f"{str(error).splitlines()[0][:100]}")
                print(f"{shape} {name}: {results[(str(shape), name)].note}", file=sys.stderr)
                continue
            print(f"{shape} {name}: ready in {time.perf_counter() - start:.1f} s", flush=True)
            ready[name] = contender
            results[(str(shape), name)] = contender.timing
            on_progress(results)  # what is known so far survives a run cut short
        outputs = {name: contender.output for name, contender in ready.items()
                   if contender.output is not None}  # rows of a part alone have none
        _fill_errors(results, shape, outputs, anchor)
        time_contenders(ready, repeats)
        for name, contender in ready.items():
            print(f"{shape} {name}: fwd {cell(contender.timing.forward_ms, '.2f')} ms, fwd+bwd "
                  f"{cell(contender.timing.forward_backward_ms, '.2f')} ms", flush=True)
        on_progress(results)
        on_shape_timed(str(shape), {name: timing for (row_shape, name), timing in results.items()
                                    if row_shape == str(shape)})
    return results


def load_timed_shapes(path: Path) -> dict[str, dict[str, Timing]]:
    """What `save_timed_shapes` wrote to `path` (shape -> {name: Timing}); {} if it is absent."""
    if not path.exists():
        return {}
    return {shape: {name: Timing(**fields) for name, fields in rows.items()}
            for shape, rows in json.loads(path.read_text()).items()}


def save_timed_shapes(path: Path, timed: dict[str, dict[str, Timing]]):
    """Writes the rows of the shapes timed so far (shape -> {name: Timing}) as JSON."""
    write_json(path, {shape: {name: dataclasses.asdict(timing) for name, timing in rows.items()}
                      for shape, rows in timed.items()})


def profile_markdown(shape: Shape, dtype, impls: list[str], peers) -> list[str]:
    """The top device ops of each JAX contender's forward, then forward+backward, at `shape`
    (`--profile`)."""
    attentions = {impl: ours(impl) for impl in impls}
    if "jla" in peers:
        attentions["jla mosaic_gpu"] = jla_attention()
    args, d_o = _arrays(make_inputs(shape, dtype))
    lines = []
    for pass_name, traced, pass_args in (("forward", lambda a: a, args),
                                         ("forward+backward", gradient, (args, d_o))):
        lines += ["", f"## Where the {pass_name} time goes at {shape} (`--profile`)", ""]
        for name, attention in attentions.items():
            try:
                ops = profile_device_ops(jax.jit(traced(attention)), pass_args, steps=3)
            except Exception as error:  # a failing contender is already in the table above
                lines += [f"{name}: not profiled ({type(error).__name__}).", ""]
                continue
            lines += ops_markdown(ops, f"Device ops of {name}'s {pass_name}")
    return lines


def error_anchor(names: list[str]) -> str | None:
    """The contender whose output every KDA output's error is measured against: our chunked op if
    it runs, else the first other whole-KDA contender, so that every run checks that the outputs
    agree. Not the token-by-token reference (skipped at long lengths), not softmax attention (it
    computes something else) and not the rows that time a part alone ("recurrence: ...")."""
    whole_kda = [name for name in names
                 if name not in ("reference", SOFTMAX_ATTENTION) and ":" not in name]
    if "chunked" in whole_kda:
        return "chunked"
    return whole_kda[0] if whole_kda else None


def _fill_errors(results, shape, outputs, anchor: str | None):
    """Relative L2 error of every KDA output against the anchor's, once that has run."""
    if anchor not in outputs:
        return
    reference = outputs[anchor]
    for name, output in outputs.items():
        if name != SOFTMAX_ATTENTION:
            results[(str(shape), name)].error = relative_error(output, reference)


def anchor_words(anchor: str | None) -> str:
    """How the table's preamble names `error_anchor`'s choice."""
    if anchor is None:
        return "nothing (no whole-KDA contender besides the reference ran)"
    return "our chunked op" if anchor == "chunked" else f"the {anchor} row's output"


def row_names(results, names: list[str]) -> list[str]:
    """The table's rows at each shape: this run's contenders `names`, after those of the rows in
    `results` (which hold the rows kept from a resumed run, whose contenders may differ), in the
    order first seen."""
    return list(dict.fromkeys([name for _, name in results] + names))


def anchors_sentence(results, shapes, names: list[str]) -> str:
    """What the errors are measured against: each shape's `error_anchor` among the rows it was
    timed with (this run's `names` for a shape not yet timed; a resumed run's kept shapes may
    have had others), one phrase if every shape shares it."""
    shapes_of = collections.defaultdict(list)  # anchor -> the shapes measured against it
    for shape in map(str, shapes):
        timed_names = [name for row_shape, name in results if row_shape == shape]
        shapes_of[error_anchor(timed_names or names)].append(shape)
    if len(shapes_of) == 1:
        return anchor_words(next(iter(shapes_of)))
    return "; ".join(f"{anchor_words(anchor)} at {', '.join(anchor_shapes)}"
                     for anchor, anchor_shapes in shapes_of.items())


def write_table(path: Path, results, shapes, names, baseline: str, command: str, gpu: bool):
    peers = ("torch", "triton", "fla-core", "jax-linear-attention") if gpu else ()
    lines = report_preamble(
        "KDA forward and forward+backward", command,
        ", ".join(f"{name} {package_version(name)}" for name in ("flax", *peers))) + [
        f"- Inputs: {'bf16' if gpu else 'float32'} q/k/v, lower-bound gates in [-5, 0), "
        "use_qk_l2norm, no initial state. Shapes are BxTxHxD (K = V = D, HV = H).",
        "- Times are medians of repeated calls, each waited for, taken in "
        f"{ROUNDS} turns over all contenders of a shape (each turn starting one contender "
        f"further on) after at least {WARMUP_SECONDS} s of warm-up calls, in milliseconds. "
        f"'vs {baseline}' = {baseline}'s time / this row's time (above 1: this row is faster).",
        f"- Error: relative L2 error of the output against "
        f"{anchors_sentence(results, shapes, names)}. Memory: arguments, outputs and "
        "temporaries of the forward+backward (XLA's analysis; torch's peak for fla).",
        "- Device ms (`--device-time`): the device ops of one call summed from a profiler trace, "
        "fwd / fwd+bwd, and the same ratios on them: the kernels' work without the host's launch "
        "work, which a call that is waited for pays in full and a training step hides.",
        "",
        f"| shape | implementation | fwd ms | fwd+bwd ms | fwd vs {baseline} | fwd+bwd vs "
        f"{baseline} | error | memory MiB | device ms | device vs {baseline} | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = row_names(results, names)
    for shape in shapes:
        base = results.get((str(shape), baseline), Timing())
        for name in rows:
            t = results.get((str(shape), name), Timing(note="not run"))
            measured = t.forward_device_ms is not None
            device = (f"{cell(t.forward_device_ms, '.3f')} / "
                      f"{cell(t.forward_backward_device_ms, '.3f')}") if measured else "–"
            device_ratios = (
                f"{cell(speedup(t.forward_device_ms, base.forward_device_ms), '.2f')} / "
                f"{cell(speedup(t.forward_backward_device_ms, base.forward_backward_device_ms),
                        '.2f')}") if measured else "–"
            lines.append(table_row(str(shape), name, *timing_cells(t, base, ".2f"),
                                   cell(t.error, ".1e"), cell(t.peak_mib, ".0f"), device,
                                   device_ratios, t.note))
    write_markdown(path, lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true",
                        help="GPU shapes and peers (fla, jla, cuDNN); needs a CUDA backend")
    parser.add_argument("--shapes", nargs="+", type=Shape.parse, metavar="BxTxHxD",
                        help="shapes to time (default: the backend's standard list)")
    parser.add_argument("--impls", nargs="+", metavar="IMPL",
                        help="our implementations to time (default: reference and chunked; with "
                             "--gpu chunked and every registered kernel)")
    parser.add_argument("--baseline", help="row the ratios compare with (default: chunked on "
                                           "CPU, the jla kernel with --gpu)")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                        help="peers to time with --gpu (fla's first call autotunes for minutes)")
    parser.add_argument("--no-parts", dest="parts", action="store_false",
                        help="with --gpu, skip the rows that time the recurrence and the "
                             "preparation alone (each costs its own compilations)")
    parser.add_argument("--profile", action="store_true",
                        help="also trace the forward and the forward+backward of our "
                             "implementations and jla at the first shape and list their costliest "
                             "device ops")
    parser.add_argument("--device-time", action="store_true",
                        help="also sum the device ops of one call of each whole-op JAX contender "
                             "from a profiler trace (one more compile each)")
    parser.add_argument("--segment-tokens", type=int, metavar="N",
                        help="also time each of our impls in recomputed segments of N tokens "
                             "(kda.segments; N a multiple of 64 dividing every T)")
    parser.add_argument("--long", action="store_true",
                        help=f"with --gpu: shapes {' '.join(LONG_SHAPES)}, segments of "
                             f"{LONG_SEGMENT_TOKENS} tokens, auto and jla only, no part rows; "
                             "the table goes to benchmarks/kda_long_<card>.md")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path,
                        help="markdown file (default: benchmarks/kda_<card>.md with --gpu, else "
                             "benchmarks/kda_<backend>.md); the timed shapes go beside it as JSON")
    parser.add_argument("--resume", action="store_true",
                        help="keep the shapes that an earlier run with the same --out timed (in "
                             "OUT.json, beside the table) and time only the others")
    args = parser.parse_args(argv)
    backend = jax.default_backend()
    if args.gpu and backend != "gpu":
        parser.error(f"--gpu needs a CUDA backend, but JAX runs on {backend!r}")
    # The registered kernels (`kda.kernels`) run only on GPUs; on CPU their rows would only say so.
    if args.long:
        if not args.gpu:
            parser.error("--long times million-token sequences: it needs --gpu")
        args.shapes = args.shapes or [Shape.parse(s) for s in LONG_SHAPES]
        args.segment_tokens = args.segment_tokens or LONG_SEGMENT_TOKENS
        args.impls = args.impls or ["auto"]
        args.peers, args.parts = [peer for peer in args.peers if peer == "jla"], False
        args.out = args.out or gpu_table("kda_long")
    if args.impls:
        impls = args.impls
    elif args.gpu:  # the token-by-token scan would only measure patience at these lengths
        impls = [name for name in kda.available_implementations()
                 if name not in ("auto", "reference")]
    else:  # the registered kernels run only on GPUs
        impls = ["reference", "chunked"]
    unknown = set(impls) - set(kda.available_implementations())
    if unknown:
        parser.error(f"--impls: unknown {sorted(unknown)}; choose from "
                     f"{kda.available_implementations()}")
    shapes = args.shapes or [Shape.parse(s) for s in (GPU_SHAPES if args.gpu else CPU_SHAPES)]
    baseline = args.baseline or ("jla mosaic_gpu" if args.gpu else "chunked")
    segment = args.segment_tokens
    if segment is not None and (not is_segment_size(segment)
                                or any(shape.length % segment for shape in shapes)):
        parser.error(f"--segment-tokens {args.segment_tokens} must be a multiple of 64 that "
                     "divides every shape's T")
    table = contenders(args.gpu, impls, args.peers, args.parts, args.device_time,
                       args.segment_tokens)
    names = list(table)
    out = args.out or (gpu_table("kda") if args.gpu else Path("benchmarks") / f"kda_{backend}.md")
    command = command_line("experiments.bench_kda", argv)
    dtype = jnp.bfloat16 if args.gpu else np.float32
    timed_path = out.with_suffix(".json")
    timed = load_timed_shapes(timed_path) if args.resume else {}

    def shape_timed(shape, rows):
        timed[shape] = rows
        save_timed_shapes(timed_path, timed)

    run(shapes, table, dtype, args.repeats, lambda results: write_table(
        out, results, shapes, names, baseline, command, args.gpu), timed, shape_timed)
    if args.profile:
        peers = args.peers if args.gpu else ()
        with out.open("a") as table_file:
            table_file.write("\n".join(profile_markdown(shapes[0], dtype, impls, peers)) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
