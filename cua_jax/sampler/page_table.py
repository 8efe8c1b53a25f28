"""Page tables for the paged KV cache.

Two halves (this module is pure Python and numpy, so the scheduler imports no JAX):

* `kv_cache.PageTable` is the immutable device-side view the
  jitted decode/prefill functions read: one row of page ids per sequence slot plus the number of
  tokens whose K/V are stored. It is a pytree, so it is passed into `jax.jit` like any array
  argument (shapes never change, so no recompiles).
* `PageAllocator` is the host-side bookkeeping the scheduler mutates between jitted calls: a free
  list, a reference count per page, and the list of pages each slot owns. Reference counts let the
  G rollouts of a GRPO group share the pages of their common prompt (`fork`); a page is copied only
  when a sequence is about to write into a page someone else still reads (`prepare_write`, i.e.
  copy-on-write).

Page 0 is reserved as a scratch ("trash") page: it is never handed out, unused page-table entries
point at it, and padded or finished positions write their K/V there. That keeps every scatter in
the jitted code unconditional (no data-dependent shapes) while never touching a live page.

Letters: S slots, P pages per sequence, L page size (tokens per page).
"""

from __future__ import annotations

import numpy as np

TRASH_PAGE = 0


class OutOfPagesError(RuntimeError):
    """Raised by the allocator when the pool has fewer free pages than asked for.

    The engine catches it and preempts (frees and later recomputes) a sequence; it never reaches a
    caller of `Engine.generate`.
    """


class PageAllocator:
    """Host-side page bookkeeping: free list, reference counts, pages per slot.

    Args:
      num_pages: pages in the pool, including the reserved scratch page 0.
      page_size: tokens per page (L).
      max_slots: sequence slots (S), i.e. rows of the page table.
      pages_per_seq: page-table columns (P); a sequence holds at most P * L tokens.
    """

    def __init__(self, num_pages: int, page_size: int, max_slots: int, pages_per_seq: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is scratch).")
        if page_size < 1 or max_slots < 1 or pages_per_seq < 1:
            raise ValueError(
                f"page_size={page_size}, max_slots={max_slots}, pages_per_seq={pages_per_seq} "
                "must all be positive."
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_slots = max_slots
        self.pages_per_seq = pages_per_seq
        self.refcount = np.zeros(num_pages, np.int32)  # i32[num_pages]
        self.refcount[TRASH_PAGE] = 1  # never freed, never handed out
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free = list(range(num_pages - 1, 0, -1))
        self.slot_pages: list[list[int]] = [[] for _ in range(max_slots)]
        self.lengths = np.zeros(max_slots, np.int32)  # i32[S]

    # -- pool ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Takes n pages off the free list with refcount 1; all or nothing."""
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if p == TRASH_PAGE or self.refcount[p] <= 0:
                raise ValueError(f"incref of page {p} that is not allocated")
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        """Drops one reference per page; pages reaching 0 go back on the free list."""
        for p in pages:
            if p == TRASH_PAGE or self.refcount[p] <= 0:
                raise ValueError(f"decref of page {p} that is not allocated (double free?)")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    # -- slots --------------------------------------------------------------------------------

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def attach(self, slot: int, pages: list[int], length: int) -> None:
        """Gives an empty slot `pages` (ownership of one reference each moves in) and a length."""
        if self.slot_pages[slot]:
            raise ValueError(f"slot {slot} is not empty")
        if len(pages) > self.pages_per_seq or self.pages_for(length) > len(pages):
            raise ValueError(f"{len(pages)} pages cannot hold {length} tokens in slot {slot}")
        self.slot_pages[slot] = list(pages)
        self.lengths[slot] = length

    def detach(self, slot: int) -> tuple[list[int], int]:
        """Empties a slot and returns (pages, length); the caller now owns those references."""
        pages, length = self.slot_pages[slot], int(self.lengths[slot])
        self.slot_pages[slot] = []
        self.lengths[slot] = 0
        return pages, length

    def release(self, slot: int) -> None:
        """Frees a slot: drops its references (shared pages stay alive for their other owners)."""
        pages, _ = self.detach(slot)
        self.decref(pages)

    def fork(self, src_slot: int, dst_slot: int, n_tokens: int) -> None:
        """Lets `dst_slot` share the pages holding the first `n_tokens` tokens of `src_slot`.

        No K/V is copied here; the partially filled last page is copied lazily by
        `prepare_write` the first time either slot writes into it.
        """
        if n_tokens > int(self.lengths[src_slot]):
            raise ValueError(
                f"fork of {n_tokens} tokens but slot {src_slot} holds {self.lengths[src_slot]}"
            )
        shared = self.slot_pages[src_slot][: self.pages_for(n_tokens)]
        self.incref(shared)
        self.attach(dst_slot, shared, n_tokens)

    def prepare_write(self, slot: int, start: int, end: int) -> list[tuple[int, int]]:
        """Makes positions [start, end) of `slot` writable; returns page copies (src, dst) to do.

        Missing pages are allocated; pages shared with another owner (refcount > 1) are replaced
        by a fresh page and must be copied on device before the write (copy-on-write). Raises
        OutOfPagesError, leaving the slot unchanged, if the pool cannot cover it.
        """
        if end <= start:
            return []
        if self.pages_for(end) > self.pages_per_seq:
            raise ValueError(
                f"slot {slot}: position {end - 1} exceeds the page table "
                f"({self.pages_per_seq} pages of {self.page_size})"
            )
        pages = self.slot_pages[slot]
        first, last = start // self.page_size, (end - 1) // self.page_size
        n_new = max(0, last + 1 - len(pages))
        shared = [i for i in range(first, min(last + 1, len(pages))) if self.refcount[pages[i]] > 1]
        fresh = self.alloc(n_new + len(shared))  # all-or-nothing, before any mutation
        copies = []
        for i, new in zip(shared, fresh[: len(shared)], strict=True):
            copies.append((pages[i], new))
            self.decref([pages[i]])
            pages[i] = new
        pages.extend(fresh[len(shared) :])
        return copies

    def set_length(self, slot: int, length: int) -> None:
        if self.pages_for(length) > len(self.slot_pages[slot]):
            raise ValueError(f"slot {slot} has no pages for length {length}")
        self.lengths[slot] = length

    def table(self) -> np.ndarray:
        """i32[S, P] page ids, TRASH_PAGE where unused."""
        out = np.full((self.max_slots, self.pages_per_seq), TRASH_PAGE, np.int32)
        for s, pages in enumerate(self.slot_pages):
            out[s, : len(pages)] = pages
        return out

    def check_invariants(self) -> None:
        """Refcounts equal the number of owners; free pages are exactly those with refcount 0.

        `extra_owners` (session caches etc.) are not visible here, so this only checks slots when
        nothing else holds pages; the engine calls `owned_counts` for the full check.
        """
        counts = self.owned_counts([])
        if not np.array_equal(counts, self.refcount):
            raise AssertionError(f"refcount mismatch: owned={counts}, refcount={self.refcount}")

    def owned_counts(self, extra: list[list[int]]) -> np.ndarray:
        counts = np.zeros(self.num_pages, np.int32)
        counts[TRASH_PAGE] = 1
        for pages in [*self.slot_pages, *extra]:
            np.add.at(counts, np.asarray(pages, np.int64), 1)
        free = set(self._free)
        if len(free) != len(self._free) or any(counts[p] for p in free):
            raise AssertionError("free list holds an owned or duplicated page")
        return counts
