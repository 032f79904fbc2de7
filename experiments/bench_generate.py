"""Generation benchmark: time to first token, decode tokens/s against the memory-read floor, and
the latent cache's bytes per token, for the serving engine (`models.serving`).

    python -m experiments.bench_generate --gpu     # 1b in bf16 -> benchmarks/generate_<card>.md
    python -m experiments.bench_generate --gpu --long   # batch 1 at 128K, 256K and 1M tokens ->
                                                    # benchmarks/long_context_inference_<card>.md
    python -m experiments.bench_generate --smoke   # a two-layer tiny model on CPU

What it measures, in one process:

  HBM bandwidth   a jitted `x + 1` over a large float32 array: 2 * bytes / median time.
  TTFT            batch 1: an engine with one slot (pages for the longest context) gets a prompt
                  of context + 1 random tokens and max_tokens=1; the time from submit to the
                  first token: every prefill chunk (all of the prefill chunk length, so one
                  compiled chunk program) and the decode step that samples the token. A first
                  prompt compiles the programs; each context is then timed once.
  decode          batch B at context C: the engine's decode program (`serving.decode_program`,
                  [B, 1], every row active, greedy) on caches of the right shapes filled with
                  random values (KDA conv tails and states, MLA pages: C tokens per row in its
                  own pages; a pool repeats one random page), not by prefill; median over
                  --repeats steps. One pool per batch size (sized for its longest context that
                  fits), so one compiled program per batch size. Cells whose pages do not fit
                  the device's memory are skipped.
  floor           the bytes a decode step must read once: the active weights (all but the
                  routed experts and the embedding table; of those the B token rows, and each
                  MoE layer's expected share of distinct experts under uniform routing,
                  1 - (1 - k/E)^B), every row's KDA conv tail and state, and every row's MLA pages
                  (C tokens x latent_dim per MLA layer), divided by the measured bandwidth.
  cache bytes     per token per MLA layer, from the engine's pool arrays (bytes / tokens held),
                  against a standard KV cache of the same heads (keys H x (N + R), values H x V
                  per token, in the same dtype); and the K3 config's figures.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.harness import (
    cell,
    command_line,
    gpu_or_smoke_args,
    median_seconds,
    package_version,
    report_preamble,
    table_row,
    write_json,
    write_markdown,
)
from models.config import ModelConfig, count_params, format_count, preset
from models.jit_split import split_for_jit
from models.lm import HybridLM
from models.paged_cache import NULL_PAGE
from models.serving import Engine, Request, RowSampling, decode_program, slot_axes
from train.inference import cast_params


@dataclasses.dataclass(frozen=True)
class Size:
    """One benchmark size: the model, the engine's pages and chunks, the cells."""

    preset: str
    overrides: dict  # preset fields replaced (the smoke size's fewer layers)
    dtype: str | None  # parameters cast to it (None: as initialised)
    page_size: int
    prefill_chunk: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    bandwidth_bytes: int  # the float32 array of the bandwidth copy
    memory_margin: int  # bytes kept free besides a cell's caches (decode temporaries)


GPU = Size("1b", {}, "bfloat16", page_size=64, prefill_chunk=4096, batches=(1, 8, 64, 256),
           contexts=(4096, 32768, 131072), bandwidth_bytes=4 << 30, memory_margin=8 << 30)
SMOKE = Size("tiny", dict(num_layers=2, kda_layers=(1,), full_attn_layers=(2,)), None,
             page_size=8, prefill_chunk=32, batches=(1, 2), contexts=(32, 64),
             bandwidth_bytes=64 << 20, memory_margin=0)
# `--long`: one sequence, prefilled whole (TTFT) and decoded, at the million-token issue's lengths.
LONG_CONTEXTS = (131072, 262144, 1048576)
LONG_SUBJECT = "long_context_inference"


@functools.partial(jax.jit, static_argnums=0)
def _initial_state(config: ModelConfig) -> nnx.State:
    return nnx.state(HybridLM(config, rngs=nnx.Rngs(0)))


def build_model(size: Size) -> HybridLM:
    """The preset's model, initialised on the device in one program, parameters in size.dtype."""
    config = preset(size.preset, **size.overrides)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0))))
    state = _initial_state(config)
    if size.dtype is not None:
        state = cast_params(state, size.dtype)
    return nnx.merge(graphdef, state)


def hbm_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of a jitted `x + 1` over a float32 array of `num_bytes` (read once, written once)."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    add = jax.jit(lambda x: x + 1)
    seconds = median_seconds(lambda: add(x), steps=repeats, warmup=2)
    return 2 * x.nbytes / seconds


