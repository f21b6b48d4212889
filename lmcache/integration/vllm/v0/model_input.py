"""Reading and rebuilding vLLM v0 model inputs so a step computes only what LMCache did not load.

A v0 step flattens its sequences into one token stream, prefills first, then decodes:

```
input_tokens   | prefill 0 (q0 tokens) | prefill 1 (q1) | ... | decode 0 | decode 1 | ...
positions      | c0 .. c0+q0-1         | c1 .. c1+q1-1  |     | s-1      | s-1      |
                 ^ start 0               ^ start q0
```
`c` is the context already in vLLM's paged cache, `q` the query (tokens computed this step),
`s = c + q` the sequence length. When LMCache loads the KV of the first `k` tokens of a prefill
into their slots, the step must compute only the other `q - k`: the rebuilt input drops those
tokens from the stream and, per sequence, moves `k` from query to context.

Operations:
- `read_step(model_input)`: the per-sequence spans (`StepLayout`) from the attention metadata,
  which every worker has (vLLM broadcasts it; `model_input.seq_lens` exists on the driver only).
  `None` for attention backends this module does not know.
- `prefill_block_row(model_input, step, index)`: vLLM's block table row of one prefill.
- `rebuild_model_input(model_input, step, skips, block_size)`: a new model input with the first
  `skips[i]` tokens of prefill `i` removed: tokens, positions, slot mapping, attention metadata
  (query/sequence lengths, start locations, context lengths, block tables, token counts), the
  sampling metadata's selected token indices, the LoRA token mapping and `query_lens`.

Attention metadata handled: vLLM's CPU `TorchSDPAMetadata` (the prefix-aware `chunked_prefill`
path, IPEX's paged varlen attention, is switched on and fed block tables) and the GPU
`FlashAttentionMetadata` (its prefix path reads K/V through the block tables).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from lmcache.integration.vllm.vllm_compat import FLASH_METADATA_VIEW_RESETS

CPU_SDPA = "TorchSDPAMetadata"
FLASH_ATTN = "FlashAttentionMetadata"
SUPPORTED_METADATA = (CPU_SDPA, FLASH_ATTN)


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of a step as the flattened model input holds it."""

    # Position in the batch (prefills come first).
    index: int
    # Offset of the sequence's first token of this step in `input_tokens`.
    start: int
    # Tokens computed this step.
    query_len: int
    # Tokens of the sequence once this step is done (context + query).
    seq_len: int
    is_prefill: bool

    @property
    def end(self) -> int:
        return self.start + self.query_len

    @property
    def context_len(self) -> int:
        """Tokens already in vLLM's paged cache before this step."""
        return self.seq_len - self.query_len


@dataclass(frozen=True)
class StepLayout:
    """All sequences of one step, in input order."""

    seqs: List[SeqSpan]
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    # Class name of the attention metadata (one of SUPPORTED_METADATA).
    backend: str

    @property
    def prefills(self) -> List[SeqSpan]:
        return self.seqs[: self.num_prefills]

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def _lens_from_start_loc(start_loc: torch.Tensor, count: int) -> List[int]:
    values = start_loc[: count + 1].tolist()
    return [b - a for a, b in zip(values[:-1], values[1:])]


def read_step(model_input: Any) -> Optional[StepLayout]:
    """The step's sequence spans, or None when the attention metadata is of an unknown kind."""
    md = model_input.attn_metadata
    if md is None:
        return None
    backend = type(md).__name__
    if backend not in SUPPORTED_METADATA:
        return None
    num_prefills = int(md.num_prefills)
    num_prefill_tokens = int(md.num_prefill_tokens)
    num_decode_tokens = int(md.num_decode_tokens)
    if backend == CPU_SDPA:
        seq_lens = list(md.seq_lens or [])[:num_prefills]
        if md.chunked_prefill and num_prefill_tokens > 0:
            query_lens = _lens_from_start_loc(md.prefill_query_start_loc, num_prefills)
        else:
            # Without the chunked path nothing is ever in the cache before a prompt step.
            query_lens = list(seq_lens)
        # The CPU runner schedules exactly one token per decoding sequence.
        decode_query_lens = [1] * num_decode_tokens
        # With decodes present, the CPU builder puts only their lengths in seq_lens_tensor.
        decode_seq_lens = md.seq_lens_tensor.tolist() if num_decode_tokens else []
    else:
        num_seqs = len(md.seq_lens) if md.seq_lens is not None else int(md.seq_lens_tensor.shape[0])
        all_query_lens = _lens_from_start_loc(md.query_start_loc, num_seqs)
        all_seq_lens = list(md.seq_lens) if md.seq_lens is not None else md.seq_lens_tensor.tolist()
        seq_lens, query_lens = all_seq_lens[:num_prefills], all_query_lens[:num_prefills]
        decode_seq_lens, decode_query_lens = all_seq_lens[num_prefills:], all_query_lens[num_prefills:]
    if len(seq_lens) != num_prefills or sum(query_lens) != num_prefill_tokens:
        raise ValueError(
            f"{backend}: {num_prefills} prefills with {num_prefill_tokens} tokens do not match "
            f"seq_lens {seq_lens} / query lens {query_lens}"
        )
    seqs: List[SeqSpan] = []
    start = 0
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        seqs.append(SeqSpan(i, start, q, s, True))
        start += q
    for j, (q, s) in enumerate(zip(decode_query_lens, decode_seq_lens)):
        seqs.append(SeqSpan(num_prefills + j, start, q, s, False))
        start += q
    return StepLayout(seqs, num_prefills, num_prefill_tokens, num_decode_tokens, backend)


