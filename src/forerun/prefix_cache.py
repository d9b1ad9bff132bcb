"""Prompt prefixes shared between requests, reused exactly.

A server sees the same prompt prefixes again and again: a system prompt, the earlier turns of a
chat, a client retrying. The batch engine prefills every prompt in fixed chunks aligned to
position 0 (``CHUNK`` positions each, the last one shorter), and a chunk's keys and values
depend only on the tokens up to its end and on the chunk's length: the same tokens computed the
same way give the same bits. So the cache stores the keys and values (and the drafter's features,
for trained heads) of each chunk under a digest of every token up to the chunk's end plus the
chunk's length, and a later prompt that starts with the same tokens takes its chunks from the
cache instead of computing them. What comes out is exactly what the prefill would have computed:
output does not depend on which requests came before.

Entries are evicted least recently used first once their bytes pass ``max_bytes``. ``prefill``
is the one prefill of the project: ``Engine`` and ``BatchEngine`` both call it, so a prompt's
cache holds the same bits whichever path served it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

CHUNK = 128  # positions per prefill chunk: a prefix is shared in whole chunks (and a whole prompt's last one)


def chunk_bounds(n: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """The (start, end) of each prefill chunk of an n-position prompt."""
    chunk = chunk or CHUNK
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def chunk_keys(tokens: list[int], chunk: int | None = None) -> list[bytes]:
    """One key per chunk of ``tokens``: a digest of every token up to the chunk's end, chained, so
    that equal keys mean equal prefixes (and equal chunk lengths)."""
    return [key for _, key in _each_key(tokens, chunk)]


def _each_key(tokens: list[int], chunk: int | None = None):
    """``chunk_keys`` one at a time, with each chunk's bounds: a walk that stops at the first chunk
    the cache lacks hashes no further."""
    h = b""
    for s, e in chunk_bounds(len(tokens), chunk):
        d = hashlib.blake2b(h, digest_size=16)
        d.update((e - s).to_bytes(4, "little"))
        d.update(torch.tensor(tokens[s:e], dtype=torch.int64, device="cpu").numpy().tobytes())
        h = d.digest()
        yield (s, e), h


@dataclass
class Entry:
    kv: tuple  # the backend's kv_segment of the chunk
    features: torch.Tensor | None  # the drafter's feature layers at the chunk's positions, where it reads them
    nbytes: int


class PrefixCache:
    """Least-recently-used chunks of prompt keys and values, bounded in bytes (thread-safe)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0  # chunks
        self.hit_positions = 0  # prompt positions not computed thanks to the cache
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Entry | None:
        with self._lock:
            e = self.entries.get(key)
            if e is None:
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            self.hits += 1
            self.hit_positions += e.kv[0].shape[2]
            return e

    def cached_positions(self, tokens: list[int]) -> int:
        """How many leading positions of ``tokens`` ``prefill`` would take from the cache (whole
        chunks, in order); neither a hit nor a miss is counted."""
        n = 0
        for (_, e), key in _each_key(tokens):  # hashed up to the first chunk it lacks (a draft's unread, each round)
            if not self.holds(key):
                break
            n = e
        return n

    def holds(self, key: bytes) -> bool:
        """Whether the chunk named ``key`` is held (neither a hit nor a miss counted)."""
        with self._lock:
            return key in self.entries

    def put(self, key: bytes, kv: tuple, features: torch.Tensor | None = None) -> None:
        n = sum(t.numel() * t.element_size() for t in kv)
        if features is not None:
            n += features.numel() * features.element_size()
        if n > self.max_bytes:
            return
        with self._lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self.entries[key] = Entry(kv, features, n)
            self.bytes += n
            while self.bytes > self.max_bytes:
                _, e = self.entries.popitem(last=False)
                self.bytes -= e.nbytes

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.bytes = 0


def keep_chunks(backend, tokens: list[int], cache: PrefixCache) -> int:
    """Put the whole chunks of ``tokens`` that ``backend`` holds keys and values for (positions 0..
    its length, never the last token's: a sequence's last committed token is fed by its next step,
    and its position may still hold a rejected draft's) into ``cache`` where it lacks them: a
    finished sequence's prompt and answer, for a prompt that starts with them (a chat's next turn).
    The number of chunks put."""
    n = min(backend.length, len(tokens) - 1)
    put = 0
    for (s, e), key in _each_key(tokens[:n]):
        if e - s < CHUNK:
            break
        if cache.holds(key):
            continue
        cache.put(key, backend.kv_segment(s, e))
        put += 1
    return put


def prefill(backend, feed: list[int], layers=(), take_features=None, cache: PrefixCache | None = None) -> None:
    """Run ``feed`` (a prompt but its last token) into ``backend``'s cache from position 0.

    On backends that can copy their cache (``kv_segments``) the prompt runs in ``CHUNK``-position
    chunks, each taken from ``cache`` where an earlier prompt computed it; elsewhere in one pass.
    ``layers``/``take_features``: a trained head's feature layers, handed over per chunk."""
    fwd = {"layers": tuple(layers)} if layers else {}
    if not feed:
        return
    if not backend.capabilities.kv_segments:
        passed = backend.forward(torch.tensor(feed, dtype=torch.long, device=backend.device), 0, last_only=True, **fwd)
        if layers:
            take_features(0, passed.layers)
        return
    keys = chunk_keys(feed) if cache is not None else None
    for j, (s, e) in enumerate(chunk_bounds(len(feed))):
        hit = cache.get(keys[j]) if cache is not None else None
        if hit is not None:
            backend.load_kv_segment(s, hit.kv)
            feats = hit.features
        else:
            feats = backend.forward(torch.tensor(feed[s:e], dtype=torch.long, device=backend.device), s, last_only=True, logits=False,
                                    **fwd).layers
            if cache is not None:
                cache.put(keys[j], backend.kv_segment(s, e), feats)
        if layers:
            take_features(s, feats)
