"""Primitives that `kda`, `moe` and `models` all build on, importing none of them.

* `core.sharding`: the logical-axis vocabulary, its one rules table (logical name -> mesh axes),
  parameter annotation, activation constraints and mesh helpers.
* `core.norms`: RMSNorm, the model's one normalisation (function and NNX module).
* `core.chunks`: [B, T, ...] arrays cut into chunks along T and put back (per-token layers run
  chunk by chunk).
"""