def slot_state_bytes(model: HybridLM) -> int:
    """Bytes of one sequence's KDA conv tails and recurrent states, all layers."""
    shapes = jax.eval_shape(lambda: model.init_decode_state(
        1, num_pages=2, page_size=1, max_pages_per_seq=1).caches)
    return sum(leaf.size * leaf.dtype.itemsize
               for leaf, axis in zip(jax.tree.leaves(shapes), slot_axes(model)) if axis is not None)


def pool_leaves(model: HybridLM) -> list[jax.ShapeDtypeStruct]:
    """The MLA page pools of a decode state of 2 pages of 1 token (one per MLA layer, or one
    stacked over a scanned group's layers)."""
    shapes = jax.eval_shape(lambda: model.init_decode_state(
        1, num_pages=2, page_size=1, max_pages_per_seq=1).caches)
    return [leaf for leaf, axis in zip(jax.tree.leaves(shapes), slot_axes(model)) if axis is None]


def latent_bytes_per_token(model: HybridLM) -> int:
    """Bytes one token takes in the MLA page pools, all MLA layers: a pool's bytes over the
    tokens it holds."""
    return sum(leaf.size * leaf.dtype.itemsize // 2 for leaf in pool_leaves(model))


def weight_bytes_read(model: HybridLM, batch: int) -> float:
    """Expected bytes of parameters one decode step of `batch` tokens reads: everything but the
    embedding table (its `batch` rows) and the routed experts (each MoE layer's expected share
    of distinct experts, 1 - (1 - k/E)^batch, under uniform routing)."""
    moe = model.cfg.moe
    expert_share = 1 - (1 - moe.top_k / moe.num_experts) ** batch
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
        if "embed" in names:
            total += batch * leaf.shape[-1] * leaf.dtype.itemsize
        elif {"expert_w_in", "expert_w_out"} & set(names):
            total += expert_share * leaf.nbytes
        else:
            total += leaf.nbytes
    return total


def random_caches(model: HybridLM, batch: int, num_pages: int, page_size: int, max_pages: int,
                  seed: int):
    """Decode-state caches of `batch` rows and a pool of `num_pages` pages, filled with random
    values on the device (one program, no zero-filled copy first)."""
    shapes = jax.eval_shape(lambda: model.init_decode_state(
        batch, num_pages=num_pages, page_size=page_size, max_pages_per_seq=max_pages).caches)
    leaves, treedef = jax.tree.flatten(shapes)

    def random_leaf(key, leaf):
        # Big leaves (page pools) repeat one random slice along their first axis, broadcast into
        # the output: the program allocates nothing but the outputs.
        shape = (1, *leaf.shape[1:]) if leaf.size > 1 << 24 else leaf.shape
        return jnp.broadcast_to(0.1 * jax.random.normal(key, shape, leaf.dtype), leaf.shape)

    @jax.jit
    def fill(key):
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [random_leaf(k, leaf) for k, leaf in zip(keys, leaves)])

    return fill(jax.random.key(seed))


def pool_pages(batch: int, context: int, page_size: int) -> int:
    """Pages of a pool whose `batch` rows each hold `context` tokens and the decoded one."""
    return 1 + batch * math.ceil((context + 1) / page_size)


