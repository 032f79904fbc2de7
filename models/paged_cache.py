"""Paged cache of MLA latents: fixed-size pages, one block table per sequence, a host free list.

The device side (`PagedLatentCache`) is a pytree of arrays that jitted decode steps read and
write; attention reads it a block of logical pages at a time (`read_pages`), never a sequence's
whole capacity at once. The host side (`PageAllocator`) owns the free list and the block tables,
as a serving scheduler does: before a step it reserves the pages the step will write, and when a
sequence ends it returns that sequence's pages to the free list.

Page 0 is the *null page*: it is never handed out, unassigned block-table entries point at it, and
rows of finished sequences write their (ignored) latents there, so a freed page that has been
handed to another sequence is never overwritten by a sequence that already ended.
"""

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedLatentCache:
    """One MLA layer's paged latent cache.

    pages:        [num_pages, page_size, latent_dim]  latents (normed c_kv ; shared key part)
    block_tables: [B, max_pages_per_seq] int32        physical page of each logical page
    lengths:      [B] int32                           tokens already cached per sequence
    """

    pages: jax.Array
    block_tables: jax.Array
    lengths: jax.Array

    @property
    def page_size(self) -> int:
        return self.pages.shape[1]

    @property
    def capacity(self) -> int:
        """Tokens a sequence can hold: max_pages_per_seq * page_size."""
        return self.block_tables.shape[1] * self.page_size

    def append(self, latents: jax.Array) -> "PagedLatentCache":
        """Writes latents [B, T, latent_dim] at positions lengths .. lengths + T - 1."""
        num_new = latents.shape[1]
        positions = self.lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)  # [B, T]
        # Positions past the table's end (only rows of finished sequences get there) go to the
        # null page instead of wrapping around onto a live page.
        logical_page = positions // self.page_size
        in_table = logical_page < self.block_tables.shape[1]
        page = jnp.take_along_axis(
            self.block_tables, jnp.where(in_table, logical_page, 0), axis=1
        )
        page = jnp.where(in_table, page, NULL_PAGE)
        slot = positions % self.page_size
        pages = self.pages.at[page, slot].set(latents.astype(self.pages.dtype))
        return dataclasses.replace(self, pages=pages, lengths=self.lengths + num_new)

    def read_pages(self, first: jax.Array, count: int) -> jax.Array:
        """Every sequence's logical pages first .. first + count - 1, in order:
        [B, count * page_size, latent_dim]. first: int32 scalar, may be traced; count: static.

        Only those pages are gathered from the pool. Logical pages past the table's end read as
        the null page; entries at positions >= lengths are garbage (null page or stale data) and
        callers mask them.
        """
        batch, max_pages = self.block_tables.shape
        logical_page = first + jnp.arange(count, dtype=jnp.int32)  # [count]
        in_table = logical_page < max_pages
        page = jnp.take(self.block_tables, jnp.minimum(logical_page, max_pages - 1), axis=1)
        page = jnp.where(in_table[None, :], page, NULL_PAGE)  # [B, count]
        latents = self.pages[page]  # [B, count, page_size, latent_dim]
        return latents.reshape(batch, count * self.page_size, self.pages.shape[-1])


def init_pages(
    num_pages: int, page_size: int, latent_dim: int, dtype: jnp.dtype = jnp.bfloat16
) -> jax.Array:
    """An empty page pool [num_pages, page_size, latent_dim] (page 0 is the null page)."""
    return jnp.zeros((num_pages, page_size, latent_dim), dtype)


def pages_needed(num_sequences: int, max_length: int, page_size: int) -> int:
    """Pool size (null page included) that holds `num_sequences` sequences of `max_length`."""
    return 1 + num_sequences * math.ceil(max_length / page_size)


