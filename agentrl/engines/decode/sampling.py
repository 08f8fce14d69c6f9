"""Device-side sampling whose randomness is keyed per request, not by batch composition or arrival order.

Each request carries a 62-bit ``key`` (derived on the host by :func:`request_key` from the engine seed, the
caller's seed and the request's identity) and each of its tokens a ``counter`` (its index in the
completion). The uniform number that draws token ``counter`` of a request is a pure function of
``(key, counter)`` (:func:`uniforms`: a counter-based hash, no generator state), so a request samples the
same tokens whatever rows share its batch, in whatever order requests arrived, on CPU and GPU alike
(given the same logits).

A token is drawn by inverting the CDF of the sampling distribution with that one uniform
(:func:`sample_tokens`): ``softmax(logits / T)`` restricted to the top-k / nucleus top-p set when those
are on. The reported log-prob is the engine's documented contract: ``log softmax(logits / T)`` at the
sampled id, *without* the top-k/top-p truncation (the distribution the trainer recomputes), and for
greedy rows (``T == 0``: argmax) ``log softmax(logits)``.

All functions are plain tensor ops with no host synchronisation, so they run inside a CUDA graph.
"""

from __future__ import annotations

import hashlib

import torch

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1


def request_key(*parts: object) -> int:
    """A 62-bit key from ``parts`` (ints, strings, ``None``): the same parts give the same key on every
    machine and Python process (blake2b of their ``repr``, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` and a constant ``c < 2**32``, without int64
    overflow (the product is split in 16-bit halves of ``c``)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in ``[0, 2**32)``."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniforms(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """One uniform float32 in ``[0, 1 - 2**-24]`` per row: a hash of ``key`` (int64 ``[N]``, 62-bit) and
    ``counter`` (int64 ``[N]``, >= 0). Same inputs, same outputs, on any device."""
    k1 = key & MASK32
    k2 = (key >> 32) & MASK32
    h = _fmix32(k1 ^ _mul32(counter & MASK32, _GOLDEN))
    h = _fmix32(h ^ k2 ^ _mul32((counter >> 32) & MASK32, 0x85EBCA77))
    h = _fmix32(h ^ 0x27D4EB2F)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def truncate(scaled: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
             k_cap: int) -> torch.Tensor:
    """``scaled`` ([N, V] float32) with ids outside each row's top-k / nucleus set set to ``-inf``.

    ``top_k``: int64 ``[N]`` (0 = off for that row), all <= ``k_cap``; ties at the k-th value are kept.
    ``top_p``: float32 ``[N]`` (>= 1 = off): an id is dropped when the probability mass strictly before
    it (in descending order) already reaches ``top_p``; the most likely id is always kept."""
    if top_k is not None:
        k = min(int(k_cap), scaled.shape[-1])
        values = torch.topk(scaled, k, dim=-1).values
        kth = values.gather(1, (top_k.clamp(1, k) - 1)[:, None])
        kth = torch.where((top_k > 0)[:, None], kth, torch.full_like(kth, float("-inf")))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    key: torch.Tensor,
    counter: torch.Tensor,
    *,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    k_cap: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one id per row; returns ``(ids int64 [N], logprobs float32 [N])``.

    Args:
        logits: ``[N, V]`` (any float dtype; computed in float32).
        temperature: float32 ``[N]``; ``0`` = greedy (argmax, the first maximum).
        key, counter: int64 ``[N]``; see :func:`uniforms`.
        top_k, top_p, k_cap: optional truncation (see :func:`truncate`); ``None`` = off for every row.

    The log-prob is ``log_softmax(logits / T)`` at the returned id (``T = 1`` for greedy rows), the
    distribution before truncation (see the module docstring)."""
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
    n, v = logits.shape
    probs = torch.empty((n, -(-v // BLOCK) * BLOCK), dtype=torch.float32, device=logits.device)
    probs[:, v:].zero_()  # whole blocks for invert_cdf, without a padding copy of the vocabulary
    if top_k is None and top_p is None:
        torch.exp(logp_all, out=probs[:, :v])
    else:
        probs[:, :v] = torch.softmax(truncate(scaled, top_k, top_p, k_cap), dim=-1)
    drawn = invert_cdf(probs, uniforms(key, counter), v)
    ids = torch.where(greedy, logits.argmax(-1), drawn)
    return ids, logp_all.gather(1, ids[:, None]).squeeze(1)


BLOCK = 1024


def invert_cdf(probs: torch.Tensor, u: torch.Tensor, v: int | None = None) -> torch.Tensor:
    """For each row of ``probs`` (``[N, V']``, non-negative; ids from ``v`` on, if given, have mass 0), the
    first id whose cumulative mass exceeds ``u * total`` (``u`` ``[N]`` in ``[0, 1)``): a draw from the row's
    distribution.

    Two levels, so that no scan runs over the whole vocabulary (a long innermost-dimension ``cumsum`` is
    slow on GPUs): the block of :data:`BLOCK` ids holding the target is found from the cumulative block
    sums, then the id inside it from that block's own cumulative sum. Float rounding can put the target
    past the last id with mass; the row's most likely id is taken then."""
    n, width = probs.shape
    v = width if v is None else v
    blocks = -(-width // BLOCK)
    if blocks * BLOCK != width:
        probs = torch.nn.functional.pad(probs, (0, blocks * BLOCK - width))
    tiles = probs.view(n, blocks, BLOCK)
    block_sum = tiles.sum(-1)  # [N, blocks]
    block_cdf = torch.cumsum(block_sum, dim=-1)
    target = u[:, None] * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks - 1)  # [N, 1]
    before = block_cdf.gather(1, block) - block_sum.gather(1, block)
    inner = tiles.gather(1, block[:, :, None].expand(n, 1, BLOCK)).squeeze(1)  # [N, BLOCK]
    inner_cdf = torch.cumsum(inner, dim=-1) + before
    offset = torch.searchsorted(inner_cdf, target, right=True).clamp_(max=BLOCK - 1)
    drawn = (block * BLOCK + offset).clamp_(max=v - 1)
    return torch.where(probs.gather(1, drawn) > 0, drawn, probs[:, :v].argmax(-1, keepdim=True)).squeeze(1)
