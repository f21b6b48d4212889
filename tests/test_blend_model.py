"""The blender's attention: causal over the mixed KV, grouped-query heads, any subset of queries."""

from __future__ import annotations

import torch

from lmcache.integration.vllm.blend_model import QUERY_BLOCK, AttentionShape, LlamaBlendModel


def reference(q, positions, keys, values, shape: AttentionShape) -> torch.Tensor:
    out = []
    group = shape.num_heads // shape.num_kv_heads
    for i, p in enumerate(positions.tolist()):
        heads = []
        for h in range(shape.num_heads):
            qh = q[i].view(shape.num_heads, shape.head_size)[h]
            kh = keys[: p + 1].view(-1, shape.num_kv_heads, shape.head_size)[:, h // group]
            vh = values[: p + 1].view(-1, shape.num_kv_heads, shape.head_size)[:, h // group]
            weights = torch.softmax((kh @ qh) * shape.scaling, dim=0)
            heads.append(weights @ vh)
        out.append(torch.cat(heads))
    return torch.stack(out)


def test_attend_matches_a_plain_causal_gqa_attention_for_a_query_subset() -> None:
    torch.manual_seed(0)
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_size=8, scaling=8**-0.5)
    model = object.__new__(LlamaBlendModel)
    model.shape = shape
    tokens = 3 * QUERY_BLOCK + 40  # several query blocks
    keys = torch.randn(tokens, shape.kv_hidden)
    values = torch.randn(tokens, shape.kv_hidden)
    positions = torch.tensor(sorted(torch.randperm(tokens)[: 2 * QUERY_BLOCK + 7].tolist()))
    q = torch.randn(len(positions), shape.num_heads * shape.head_size)
    got = model.attend(q, positions, keys, values)
    torch.testing.assert_close(got, reference(q, positions, keys, values, shape), atol=1e-5, rtol=1e-4)