class PageAllocator:
    """Host bookkeeping for one page pool shared by every MLA layer of a model.

    A sequence is a row of the block table; `reserve(row, n)` makes sure pages cover its first n
    tokens (allocating lazily from the free list), `release(row)` returns its pages.

    Pages are reference counted, so that sequences with a common prefix can hold the same full
    pages (`share`) and a prefix cache can keep pages after their sequences end (`retain`,
    `drop`): a page returns to the free list when its last holder lets it go. Nothing writes into
    a shared page: a sequence appends only past its own length, and shared pages are full.
    """

    def __init__(self, num_pages: int, page_size: int, num_sequences: int, max_pages_per_seq: int):
        if num_pages < 2:
            raise ValueError(
                f"num_pages must be >= 2 (page 0 is the reserved null page), got {num_pages}"
            )
        if page_size < 1 or num_sequences < 1 or max_pages_per_seq < 1:
            raise ValueError(
                "page_size, num_sequences and max_pages_per_seq must be positive, got "
                f"{page_size}, {num_sequences}, {max_pages_per_seq}"
            )
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = collections.deque(range(1, num_pages))
        self._holders = np.zeros(num_pages, np.int64)  # rows and `retain` calls holding a page
        self._pages_of = [[] for _ in range(num_sequences)]
        self.block_tables = np.full((num_sequences, max_pages_per_seq), NULL_PAGE, np.int32)

    @classmethod
    def holding(cls, num_sequences: int, max_length: int, page_size: int) -> "PageAllocator":
        """An allocator whose pool holds `num_sequences` sequences of up to `max_length` tokens."""
        return cls(pages_needed(num_sequences, max_length, page_size), page_size, num_sequences,
                   math.ceil(max_length / page_size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def missing_pages(self, num_tokens: int) -> int:
        """Pages still to hand out for every sequence to hold `num_tokens` tokens."""
        needed = math.ceil(num_tokens / self.page_size)
        return sum(max(0, needed - len(owned)) for owned in self._pages_of)

    def reserve(self, row: int, num_tokens: int) -> None:
        """Allocates pages so that sequence `row` can hold `num_tokens` tokens."""
        needed = math.ceil(num_tokens / self.page_size)
        owned = self._pages_of[row]
        if needed > self.block_tables.shape[1]:
            raise ValueError(
                f"num_tokens={num_tokens} exceeds the per-sequence capacity of "
                f"{self.block_tables.shape[1] * self.page_size} tokens; build the allocator with "
                "a larger max_pages_per_seq"
            )
        if needed - len(owned) > len(self._free):
            raise ValueError(
                f"page pool exhausted: sequence {row} needs {needed - len(owned)} more pages, "
                f"{len(self._free)} are free; build the pool with more pages or end sequences"
            )
        while len(owned) < needed:
            page = self._free.popleft()
            self._holders[page] = 1
            self.block_tables[row, len(owned)] = page
            owned.append(page)

    def release(self, row: int) -> None:
        """Ends sequence `row`: its pages go back to the free list (those no other holder
        keeps), its row to the null page."""
        self.drop(self._pages_of[row])
        self._pages_of[row] = []
        self.block_tables[row] = NULL_PAGE

    def pages_of(self, row: int) -> tuple[int, ...]:
        """The physical pages of sequence `row`, in logical order."""
        return tuple(self._pages_of[row])

    def share(self, row: int, pages) -> None:
        """Starts the empty sequence `row` on `pages` (full pages another holder keeps: a common
        prefix), which it now holds too."""
        if self._pages_of[row]:
            raise ValueError(f"sequence {row} already holds pages; release it before sharing")
        if len(pages) > self.max_pages_per_seq:
            raise ValueError(f"{len(pages)} shared pages exceed the block table's "
                             f"{self.max_pages_per_seq} pages per sequence")
        self.retain(pages)
        self._pages_of[row] = list(pages)
        self.block_tables[row, : len(pages)] = pages

    def retain(self, pages) -> None:
        """One more holder of each of `pages` (pages in use)."""
        for page in pages:
            if self._holders[page] < 1:
                raise ValueError(f"page {page} is not in use and cannot be retained")
            self._holders[page] += 1

    def drop(self, pages) -> None:
        """One holder fewer for each of `pages`; a page nobody holds returns to the free list."""
        for page in pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free.append(page)
