"""The blender's layer pieces: attention (causal over the mixed KV, grouped-query heads, any subset
of queries, or every token from a position on) and vLLM's fused kernels against the native forms."""

from __future__ import annotations

import pytest
import torch

from lmcache.integration.vllm.blend.model import QUERY_BLOCK, AttentionShape, LlamaBlendModel


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


def _model(shape: AttentionShape) -> LlamaBlendModel:
    model = object.__new__(LlamaBlendModel)
    model.shape = shape
    return model


def test_attend_matches_a_plain_causal_gqa_attention_for_a_query_subset() -> None:
    torch.manual_seed(0)
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_size=8, scaling=8**-0.5)
    model = _model(shape)
    tokens = 3 * QUERY_BLOCK + 40  # several query blocks
    keys = torch.randn(tokens, shape.kv_hidden)
    values = torch.randn(tokens, shape.kv_hidden)
    positions = torch.tensor(sorted(torch.randperm(tokens)[: 2 * QUERY_BLOCK + 7].tolist()))
    q = torch.randn(len(positions), shape.num_heads * shape.head_size)
    got = model.attend(q, positions, keys, values)
    torch.testing.assert_close(got, reference(q, positions, keys, values, shape), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("start", [0, 5, 2 * QUERY_BLOCK + 3])
def test_attend_for_every_token_from_a_position_on_is_the_same_causal_attention(start: int) -> None:
    """A full layer (the first, or ratio 1.0) takes one causal call; vLLM's own prefix hit leaves
    the first `start` tokens without queries."""
    torch.manual_seed(1)
    shape = AttentionShape(num_heads=4, num_kv_heads=1, head_size=8, scaling=0.3)
    tokens = 3 * QUERY_BLOCK + 11
    keys = torch.randn(tokens, shape.kv_hidden)
    values = torch.randn(tokens, shape.kv_hidden)
    positions = torch.arange(start, tokens)
    q = torch.randn(len(positions), shape.num_heads * shape.head_size)
    got = _model(shape).attend(q, positions, keys, values)
    torch.testing.assert_close(got, reference(q, positions, keys, values, shape), atol=1e-5, rtol=1e-4)


@pytest.mark.vllm
def test_fused_forwards_match_vllms_native_forms(tiny_model) -> None:
    """What the blender calls (`fused_forward`) computes what vLLM's modules compute natively, on
    the strided q/k views of a fused QKV projection too."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from lmcache.integration.vllm.vllm_compat import fused_forward, is_legacy_vllm

    if not is_legacy_vllm():
        pytest.skip("CacheBlend runs on vLLM 0.9.2")
    torch.manual_seed(2)
    # vLLM's custom ops pick their forward from the current config when built.
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=str(tiny_model), dtype="float32"))):
        norm, act = RMSNorm(64, eps=1e-5), SiluAndMul()
        rope = get_rope(32, rotary_dim=32, max_position=4096, base=10000, is_neox_style=True)
    norm.weight.data.normal_()
    x, res = torch.randn(7, 64), torch.randn(7, 64)
    torch.testing.assert_close(fused_forward(norm)(x.clone()), norm.forward_native(x.clone()))
    got, want = fused_forward(norm)(x.clone(), res.clone()), norm.forward_native(x.clone(), res.clone())
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    gate_up = torch.randn(7, 128)
    torch.testing.assert_close(fused_forward(act)(gate_up), act.forward_native(gate_up))
    positions = torch.tensor([0, 1, 5, 100, 1000, 4000, 7])
    q, k, _ = torch.randn(7, 4 * 32 + 2 * 32).split([4 * 32, 32, 32], dim=-1)  # strided views
    want = rope.forward_native(positions, q.clone(), k.clone())
    got = fused_forward(rope)(positions, q, k)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
