"""Logits to probabilities: one pipeline for plain and speculative decoding.

Knows: temperature, top-k, top-p and min-p, applied in that order (the order of HF's
warpers), on host numpy arrays. Must not know: models, backends, drafters. Plain decoding and
verification both call `warp` so that speculative sampling follows the target's own
distribution exactly.
"""

from __future__ import annotations

import numpy as np

from app.core.types import SamplingParams


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[n, vocab] logits -> [n, vocab] float64 probabilities after every filter.

    Greedy params give the one-hot argmax rows, the distribution greedy decoding samples from.
    """
    x = np.asarray(logits, dtype=np.float64)
    squeeze = x.ndim == 1
    x = np.atleast_2d(x)
    if params.greedy:
        probs = np.zeros_like(x)
        probs[np.arange(len(x)), x.argmax(axis=-1)] = 1.0
        return probs[0] if squeeze else probs
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k, axis=-1)[:, -params.top_k, None]
        x = np.where(x < kth, -np.inf, x)
    probs = _softmax(x)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs.max(axis=-1, keepdims=True)
        probs = _renormalise(np.where(keep, probs, 0.0))
    return probs[0] if squeeze else probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a probability row (inverse CDF)."""
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, len(probs) - 1)


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest most-likely set whose mass reaches top_p (the top token always)."""
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    return _renormalise(np.where(keep, probs, 0.0))


def _renormalise(probs: np.ndarray) -> np.ndarray:
    return probs / probs.sum(axis=-1, keepdims=True)
