"""Move rotary-embedded keys from one position to another.

RoPE rotates each pair of a key's dimensions by `position * inv_freq[i]`; rotations add, so a key
computed at position p becomes the key at position q by one more rotation of `q - p` (negative to
move a key back). Keys keep the model's layout: GPT-NeoX style pairs dimension i with i + d/2,
GPT-J style pairs 2i with 2i + 1.
"""

from __future__ import annotations

import torch


def rotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, is_neox_style: bool) -> torch.Tensor:
    """Keys `[T, heads, head_size]` rotated by `delta[t]` positions each (a new tensor).

    Only the first `2 * len(inv_freq)` dimensions of each head rotate (partial rotary)."""
    if keys.dim() != 3:
        raise ValueError(f"keys must be [tokens, heads, head_size], got shape {tuple(keys.shape)}")
    delta = torch.as_tensor(delta, dtype=torch.float64).reshape(-1)
    if delta.numel() == 1:
        delta = delta.expand(keys.shape[0])
    if delta.shape[0] != keys.shape[0]:
        raise ValueError(f"{delta.shape[0]} position deltas for {keys.shape[0]} keys")
    half = inv_freq.shape[0]
    rot_dim = 2 * half
    if rot_dim > keys.shape[-1]:
        raise ValueError(f"rotary dim {rot_dim} exceeds head_size {keys.shape[-1]}")
    # Angles in float64: a delta of thousands of positions keeps its precision.
    angles = delta[:, None] * inv_freq.to(torch.float64)[None, :]
    cos = angles.cos().to(keys.dtype)[:, None, :]
    sin = angles.sin().to(keys.dtype)[:, None, :]
    rot, rest = keys[..., :rot_dim], keys[..., rot_dim:]
    if is_neox_style:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)
