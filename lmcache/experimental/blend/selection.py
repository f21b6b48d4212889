"""Which tokens CacheBlend recomputes.

At the check layer every token's KV is computed fresh and compared with the reused one; the
reused tokens that deviate most (a `ratio` share of them) are recomputed from then on, with
every token no cached segment covers (head, separators, question, segments that missed).
"""

from __future__ import annotations

import math

import torch


def kv_deviation(fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor) -> torch.Tensor:
    """Squared distance between fresh and cached K and V, per token (`[T, hidden]` inputs)."""
    return ((fresh_k - cached_k).float() ** 2).sum(-1) + ((fresh_v - cached_v).float() ** 2).sum(-1)


def select_recompute(deviation: torch.Tensor, reused: torch.Tensor, ratio: float) -> torch.Tensor:
    """Sorted indices of the tokens to recompute: every token not `reused`, and the
    `ceil(ratio * reused.sum())` reused tokens of largest `deviation` (ties: the earlier token)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"blend_recompute_ratio={ratio!r}: must be within [0, 1]")
    if deviation.shape != reused.shape:
        raise ValueError(f"deviation shape {tuple(deviation.shape)} != reused shape {tuple(reused.shape)}")
    reused = reused.bool()
    reused_idx = torch.nonzero(reused).flatten()
    k = min(len(reused_idx), math.ceil(ratio * len(reused_idx) - 1e-9))
    picked = reused_idx.new_empty(0)
    if k > 0:
        # A stable sort on -deviation keeps the earlier token first among equals.
        order = torch.sort(-deviation[reused_idx].double(), stable=True).indices
        picked = reused_idx[order[:k]]
    always = torch.nonzero(~reused).flatten()
    return torch.sort(torch.cat((always, picked))).values
