"""Prefix caching for hybrids: the whole hybrid state at every block boundary of a prompt, reused by the next
request that starts with the same blocks.

An SSM state cannot be cut back to an earlier token the way a KV cache can, so a prefix cache that keeps one
state per prompt misses every request that shares only part of it. Here chunked prefill stops at every multiple
of ``block_size`` and snapshots the whole :class:`~hybridlm.HybridCache` (every layer: KV, SSM, conv windows,
running sums) there; a snapshot is keyed by a hash chain over the token blocks (``key_i = sha256(key_{i-1},
block_i)``), so a request restores the longest block-aligned prefix it shares with any earlier prompt and
prefills only the rest. Chunks are cut at absolute positions (every block boundary, then every
``prefill_chunk_size`` tokens inside a block), so a continuation after a hit runs exactly the forwards a cold
prefill runs and gives identical logits.

The contiguous KV layout's keys and values are stored once per block (a snapshot holds its own block's slots;
a restore concatenates those of its chain), so a prompt's snapshots cost its KV once plus one copy of the
fixed-size states per block. Eviction is least recently used first among the last snapshots of their chains
(a snapshot that a later block's snapshot depends on stays), so every stored snapshot can be restored.

>>> cache = PrefixCache(block_size=256, max_bytes=2**30)
>>> decoder = IncrementalDecoder(model, prefix_cache=cache)
>>> decoder.generate([system + question], max_new_tokens=32); decoder.stats["prefix_hit_tokens"]

Layouts whose outputs depend on where prefill is cut (``chunk_dependent``: H2O, KIVI, sinks + window) need a
``prefill_chunk_size`` that divides ``block_size``: prefill is then cut at every multiple of the chunk size, as
a decoder without a prefix cache cuts it, so turning the cache on changes no output. Any other chunk size is
refused under them (with other layouts the outputs agree to rounding).

Limits: the last prompt token is always prefilled (its logits start decoding), so a hit covers at most
``(length - 1) // block_size`` blocks; rows of a batch share one hit length (the longest prefix every row has
cached) and padded batches (prompts of different lengths) are refused, as are batches of several rows with
paged KV; a cache serves one model (layer kinds, state shapes and a fingerprint of the weights) under one cache
policy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterator

import torch

from hybridlm.cache import HybridCache, KVLayout
from hybridlm.decoding import prefix_cache_states as snapshots
from hybridlm.decoding.prefix_cache_files import (
    load_snapshots,
    policy_from_json,
    policy_json,
    read_snapshot_file,
    save_snapshots,
)

_SAMPLED_VALUES = 1024  # per weight tensor, in the model fingerprint


@dataclasses.dataclass
class _Entry:
    snapshot: HybridCache  # one batch row, every layer, after ``blocks`` blocks (KV: the last block's slots)
    blocks: int
    nbytes: int
    parent: str | None  # the key of the block before (None for the first block)


class PrefixCache:
    """Snapshots of the whole hybrid state at block boundaries, keyed by a hash chain over the token blocks,
    evicted least recently used first (chain tails only) once their bytes pass ``max_bytes``.

    ``block_size``: tokens per block (a snapshot is taken after each); ``max_bytes``: the budget, counted as the
    bytes every stored snapshot holds (its tensors as allocated; contiguous KV: its block's slots only). A budget
    below one block's snapshot is an error (raised when the cache meets its model)."""

    def __init__(self, block_size: int = 256, max_bytes: int = 2**30):
        for name, value in (("block_size", block_size), ("max_bytes", max_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PrefixCache: {name}={value!r} must be an integer >= 1")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._children: Counter[str] = Counter()  # stored snapshots of the next block, per key
        self._nbytes = 0
        self._identity: dict | None = None  # signature, weights fingerprint and policy of the model it serves
        self._model: weakref.ref | None = None
        self._one_row = False  # the model's cache has per-cache host-side tables (paged KV): batch 1 only
        self._kinds: tuple[str, ...] | None = None  # the state types of the caches it serves (static or not)
        self._chunk_dependent: list[str] = []  # the layouts whose outputs depend on where prefill is cut

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes held by all stored snapshots (never above ``max_bytes``)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return (f"PrefixCache(block_size={self.block_size}, {len(self)} snapshots, "
                f"{self.nbytes:,} of {self.max_bytes:,} bytes)")

    # --- the model it serves --------------------------------------------------------------------

    def bind(self, model, cache_policy=None) -> None:
        """Check that this cache can serve ``model`` under ``cache_policy`` (the first call fixes both): the same
        layer kinds and state shapes (``HybridCache.signature``), the same weights (a fingerprint) and policy, a
        state that can be snapshotted, and a budget that holds one block's snapshot."""
        if self._model is not None and self._model() is model and self._identity["policy"] == policy_json(
                cache_policy):
            return
        probe = model.new_cache(1, policy=cache_policy)
        for state in probe.states:
            snapshots.check_snapshottable(state)
        identity = {"signature": repr(probe.signature), "fingerprint": weights_fingerprint(model),
                    "policy": policy_json(cache_policy)}
        if self._identity is not None:
            _check_same_model(self._identity, identity)
        one_block = _predicted_nbytes(probe, self.block_size)
        if one_block > self.max_bytes:
            raise ValueError(self._budget_message(one_block))
        self._identity, self._model = identity, weakref.ref(model)
        self._one_row = any(snapshots.has_host_tables(state) for state in probe.states)
        self._chunk_dependent = sorted({type(part).__name__ for state in probe.states for part in snapshots.parts(state)
                                      if part.chunk_dependent})

    def check_chunking(self, prefill_chunk_size: int) -> None:
        """Under a layout whose outputs depend on where prefill is cut, ``prefill_chunk_size`` must divide
        ``block_size``, so that prefill cuts the same places with and without this cache (call :meth:`bind`
        first)."""
        if self._chunk_dependent and self.block_size % prefill_chunk_size:
            fits = max(d for d in range(1, min(prefill_chunk_size, self.block_size) + 1) if self.block_size % d == 0)
            raise ValueError(f"prefix_cache: the outputs of {', '.join(self._chunk_dependent)} depend on where prefill "
                             f"is cut, so prefill_chunk_size={prefill_chunk_size} must divide block_size="
                             f"{self.block_size} (prefill then cuts the same places with and without the prefix "
                             f"cache); use prefill_chunk_size={fits}")

    def _budget_message(self, one_block: int) -> str:
        return (f"PrefixCache: max_bytes={self.max_bytes:,} is below one block's snapshot ({one_block:,} bytes for "
                f"block_size={self.block_size} on this model); raise max_bytes or lower block_size")

    # --- keys -----------------------------------------------------------------------------------

    def block_keys(self, tokens: torch.Tensor) -> list[str]:
        """The hash-chain key of every full block of ``tokens [length]`` (one prompt row)."""
        keys, parent = [], b""
        data = tokens.detach().to("cpu", torch.int64).contiguous()
        for start in range(0, data.shape[0] - self.block_size + 1, self.block_size):
            block = data[start:start + self.block_size].numpy().tobytes()
            parent = hashlib.sha256(parent + block).digest()
            keys.append(parent.hex())
        return keys

    def cached_tokens(self, tokens) -> int:
        """How many leading tokens of one prompt (``tokens [length]``) have a snapshot (a multiple of
        ``block_size``; the recency order is left as it was)."""
        keys = self.block_keys(torch.as_tensor(tokens))
        return self.block_size * self._common_hit([keys], len(keys))

    def _common_hit(self, keys: list[list[str]], most: int) -> int:
        """The most blocks (at most ``most``) that every row has a snapshot of."""
        for blocks in range(most, 0, -1):
            if all(row[blocks - 1] in self._entries for row in keys):
                return blocks
        return 0

    # --- the decoder's prefill ------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, decoder, ids: torch.Tensor, mask: torch.Tensor | None, cache: HybridCache):
        """Prefill ``ids [batch, length]`` into the empty ``cache`` from the longest cached prefix, snapshotting
        every new block boundary; returns ``(cache, logits [batch, vocab])`` of the last position and sets
        ``decoder.stats["prefix_hit_tokens"]`` and ``["prefill_tokens"]`` (per row)."""
        self.bind(decoder.model, decoder.cache_policy)
        self.check_chunking(decoder.prefill_chunk_size)
        if mask is not None and not bool(mask.all()):
            raise ValueError("prefix_cache: prompts of different lengths (left-padded rows) are not supported; "
                             "pass prompts of one length, or one prompt per call")
        self._check_kinds(cache)
        if self._one_row and ids.shape[0] > 1:
            raise ValueError("prefix_cache: with paged KV (host-side block tables per cache) prefix caching takes "
                             f"one prompt per call, got a batch of {ids.shape[0]}")
        length = ids.shape[1]
        keys = [self.block_keys(row) for row in ids]
        hit = self._common_hit(keys, (length - 1) // self.block_size)
        if hit:
            self._restore(cache, [row[:hit] for row in keys])
        logits = None
        for start, stop in _chunks(hit * self.block_size, length, self.block_size, decoder.prefill_chunk_size):
            logits = decoder.model(ids[:, start:stop], cache=cache, logits_to_keep=1).logits
            if stop % self.block_size == 0:
                self._store(cache, [row[: stop // self.block_size] for row in keys])
        decoder.stats["prefix_hit_tokens"] = hit * self.block_size
        decoder.stats["prefill_tokens"] = length - hit * self.block_size
        return cache, logits[:, -1]

    def _check_kinds(self, cache: HybridCache) -> None:
        kinds = _kinds(cache)
        if self._kinds is None:
            self._kinds = kinds
        elif kinds != self._kinds:
            raise ValueError(f"prefix_cache: this decoder's caches hold {', '.join(kinds)} where the cached "
                             f"snapshots hold {', '.join(self._kinds)} (a compiled decoder's static caches, say); "
                             "use one PrefixCache per kind of cache")

    def _restore(self, cache: HybridCache, chains: list[list[str]]) -> None:
        """Load the snapshot at the end of each row's chain of keys into ``cache``, into its own buffers where
        they fit; the whole chain counts as used."""
        for chain in chains:
            for key in chain:
                self._entries.move_to_end(key)
        rows = [snapshots.assemble([self._entries[key].snapshot for key in chain]) for chain in chains]
        snapshot = rows[0] if len(rows) == 1 else snapshots.concat_rows(rows)
        cache.states = [snapshots.into_buffers(state, empty) for state, empty in zip(snapshot.states, cache.states)]
        cache.positions.copy_(snapshot.positions)
        cache.seen = snapshot.seen

    def _store(self, cache: HybridCache, chains: list[list[str]]) -> None:
        """Snapshot each row of ``cache`` under the last key of its chain (one key per block seen), unless it is
        stored already or the block before it is not (a chain is stored from its start)."""
        blocks = len(chains[0])
        for key in {chain[-1] for chain in chains} & self._entries.keys():
            self._entries.move_to_end(key)
        missing = [row for row, chain in enumerate(chains)
                   if chain[-1] not in self._entries and (blocks == 1 or chain[-2] in self._entries)]
        if not missing:
            return
        block = snapshots.block_snapshot(cache, first_slot=(blocks - 1) * self.block_size)
        for row in missing:
            snapshot = block if cache.batch_size == 1 else block.select(torch.tensor([row]))
            parent = chains[row][-2] if blocks > 1 else None
            self._add(chains[row][-1], _Entry(snapshot, blocks, snapshot.reserved_nbytes(), parent))

    def _add(self, key: str, entry: _Entry) -> None:
        if entry.nbytes > self.max_bytes:
            if entry.blocks == 1:
                raise ValueError(self._budget_message(entry.nbytes))
            return  # a block whose snapshot alone exceeds the budget: the chain ends before it
        self._insert(key, entry)
        self._evict()

    def _insert(self, key: str, entry: _Entry) -> None:
        self._entries[key] = entry
        self._nbytes += entry.nbytes
        if entry.parent is not None:
            self._children[entry.parent] += 1

    def _evict(self) -> None:
        """Drop snapshots, least recently used first, until the budget holds; only the last snapshot of a chain
        (one no later block depends on) can go, so every stored snapshot keeps its whole chain."""
        while self._nbytes > self.max_bytes:
            key = next(key for key in self._entries if not self._children[key])
            entry = self._entries.pop(key)
            self._nbytes -= entry.nbytes
            del self._children[key]
            if entry.parent is not None:
                self._children[entry.parent] -= 1

    # --- disk -----------------------------------------------------------------------------------

    def save(self, path) -> None:
        """Write every snapshot to a safetensors file; the keys, sizes, model identity and per-state metadata go
        into its metadata as JSON (nothing is pickled)."""
        if self._identity is None:
            raise ValueError("PrefixCache.save: the cache has not served a model yet (nothing to save)")
        header = {"block_size": self.block_size, "max_bytes": self.max_bytes, **self._identity, "kinds": self._kinds}
        save_snapshots(path, header, [(key, entry.blocks, entry.parent, entry.snapshot)
                                      for key, entry in self._entries.items()])

    @classmethod
    def load(cls, path, model, max_bytes: int | None = None) -> PrefixCache:
        """A cache saved by :meth:`save`, for ``model`` (it must be the model the snapshots were taken from:
        same layer kinds, state shapes and weights); ``max_bytes`` replaces the saved budget."""
        header, tensors = read_snapshot_file(path)  # one read: another process may save the same path
        cache = cls(header["block_size"], header["max_bytes"] if max_bytes is None else max_bytes)
        cache._identity = {name: header[name] for name in ("signature", "fingerprint", "policy")}
        policy = policy_from_json(header["policy"])
        try:
            cache.bind(model, policy)
            template = model.new_cache(1, policy=policy)
            if header["kinds"] is not None and list(_kinds(template)) != header["kinds"]:
                # a compiled decoder's static caches: rebuilt on a static template (all fields come from the file)
                template = model.new_cache(1, max_length=1, policy=policy, static=True)
            cache._check_kinds(template)
        except ValueError as error:
            raise ValueError(f"PrefixCache.load: {path}: {error}") from None
        for key, blocks, parent, snapshot in load_snapshots(path, header, tensors, template):
            cache._insert(key, _Entry(snapshot, blocks, snapshot.reserved_nbytes(), parent))
        cache._evict()  # once all are in, so that no snapshot goes before the later blocks that need it
        return cache


def bind_prefix_cache(prefix_cache, model, cache_policy, prefill_chunk_size: int) -> PrefixCache | None:
    """What ``IncrementalDecoder(prefix_cache=...)`` keeps: None, or a :class:`PrefixCache` checked against
    ``model``, ``cache_policy`` and the decoder's ``prefill_chunk_size``."""
    if prefix_cache is None:
        return None
    if not isinstance(prefix_cache, PrefixCache):
        raise TypeError(f"prefix_cache must be a hybridlm.PrefixCache, got {type(prefix_cache).__name__}")
    prefix_cache.bind(model, cache_policy)
    prefix_cache.check_chunking(prefill_chunk_size)
    return prefix_cache


def weights_fingerprint(model) -> str:
    """sha256 over every weight's name, shape, dtype and up to 1,024 evenly spaced values: tells two models of
    one shape apart without reading all of a large model's weights."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLED_VALUES)][:_SAMPLED_VALUES].to("cpu").contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _chunks(start: int, stop: int, block: int, chunk: int) -> Iterator[tuple[int, int]]:
    """Spans covering ``[start, stop)``, cut at every multiple of ``block`` and every ``chunk`` tokens inside a
    block: the cuts depend on absolute positions only, so prefill from any block boundary repeats the cold run."""
    while start < stop:
        block_start = start - start % block
        next_cut = block_start + ((start - block_start) // chunk + 1) * chunk
        end = min(stop, block_start + block, next_cut)
        yield start, end
        start = end


def _kinds(cache: HybridCache) -> tuple[str, ...]:
    """The state types of ``cache``, part by part (what tells a static cache from a growing one)."""
    return tuple(type(part).__name__ for state in cache.states for part in snapshots.parts(state))


def _check_same_model(stored: dict, current: dict) -> None:
    if stored["signature"] != current["signature"]:
        raise ValueError("PrefixCache: its snapshots come from another model (the layer kinds or state shapes of "
                         "HybridCache.signature differ from this model's)")
    if stored["fingerprint"] != current["fingerprint"]:
        raise ValueError("PrefixCache: its snapshots come from another model (same shapes, different weights)")
    if stored["policy"] != current["policy"]:
        raise ValueError(f"PrefixCache: its snapshots were taken under cache_policy={stored['policy']}, this "
                         f"decoder uses cache_policy={current['policy']}")


def _predicted_nbytes(probe: HybridCache, tokens: int) -> int:
    """Bytes of a one-row snapshot after ``tokens`` tokens (KV layouts by their formula; a layout without one
    counts as empty, so this is a lower bound then)."""
    total = probe.positions.numel() * probe.positions.element_size()
    for state in probe.states:
        for part in snapshots.parts(state):
            try:
                total += part.predicted_nbytes(tokens) if isinstance(part, KVLayout) else part.nbytes()
            except NotImplementedError:
                total += part.nbytes()
    return total


