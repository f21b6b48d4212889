"""CacheBlend's model-independent parts: segments, RoPE correction, token selection."""

from __future__ import annotations

import pytest
import torch

from lmcache.experimental.blend.rope import rotate_keys
from lmcache.experimental.blend.segments import Segment, find_separators, segment_salt, split_segments
from lmcache.experimental.blend.selection import kv_deviation, select_recompute

SEP = [7, 8]


def test_segments_are_the_documents_between_separators() -> None:
    tokens = [1, 2] + SEP + [10, 11, 12] + SEP + [20] + SEP + SEP + [30, 31]
    assert find_separators(tokens, SEP) == [2, 7, 10, 12]
    # The head [1, 2], the empty run between the last two separators and the tail are not segments.
    assert split_segments(tokens, SEP) == [Segment(4, 7), Segment(9, 10)]
    assert split_segments([1, 2, 3], SEP) == [] and split_segments(SEP + [1], SEP) == []
    assert find_separators([7, 7, 8, 7, 8, 8], SEP) == [1, 3]  # overlapping starts, not matches
    with pytest.raises(ValueError, match="separator"):
        split_segments([1], [])


def test_segment_salt_differs_from_the_prefix_salt() -> None:
    assert segment_salt("") != "" and segment_salt("lora") != segment_salt("")
    assert segment_salt("lora").startswith("lora")


def _rope_at(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, neox: bool) -> torch.Tensor:
    """The reference: rotate unrotated keys to absolute positions (what the model computes)."""
    return rotate_keys(keys, positions, inv_freq, neox)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot_dim", [16, 8])
def test_rotating_from_p_to_q_equals_computing_at_q(neox: bool, rot_dim: int) -> None:
    torch.manual_seed(0)
    head = 16
    raw = torch.randn(5, 2, head, dtype=torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    p = torch.tensor([0, 3, 100, 2047, 9])
    q = torch.tensor([1500, 3, 7, 0, 4000])
    at_p = _rope_at(raw, p, inv_freq, neox)
    moved = rotate_keys(at_p, q - p, inv_freq, neox)
    torch.testing.assert_close(moved, _rope_at(raw, q, inv_freq, neox), atol=2e-5, rtol=1e-5)
    # A real rotation: moving changes the keys, the untouched dimensions stay.
    assert not torch.allclose(moved[0], at_p[0], atol=1e-3)
    torch.testing.assert_close(moved[..., rot_dim:], at_p[..., rot_dim:])
    # Against the textbook NeoX formula at position 1 for the first pair.
    if neox and rot_dim == head:
        x = raw[0, 0]
        angle = float(inv_freq[0])
        c, s = torch.cos(torch.tensor(angle)), torch.sin(torch.tensor(angle))
        one = rotate_keys(raw[:1], torch.tensor([1]), inv_freq, True)[0, 0]
        half = rot_dim // 2
        torch.testing.assert_close(one[0], x[0] * c - x[half] * s)
        torch.testing.assert_close(one[half], x[half] * c + x[0] * s)


def test_rotate_keys_refuses_mismatched_shapes() -> None:
    inv_freq = torch.ones(4)
    with pytest.raises(ValueError, match="deltas"):
        rotate_keys(torch.zeros(3, 1, 8), torch.tensor([1, 2]), inv_freq, True)
    with pytest.raises(ValueError, match="rotary dim"):
        rotate_keys(torch.zeros(3, 1, 4), torch.tensor([1]), inv_freq, True)


def test_selection_takes_every_uncovered_token_and_the_top_ratio_of_reused() -> None:
    deviation = torch.tensor([0.0, 9.0, 1.0, 5.0, 3.0, 0.5, 7.0, 2.0])
    reused = torch.tensor([False, True, True, True, True, True, True, False])
    # 6 reused tokens, ratio 0.34 -> ceil(2.04) = 3 of them: deviations 9, 7, 5.
    assert select_recompute(deviation, reused, 0.34).tolist() == [0, 1, 3, 6, 7]
    assert select_recompute(deviation, reused, 0.0).tolist() == [0, 7]
    assert select_recompute(deviation, reused, 1.0).tolist() == list(range(8))
    assert select_recompute(deviation, reused, 0.5).tolist() == [0, 1, 3, 6, 7]
    ties = select_recompute(torch.zeros(4), torch.ones(4, dtype=torch.bool), 0.5)
    assert ties.tolist() == [0, 1]
    with pytest.raises(ValueError, match="blend_recompute_ratio"):
        select_recompute(deviation, reused, 1.5)


def test_kv_deviation_is_per_token_squared_distance() -> None:
    k = torch.zeros(3, 4)
    v = torch.zeros(3, 4)
    ck = k.clone()
    ck[1, 0] = 2.0
    cv = v.clone()
    cv[2] = 1.0
    assert kv_deviation(k, v, ck, cv).tolist() == [0.0, 4.0, 4.0]