def block_table_from_slots(slots: torch.Tensor, block_size: int) -> List[int]:
    """The blocks holding a sequence whose slots for positions 0.. are `slots` (slot = block*bs + off).

    Raises ValueError when the slots are not those of a sequence starting at position 0 of its
    first block (a skipped token, or a slot mapping that does not start a block).
    """
    heads = slots[::block_size]
    if bool((slots < 0).any()) or bool((heads % block_size != 0).any()):
        raise ValueError("slot mapping does not cover the sequence from its first block's first slot")
    return (heads // block_size).tolist()


def prefill_block_row(model_input: Any, step: StepLayout, index: int) -> Optional[List[int]]:
    """vLLM's block table row of prefill `index` (None when vLLM left it out: the CPU builder
    fills prefill block tables only for its prefix-aware path; a row of a sequence with context
    is always there). Used to find the slots of a later chunk's context."""
    md = model_input.attn_metadata
    table = _vllm_block_table(md, step.backend)
    if table is None or table.numel() == 0 or index >= table.shape[0]:
        return None
    return table[index].tolist()


def _vllm_block_table(md: Any, backend: str) -> Optional[torch.Tensor]:
    if backend == CPU_SDPA:
        return md.prefill_block_tables if md.chunked_prefill else None
    return md.block_tables


def _padded_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    table = torch.zeros((len(rows), width), dtype=torch.int32)
    for i, row in enumerate(rows):
        if row:
            table[i, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
    return table.to(device)


def _table_rows(table: Optional[torch.Tensor], count: int) -> List[List[int]]:
    if table is None or table.numel() == 0:
        return [[] for _ in range(count)]
    return [row for row in table[:count].tolist()]


def _prefill_block_rows(
    step: StepLayout, original: Optional[torch.Tensor], slot_mapping: torch.Tensor, block_size: int
) -> List[List[int]]:
    """Block table rows of the prefills: rebuilt from the slot mapping for sequences that start at
    position 0 (vLLM leaves their rows empty unless chunked prefill or its prefix cache is on),
    taken from vLLM's table for the others (which vLLM always fills)."""
    rows = _table_rows(original, step.num_prefills)
    for seq in step.prefills:
        if seq.context_len == 0:
            rows[seq.index] = block_table_from_slots(slot_mapping[seq.start : seq.end], block_size)
        elif not rows[seq.index]:
            raise ValueError(f"prefill {seq.index} has context {seq.context_len} but no block table")
    return rows


def _cumsum0(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        torch.cumsum(torch.tensor(list(lengths), dtype=torch.int32), dim=0, out=out[1:])
    return out.to(device)


def _rebuild_cpu_sdpa(md: Any, step: StepLayout, new_q: List[int], keep_idx: torch.Tensor, block_size: int) -> Any:
    device = md.slot_mapping.device
    prefills = step.prefills
    seq_lens = [s.seq_len for s in prefills]
    rows = _prefill_block_rows(step, _vllm_block_table(md, CPU_SDPA), md.slot_mapping, block_size)
    return dataclasses.replace(
        md,
        # The prefix-aware path attends over context in the paged cache plus the new tokens.
        chunked_prefill=True,
        num_prefill_tokens=sum(new_q),
        slot_mapping=md.slot_mapping[keep_idx],
        seq_lens=seq_lens,
        max_query_len=max(new_q),
        max_kv_len=max(seq_lens),
        prefill_query_start_loc=_cumsum0(new_q, device),
        kv_start_loc=_cumsum0(seq_lens, device),
        prefill_block_tables=_padded_table(rows, device),
    )


def _rebuild_flash(md: Any, step: StepLayout, new_q: List[int], keep_idx: torch.Tensor, block_size: int) -> Any:
    device = md.slot_mapping.device
    decodes = step.seqs[step.num_prefills :]
    all_q = new_q + [s.query_len for s in decodes]
    prefill_rows = _prefill_block_rows(step, md.block_tables, md.slot_mapping, block_size)
    decode_rows = [] if not decodes else md.block_tables[step.num_prefills :].tolist()
    context = torch.tensor(
        [s.seq_len - q for s, q in zip(step.prefills, new_q)], dtype=torch.int32
    ).to(device)
    if decodes and md.context_lens_tensor is not None:
        context = torch.cat([context, md.context_lens_tensor[step.num_prefills :].to(context.dtype)])
    return dataclasses.replace(
        md,
        num_prefill_tokens=sum(new_q),
        slot_mapping=md.slot_mapping[keep_idx],
        max_query_len=max(all_q),
        query_start_loc=_cumsum0(all_q, device),
        context_lens_tensor=context,
        block_tables=_padded_table(prefill_rows + decode_rows, device),
        # Views derived from the old fields; vLLM recomputes them on first use.
        **FLASH_METADATA_VIEW_RESETS,
    )


_REBUILDERS = {CPU_SDPA: _rebuild_cpu_sdpa, FLASH_ATTN: _rebuild_flash}


def _rebuild_sampling(sampling_metadata: Any, keep: torch.Tensor, step: StepLayout, skips: Sequence[int]) -> Any:
    if sampling_metadata is None:
        return None
    selected = sampling_metadata.selected_token_indices
    keep_dev = keep.to(selected.device)
    if not bool(keep_dev[selected].all()):
        raise ValueError("a token whose logits are needed would be skipped")
    new_index = torch.cumsum(keep_dev.to(torch.long), dim=0) - 1
    rebuilt = copy.copy(sampling_metadata)
    rebuilt.selected_token_indices = new_index[selected].to(selected.dtype)
    groups = sampling_metadata.seq_groups
    prompt_groups = [g for g in groups or [] if g.is_prompt]
    if groups and len(prompt_groups) == step.num_prefills:
        by_id = {id(g): skip for g, skip in zip(prompt_groups, skips)}
        rebuilt.seq_groups = [
            dataclasses.replace(g, query_len=g.query_len - by_id[id(g)]) if by_id.get(id(g)) else g
            for g in groups
        ]
    return rebuilt


def rebuild_model_input(model_input: Any, step: StepLayout, skips: Sequence[int], block_size: int) -> Any:
    """A copy of `model_input` in which prefill `i` computes only its last `q_i - skips[i]` tokens.

    `skips` has one entry per prefill; each must be 0 or less than that prefill's query length
    (a step always computes at least the last token, whose logits are sampled).
    """
    if len(skips) != step.num_prefills:
        raise ValueError(f"{len(skips)} skip counts for {step.num_prefills} prefills")
    for seq, skip in zip(step.prefills, skips):
        if skip < 0 or (skip and skip >= seq.query_len):
            raise ValueError(f"prefill {seq.index}: cannot skip {skip} of its {seq.query_len} tokens")
    if not any(skips):
        return model_input
    tokens = model_input.input_tokens
    if tokens.shape[0] != step.num_tokens:
        raise ValueError(f"input has {tokens.shape[0]} tokens, the attention metadata {step.num_tokens}")
    keep = torch.ones(step.num_tokens, dtype=torch.bool)
    for seq, skip in zip(step.prefills, skips):
        keep[seq.start : seq.start + skip] = False
    keep_idx = torch.nonzero(keep, as_tuple=False).squeeze(1)
    new_q = [seq.query_len - skip for seq, skip in zip(step.prefills, skips)]
    md = model_input.attn_metadata
    changes = {
        "input_tokens": tokens[keep_idx.to(tokens.device)],
        "input_positions": model_input.input_positions[keep_idx.to(model_input.input_positions.device)],
        "attn_metadata": _REBUILDERS[step.backend](
            md, step, new_q, keep_idx.to(md.slot_mapping.device), block_size
        ),
        "sampling_metadata": _rebuild_sampling(model_input.sampling_metadata, keep, step, skips),
    }
    if model_input.query_lens is not None:
        changes["query_lens"] = new_q + list(model_input.query_lens[step.num_prefills :])
    lora_mapping = getattr(model_input, "lora_mapping", None)
    if lora_mapping is not None:
        kept = keep_idx.tolist()
        changes["lora_mapping"] = dataclasses.replace(
            lora_mapping, index_mapping=tuple(lora_mapping.index_mapping[i] for i in kept)
        )
    return dataclasses.replace(model_input, **changes)