def fits(num_bytes: float, margin: int) -> tuple[bool, str]:
    """Whether `num_bytes` more fit in the device's free memory (True where it does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return True, ""
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) - margin
    return num_bytes <= free, f"needs {num_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def time_to_first_token(model: HybridLM, size: Size, contexts) -> list[dict]:
    """Batch-1 TTFT of a prompt of context + 1 tokens for each context (see the docstring)."""
    longest = max(contexts)
    engine = Engine(model, slots=1, num_pages=pool_pages(1, longest, size.page_size),
                    page_size=size.page_size, max_seq_len=longest + 2,
                    prefill_chunk_tokens=size.prefill_chunk)
    rng = np.random.default_rng(0)

    def first_token_seconds(length: int) -> float:
        prompt = tuple(int(t) for t in rng.integers(0, model.cfg.vocab_size, length))
        start = time.perf_counter()
        engine.submit(Request(prompt, max_tokens=1))
        while not engine.step():
            pass
        seconds = time.perf_counter() - start
        assert not engine.has_work
        return seconds

    first_token_seconds(size.prefill_chunk + 1)  # compiles the chunk program and the decode step
    rows = []
    for context in contexts:
        seconds = first_token_seconds(context + 1)
        rows.append({"context": context, "prompt_tokens": context + 1, "ttft_ms": 1e3 * seconds,
                     "prefill_tokens_per_s": (context + 1) / seconds})
    return rows


def decode_cells(model: HybridLM, size: Size, bandwidth: float, repeats: int,
                 warmup: int) -> list[dict]:
    """Decode step time, tokens/s and the floor ratio of every (batch, context) cell."""
    structure, variables = split_for_jit(model)
    axes = slot_axes(model)
    per_token, per_row = latent_bytes_per_token(model), slot_state_bytes(model)
    max_pages = math.ceil((max(size.contexts) + 1) / size.page_size)
    vocab = model.cfg.vocab_size
    cells = []
    for batch in size.batches:
        fitting = []
        for context in size.contexts:
            pages = pool_pages(batch, context, size.page_size)
            ok, why = fits(pages * size.page_size * per_token + batch * per_row, size.memory_margin)
            if ok:
                fitting.append(context)
            else:
                cells.append({"batch": batch, "context": context, "skipped": why})
        if not fitting:
            continue
        num_pages = pool_pages(batch, max(fitting), size.page_size)
        caches = random_caches(model, batch, num_pages, size.page_size, max_pages, seed=batch)
        tokens = jnp.asarray(np.random.default_rng(batch).integers(0, vocab, (batch, 1)),
                             jnp.int32)
        rows = RowSampling(jnp.zeros(batch), jnp.full(batch, vocab, jnp.int32), jnp.ones(batch),
                           jnp.zeros(batch, jnp.uint32), jnp.zeros(batch, jnp.int32))
        active = jnp.ones(batch, bool)
        for context in fitting:
            held = math.ceil((context + 1) / size.page_size)
            tables = np.full((batch, max_pages), NULL_PAGE, np.int32)
            tables[:, :held] = 1 + np.arange(batch)[:, None] * held + np.arange(held)
            tables, lengths = jnp.asarray(tables), jnp.full(batch, context, jnp.int32)

            def step():
                nonlocal caches
                caches, next_tokens, _ = decode_program(structure, axes, variables, caches,
                                                        tokens, tables, lengths, active, rows)
                return next_tokens

            seconds = median_seconds(step, steps=repeats, warmup=warmup)
            read = {"weights": weight_bytes_read(model, batch), "kda_states": batch * per_row,
                    "mla_pages": batch * context * per_token}
            floor = sum(read.values()) / bandwidth
            cells.append({"batch": batch, "context": context, "step_ms": 1e3 * seconds,
                          "tokens_per_s": batch / seconds, "floor_ms": 1e3 * floor,
                          "floor_ratio": seconds / floor,
                          "bytes_read_gb": {k: v / 1e9 for k, v in read.items()}})
        del caches
    return cells


def kv_comparison(config: ModelConfig, dtype_bytes: int) -> dict:
    """Bytes per token per MLA layer of the latent cache and of a standard KV cache with the
    same heads (keys H x (N + R), values H x V), both in `dtype_bytes`-byte numbers."""
    mla = config.mla
    standard = mla.num_heads * (mla.qk_head_dim + mla.v_head_dim)
    return {"latent_numbers": mla.latent_dim, "standard_numbers": standard,
            "latent_bytes": mla.latent_dim * dtype_bytes,
            "standard_bytes": standard * dtype_bytes, "ratio": standard / mla.latent_dim}


def report(size: Size, args_command: str, model: HybridLM, bandwidth: float, ttft: list[dict],
           cells: list[dict], cache: dict) -> list[str]:
    counts = count_params(model.cfg)
    dtype = size.dtype or model.cfg.param_dtype
    lines = report_preamble(f"Generation benchmark: `{size.preset}` preset, {dtype} parameters",
                            args_command, f"flax {package_version('flax')}")
    lines += [
        "",
        f"{format_count(counts['total'])} parameters, {format_count(counts['active'])} active per "
        f"token (embedding excluded); {model.cfg.num_layers} layers; pages of {size.page_size} "
        f"tokens, prefill chunks of {size.prefill_chunk}. Measured HBM bandwidth (jitted x + 1 "
        f"over {size.bandwidth_bytes / 2**30:.2f} GiB): {bandwidth / 1e9:,.1f} GB/s.",
        "",
        "## Time to first token, batch 1 (real prefill)",
        "",
        table_row("context", "prompt tokens", "TTFT ms", "prefill tokens/s"),
        table_row(*["---"] * 4),
    ]
    for row in ttft:
        lines.append(table_row(f"{row['context']:,}", f"{row['prompt_tokens']:,}",
                               cell(row["ttft_ms"], ",.1f"),
                               cell(row["prefill_tokens_per_s"], ",.0f")))
    lines += [
        "",
        "## Decode, caches filled with random values (not by prefill)",
        "",
        "One decode step of the engine ([batch, 1], greedy) over KDA states and MLA pages of "
        "the right shapes holding `context` tokens per row. Floor: the step's bytes read once "
        "(active weights with the expected distinct experts under uniform routing, KDA states, "
        "MLA pages) over the measured bandwidth.",
        "",
        table_row("batch", "context", "step ms", "tokens/s", "floor ms", "step / floor",
                  "weights GB", "KDA states GB", "MLA pages GB"),
        table_row(*["---"] * 9),
    ]
    for c in cells:
        if "skipped" in c:
            lines.append(table_row(str(c["batch"]), f"{c['context']:,}",
                                   f"skipped: does not fit ({c['skipped']})", *[""] * 6))
            continue
        read = c["bytes_read_gb"]
        lines.append(table_row(str(c["batch"]), f"{c['context']:,}", cell(c["step_ms"], ".2f"),
                               cell(c["tokens_per_s"], ",.0f"), cell(c["floor_ms"], ".2f"),
                               cell(c["floor_ratio"], ".2f"), cell(read["weights"], ".2f"),
                               cell(read["kda_states"], ".3f"), cell(read["mla_pages"], ".2f")))
    ours, k3 = cache["ours"], cache["k3"]
    lines += [
        "",
        "## Cache bytes per token",
        "",
        f"The engine's page pools hold {cache['measured_bytes']} bytes per token over "
        f"{cache['mla_layers']} MLA layers ({cache['measured_bytes'] // cache['mla_layers']} a "
        f"layer); the KDA state of one sequence is {cache['kda_bytes'] / 2**20:,.1f} MiB "
        "whatever its length.",
        "",
        table_row("config", "latent numbers / token / layer", "standard KV numbers (same heads)",
                  "latent bytes", "standard bytes", "standard / latent"),
        table_row(*["---"] * 6),
        table_row(size.preset, str(ours["latent_numbers"]), str(ours["standard_numbers"]),
                  str(ours["latent_bytes"]), str(ours["standard_bytes"]),
                  f"{ours['ratio']:.1f}x"),
        table_row("k3 (config)", str(k3["latent_numbers"]), str(k3["standard_numbers"]),
                  str(k3["latent_bytes"]), str(k3["standard_bytes"]), f"{k3['ratio']:.1f}x"),
    ]
    return lines


def main(argv=None) -> dict:
    def add_long(parser):
        parser.add_argument("--long", action="store_true",
                            help="batch 1 at contexts of 128K, 256K and 1M tokens (--smoke: "
                            "twice and four times its contexts); --gpu default table: "
                            f"benchmarks/{LONG_SUBJECT}_<card>.md")

    args = gpu_or_smoke_args(
        argv, __doc__.split("\n\n")[0],
        lambda args: LONG_SUBJECT if args.long else "generate",
        gpu_help="1b preset in bf16, batches 1-256, contexts 4K-128K (about 6 minutes on an H200)",
        smoke_help="tiny preset (two layers) on CPU, batches 1-2, contexts 32-64",
        add_options=add_long)
    size = GPU if args.gpu else SMOKE
    if args.long:
        contexts = LONG_CONTEXTS if args.gpu else tuple(2 * c for c in SMOKE.contexts)
        size = dataclasses.replace(size, batches=(1,), contexts=contexts)
    started = time.perf_counter()
    model = build_model(size)
    bandwidth = hbm_bandwidth(size.bandwidth_bytes, args.repeats)
    print(f"bandwidth {bandwidth / 1e9:,.1f} GB/s", flush=True)
    ttft = time_to_first_token(model, size, size.contexts)
    for row in ttft:
        print(f"TTFT context {row['context']}: {row['ttft_ms']:,.1f} ms", flush=True)
    cells = decode_cells(model, size, bandwidth, args.repeats, args.warmup)
    for c in cells:
        print(f"decode batch {c['batch']} context {c['context']}: "
              + (f"skipped ({c['skipped']})" if "skipped" in c else
                 f"{c['step_ms']:.2f} ms, {c['floor_ratio']:.2f}x the floor"), flush=True)
    itemsize = pool_leaves(model)[0].dtype.itemsize
    cache = {"measured_bytes": latent_bytes_per_token(model),
             "mla_layers": len(model.cfg.full_attn_layers), "kda_bytes": slot_state_bytes(model),
             "ours": kv_comparison(model.cfg, itemsize), "k3": kv_comparison(preset("k3"), 2)}
    results = {"bandwidth_gb_per_s": bandwidth / 1e9, "ttft": ttft, "decode": cells,
               "cache": cache, "seconds": time.perf_counter() - started}
    if args.out is not None:
        command = command_line("experiments.bench_generate", argv)
        write_markdown(args.out, report(size, command, model, bandwidth, ttft, cells, cache))
        write_json(args.out.with_suffix(".json"), results)
    print(f"done in {results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    main()
