"""Per-step order statistics over ranks: the median step time and each rank's excess over its peers'
median (leaving the rank out)."""

from __future__ import annotations


import numpy as np




def _order_statistics(values: np.ndarray) -> np.ndarray:
    """Per step (column), over the ranks that know the value: the sorted values at (n-2)//2, (n-1)//2, n//2,
    (n+1)//2 (n: how many know it; NaN sorts last), as 4 rows; enough for the median of all and the median of
    the others seen from any rank (_peer_median); NaN where the position does not exist."""
    ordered = _transposed(values)
    ordered.sort(axis=1)  # along contiguous rows: about twice as fast
    count = values.shape[0] - np.count_nonzero(np.isnan(ordered), axis=1)
    rows = np.stack([(count - 2) // 2, (count - 1) // 2, count // 2, (count + 1) // 2])
    picked = np.take_along_axis(ordered, np.clip(rows, 0, max(values.shape[0] - 1, 0)).T, axis=1).T
    return np.where((rows >= 0) & (rows < count), picked, np.nan)


_TRANSPOSE_BAND = 64


def _transposed(values: np.ndarray) -> np.ndarray:
    """values.T, C-contiguous, copied in bands of ranks that stay in cache (a plain copy is ~10x slower)."""
    out = np.empty(values.shape[::-1], dtype=values.dtype)
    for first in range(0, values.shape[0], _TRANSPOSE_BAND):
        out[:, first:first + _TRANSPOSE_BAND] = values[first:first + _TRANSPOSE_BAND].T
    return out


def _median_of(order: np.ndarray) -> np.ndarray:
    """The median over all ranks of each step (float64)."""
    return (order[1].astype(np.float64) + order[2]) / 2.0


def _peer_median(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Per rank and step, the median of the other ranks' values (NaN: fewer than one other). Leaving the rank
    out matters at few ranks: of two, the median of both would halve a straggler's excess. Of the n - 1
    others' sorted values, positions (n-2)//2 and (n-1)//2 are the sorted values there when the rank sorts
    after them, else the next ones (equal values are interchangeable). Arithmetic on the two comparisons, not
    np.where: a where on a mask that is true for half the ranks costs ten times more; in place: each
    temporary of the block's size costs as much as the arithmetic."""
    below, middle, above, next_above = order
    at_or_above = values >= above
    lower = np.multiply(above - below, at_or_above)
    np.greater_equal(values, next_above, out=at_or_above)
    lower += np.multiply(next_above - middle, at_or_above)
    median = np.subtract(above + next_above, lower, out=lower)
    median /= np.float32(2.0)
    return median


def _excess_ms(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Each rank's value less its peers' median of the same step (NaN: unknown, or no peer knows it)."""
    peer = _peer_median(values, order)
    return np.subtract(values, peer, out=peer)


def _median(values: np.ndarray) -> float | None:
    values = values[~np.isnan(values)]
    return float(np.median(values)) if values.size else None
