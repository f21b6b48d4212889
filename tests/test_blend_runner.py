"""The blender's layer loop (`Blender._run_layers`) on a toy model with `LlamaBlendModel`'s
interface: which tokens each layer computes and which KV each token ends with, per ratio."""

from __future__ import annotations

import math

import pytest
import torch

from lmcache.integration.vllm.blend.model import AttentionShape, LlamaBlendModel
from lmcache.integration.vllm.blend.runner import Blender

LAYERS, HIDDEN, VOCAB = 4, 16, 50
SHAPE = AttentionShape(num_heads=2, num_kv_heads=1, head_size=8, scaling=8**-0.5)


class ToyModel:
    """Random layers with `LlamaBlendModel`'s split (project / attend / finish); the attention is
    the blender's own. Records how many tokens each `project` call got."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        qkv = SHAPE.num_heads * SHAPE.head_size + 2 * SHAPE.kv_hidden
        self.emb = torch.randn(VOCAB, HIDDEN, generator=g)
        self.w_qkv = [torch.randn(HIDDEN, qkv, generator=g) * 0.5 for _ in range(LAYERS)]
        self.w_out = [torch.randn(SHAPE.num_heads * SHAPE.head_size, HIDDEN, generator=g) for _ in range(LAYERS)]
        self.attention = object.__new__(LlamaBlendModel)
        self.attention.shape = SHAPE
        self.projected: list[int] = []

    num_layers = LAYERS

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[ids]

    def project(self, index, hidden, residual, positions):
        self.projected.append(len(positions))
        residual = hidden if residual is None else hidden + residual
        qkv = torch.tanh(residual) @ self.w_qkv[index]
        q, k, v = qkv.split([SHAPE.num_heads * SHAPE.head_size, SHAPE.kv_hidden, SHAPE.kv_hidden], -1)
        return q, k + 0.1 * positions[:, None], v, residual  # keys depend on the position, as with RoPE

    def attend(self, q, positions, keys, values):
        return self.attention.attend(q, positions, keys, values)

    def finish(self, index, out, residual):
        return out @ self.w_out[index], residual


TOKENS = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1))
# Tokens 0-3 (head), 12 and 23 are no document's; the rest reused: 18 tokens.
REUSED = torch.ones(24, dtype=torch.bool)
REUSED[[0, 1, 2, 3, 12, 23]] = False


def blend(ratio: float, cached: torch.Tensor, reused: torch.Tensor = REUSED) -> tuple[torch.Tensor, int, list[int]]:
    model = ToyModel()
    kv = cached.clone()
    kept = Blender(None, None, 16, ratio)._run_layers(model, TOKENS, 0, kv, reused)  # type: ignore[arg-type]
    return kv, kept, model.projected


@pytest.fixture(scope="module")
def fresh() -> torch.Tensor:
    """Every layer's KV of a full prefill (no token reused)."""
    kv, kept, _ = blend(1.0, torch.zeros(2, LAYERS, 24, SHAPE.kv_hidden), torch.zeros(24, dtype=torch.bool))
    assert kept == 24
    return kv


@pytest.fixture(scope="module")
def cached(fresh) -> torch.Tensor:
    """The reused tokens' KV as cached in another context: off the fresh KV by a per-token amount
    (reused tokens 5, 9 and 17 by far the most at the check layer); the rest are not read."""
    off = torch.randn(fresh.shape, generator=torch.Generator().manual_seed(2)) * 0.1
    off[:, 1, [5, 9, 17]] *= 100
    return fresh + off


def test_ratio_zero_is_naive_reuse_no_reused_token_is_computed(fresh, cached):
    kv, kept, projected = blend(0.0, cached)
    uncovered = int((~REUSED).sum())
    assert kept == uncovered
    assert projected == [uncovered] * LAYERS  # no check layer: the reused tokens never enter a layer
    assert torch.equal(kv[:, :, REUSED], cached[:, :, REUSED])
    # The uncovered tokens attend over the cached KV, so from the second layer on they differ.
    torch.testing.assert_close(kv[:, 0, ~REUSED], fresh[:, 0, ~REUSED])
    assert not torch.allclose(kv[:, 1:, ~REUSED], fresh[:, 1:, ~REUSED])


def test_a_ratio_keeps_fresh_kv_up_to_the_check_layer_and_the_most_deviating_tokens_after_it(fresh, cached):
    ratio = 0.15
    kv, kept, projected = blend(ratio, cached)
    picked = math.ceil(ratio * int(REUSED.sum()))
    assert picked == 3 and kept == int((~REUSED).sum()) + picked
    assert projected == [24, 24, kept, kept]
    # The first layer and the check layer are computed for every token: their KV is the fresh one.
    torch.testing.assert_close(kv[:, :2], fresh[:, :2])
    # After it the recomputed tokens are those that deviated most (5, 9, 17) and the uncovered;
    # every other reused token keeps its cached KV.
    recomputed = ~REUSED
    recomputed[[5, 9, 17]] = True
    assert torch.equal(kv[:, 2:, ~recomputed], cached[:, 2:, ~recomputed])
    assert not torch.allclose(kv[:, 2:, [5, 9, 17]], cached[:, 2:, [5, 9, 17]])


def test_ratio_one_is_the_full_prefill(fresh, cached):
    kv, kept, projected = blend(1.0, cached)
    assert kept == 24 and projected == [24] * LAYERS
    torch.testing.assert_close(kv, fresh)
