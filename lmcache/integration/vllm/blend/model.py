"""vLLM's Llama modules called one layer at a time, as CacheBlend needs them.

A decoder layer is split where CacheBlend has to look inside it: `project` (input norm, QKV
projection, rotary embedding) gives this layer's fresh K and V, the blender mixes them with the
reused KV and attends (`attend`), and `finish` (output projection, post-attention norm, MLP)
gives the next layer's input. The same modules run as in vLLM's own forward pass, so a token
recomputed here gets the KV vLLM would give it; norms, activation and rotary embedding take their
fused kernels (`vllm_compat.fused_forward`), as vLLM's compiled forward fuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

from lmcache.integration.vllm.vllm_compat import fused_forward, rotary_inv_freq

# Queries per attention call: bounds the [heads, queries, keys] score tensor, and lets early
# blocks skip the keys after their last query.
QUERY_BLOCK = 128


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention geometry (the same on every Llama layer)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scaling: float

    @property
    def kv_hidden(self) -> int:
        return self.num_kv_heads * self.head_size


class LlamaBlendModel:
    """Layer-by-layer access to a vLLM `LlamaForCausalLM` (this worker's layers)."""

    def __init__(self, causal_lm: Any) -> None:
        inner = causal_lm.model
        self._inner = inner
        self.layers = list(inner.layers[inner.start_layer : inner.end_layer])
        attn = self.layers[0].self_attn
        self.shape = AttentionShape(attn.num_heads, attn.num_kv_heads, attn.head_dim, float(attn.scaling))
        self.inv_freq = rotary_inv_freq(attn.rotary_emb)
        self.is_neox_style = bool(attn.rotary_emb.is_neox_style)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._inner.get_input_embeddings(token_ids)

    def project(
        self, index: int, hidden: torch.Tensor, residual: Optional[torch.Tensor], positions: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `index`'s (q, k, v, residual) for these tokens; q and k rotated at `positions`."""
        layer = self.layers[index]
        norm = fused_forward(layer.input_layernorm)
        if residual is None:
            residual = hidden
            hidden = norm(hidden)
        else:
            hidden, residual = norm(hidden, residual)
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(hidden)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = fused_forward(attn.rotary_emb)(positions, q, k)  # in place, in qkv
        return q, k, v, residual

    def finish(self, index: int, attn_out: torch.Tensor, residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s output (hidden, residual) from its attention output."""
        layer = self.layers[index]
        hidden, _ = layer.self_attn.o_proj(attn_out)
        hidden, residual = fused_forward(layer.post_attention_layernorm)(hidden, residual)
        mlp = layer.mlp
        gate_up, _ = mlp.gate_up_proj(hidden)
        hidden, _ = mlp.down_proj(fused_forward(mlp.act_fn)(gate_up))
        return hidden, residual

    def attend(self, q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Causal attention of queries `[n, heads*head]` at sorted `positions` over the KV
        `[T, kv_hidden]` of tokens 0..T-1 (token j is visible to a query at position p when j <= p)."""
        s = self.shape
        group = s.num_heads // s.num_kv_heads
        # NOTE: torch's fast CPU kernel takes 4-D inputs with as many K/V heads as query heads;
        # 3-D or grouped (`enable_gqa`) inputs fall back to a kernel about 4x slower here.
        k = keys.view(-1, s.num_kv_heads, s.head_size).transpose(0, 1).repeat_interleave(group, 0)[None]
        v = values.view(-1, s.num_kv_heads, s.head_size).transpose(0, 1).repeat_interleave(group, 0)[None]
        total, n = keys.shape[0], q.shape[0]
        if n and int(positions[0]) + n == total and int(positions[-1]) == total - 1:
            return self._attend_tail(q, k, v)
        out = torch.empty(n, s.num_heads * s.head_size, dtype=q.dtype)
        key_pos = torch.arange(total)
        for lo in range(0, n, QUERY_BLOCK):
            hi = min(lo + QUERY_BLOCK, n)
            qb = q[lo:hi].reshape(hi - lo, s.num_heads, s.head_size).transpose(0, 1)[None]
            # Keys beyond the block's last query are masked anyway: leave them out.
            visible = int(positions[hi - 1]) + 1
            mask = (key_pos[None, :visible] <= positions[lo:hi, None])[None, None]
            ob = F.scaled_dot_product_attention(qb, k[:, :, :visible], v[:, :, :visible], attn_mask=mask, scale=s.scaling)
            out[lo:hi] = ob[0].transpose(0, 1).reshape(hi - lo, -1)
        return out

    def _attend_tail(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The queries are every token from some position to the last (a full layer): one causal
        call, which skips the masked half without a mask, instead of masked blocks. Queries of the
        tokens before them (vLLM's own prefix hit) are zero rows whose outputs are dropped."""
        s = self.shape
        total, n = k.shape[2], q.shape[0]
        qs = q.reshape(n, s.num_heads, s.head_size)
        if n < total:
            qs = torch.cat((qs.new_zeros(total - n, s.num_heads, s.head_size), qs))
        out = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], k, v, is_causal=True, scale=s.scaling)
        return out[0, :, total - n :].transpose(0, 1).reshape(n, -1)
