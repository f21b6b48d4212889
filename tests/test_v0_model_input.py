"""v0 model-input rebuild: what `rebuild_model_input` makes equals what vLLM's own input builders
make for the same sequences when the skipped tokens are already computed.

vLLM's real builders are the oracle: the CPU `ModelInputForCPUBuilder` (with the TorchSDPA
metadata builder) driven by real `SequenceGroupMetadata`, and the GPU `FlashAttentionMetadataBuilder`
driven by real `InterDataForSeqGroup` objects (flash-attention's kernels are not in the CPU build;
only the two kernel names its module imports are provided, the metadata classes are vLLM's own).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import List

import pytest
import torch

from v0_inputs import (
    BLOCK,
    assert_cpu_inputs_equal,
    assert_same_tensor,
    build_cpu_input,
    build_flash_input,
    decode_seq,
    make_seqs,
)

from lmcache.integration.vllm.v0.model_input import (
    CPU_SDPA,
    FLASH_ATTN,
    block_table_from_slots,
    read_step,
    rebuild_model_input,
)

@pytest.mark.parametrize("chunked", [False, True])
def test_cpu_rebuild_matches_vllms_builder_for_hit_miss_and_full_hit(chunked):
    seqs = make_seqs()
    skips = {0: 32, 1: 0, 2: 39}
    original = build_cpu_input(seqs, {}, chunked)
    step = read_step(original)
    assert step.backend == CPU_SDPA
    assert [(s.start, s.query_len, s.seq_len) for s in step.prefills] == [(0, 50, 50), (50, 20, 20), (70, 40, 40)]
    rebuilt = rebuild_model_input(original, step, [skips[s.seq_id] for s in seqs], BLOCK)
    oracle = build_cpu_input(seqs, skips, chunked=True)
    assert_cpu_inputs_equal(rebuilt, oracle)
    # The original is untouched (vLLM may still hold it).
    assert original.input_tokens.shape[0] == 110


def test_cpu_rebuild_keeps_decodes_of_a_mixed_batch():
    seqs = make_seqs() + [decode_seq()]
    skips = {0: 16, 1: 0, 2: 39}
    original = build_cpu_input(seqs, {}, chunked=True)
    step = read_step(original)
    assert step.num_decode_tokens == 1 and not step.seqs[-1].is_prefill and step.seqs[-1].seq_len == 30
    rebuilt = rebuild_model_input(original, step, [skips[s.seq_id] for s in seqs[:3]], BLOCK)
    oracle = build_cpu_input(seqs, skips, chunked=True)
    assert_cpu_inputs_equal(rebuilt, oracle)


def test_read_step_sees_context_of_a_later_chunk():
    seqs = make_seqs()
    partial = build_cpu_input(seqs, {0: 16}, chunked=True)
    step = read_step(partial)
    assert [s.context_len for s in step.prefills] == [16, 0, 0]


def test_no_skip_returns_the_same_object_and_bad_skips_raise():
    seqs = make_seqs()
    original = build_cpu_input(seqs, {}, chunked=False)
    step = read_step(original)
    assert rebuild_model_input(original, step, [0, 0, 0], BLOCK) is original
    with pytest.raises(ValueError, match="cannot skip 50"):
        rebuild_model_input(original, step, [50, 0, 0], BLOCK)
    with pytest.raises(ValueError, match="skip counts"):
        rebuild_model_input(original, step, [1], BLOCK)


def test_prompt_logprob_positions_cannot_be_skipped():
    seqs = make_seqs()
    seqs[0].prompt_logprobs = 1
    original = build_cpu_input(seqs, {}, chunked=False)
    step = read_step(original)
    with pytest.raises(ValueError, match="logits are needed"):
        rebuild_model_input(original, step, [16, 0, 0], BLOCK)


def test_block_table_from_slots():
    slots = torch.tensor([5 * BLOCK + i for i in range(BLOCK)] + [2 * BLOCK + i for i in range(3)])
    assert block_table_from_slots(slots, BLOCK) == [5, 2]
    with pytest.raises(ValueError):
        block_table_from_slots(slots[1:], BLOCK)
    with pytest.raises(ValueError):
        block_table_from_slots(torch.tensor([-1] * 4), BLOCK)


# ---------------------------------------------------------------- GPU flash-attention metadata


@pytest.fixture(scope="module")
def flash_builder_cls():
    """vLLM's FlashAttentionMetadataBuilder; its module imports two kernels the CPU build lacks."""
    import vllm.vllm_flash_attn as fa

    def no_kernel(*args, **kwargs):
        raise AssertionError("no flash-attention kernel runs in these tests")

    added = [n for n in ("flash_attn_varlen_func", "flash_attn_with_kvcache") if not hasattr(fa, n)]
    for name in added:
        setattr(fa, name, no_kernel)
    try:
        from vllm.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    except ImportError as exc:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"flash-attention backend module does not import here: {exc}")
    yield FlashAttentionMetadataBuilder
    for name in added:
        delattr(fa, name)
    sys.modules.pop("vllm.attention.backends.flash_attn", None)


def assert_flash_inputs_equal(got, want) -> None:
    assert_same_tensor(got.input_tokens, want.input_tokens, "input_tokens")
    assert_same_tensor(got.input_positions, want.input_positions, "input_positions")
    assert got.query_lens == want.query_lens and got.seq_lens == want.seq_lens
    g, w = got.attn_metadata, want.attn_metadata
    for name in ("num_prefills", "num_prefill_tokens", "num_decode_tokens", "seq_lens", "max_query_len",
                 "max_decode_query_len", "max_prefill_seq_len", "max_decode_seq_len", "use_cuda_graph"):
        assert getattr(g, name) == getattr(w, name), name
    for name in ("slot_mapping", "seq_lens_tensor", "query_start_loc", "seq_start_loc", "context_lens_tensor",
                 "block_tables"):
        assert_same_tensor(getattr(g, name), getattr(w, name), name)
    # The derived prefill/decode views agree too (the rebuilt object must not reuse stale ones).
    for view in ("prefill_metadata", "decode_metadata"):
        gv, wv = getattr(g, view), getattr(w, view)
        assert (gv is None) == (wv is None), view
        if gv is not None:
            for name in ("slot_mapping", "query_start_loc", "block_tables", "seq_lens_tensor"):
                assert_same_tensor(getattr(gv, name), getattr(wv, name), f"{view}.{name}")
    assert_same_tensor(got.sampling_metadata.selected_token_indices, want.sampling_metadata.selected_token_indices,
                       "selected_token_indices")


@pytest.mark.parametrize("chunked", [False, True])
def test_flash_rebuild_matches_vllms_builder(flash_builder_cls, chunked):
    seqs = make_seqs()
    skips = {0: 32, 1: 0, 2: 39}
    original = build_flash_input(flash_builder_cls, seqs, {}, chunked)
    if not chunked:
        # vLLM leaves prompt block tables empty here: the rebuild must derive them.
        assert original.attn_metadata.block_tables.numel() == 0
    original.attn_metadata.prefill_metadata  # populate vLLM's cached view of the old metadata
    step = read_step(original)
    assert step.backend == FLASH_ATTN
    rebuilt = rebuild_model_input(original, step, [skips[s.seq_id] for s in seqs], BLOCK)
    oracle = build_flash_input(flash_builder_cls, seqs, skips, chunked=True)
    assert_flash_inputs_equal(rebuilt, oracle)


def test_flash_rebuild_mixed_batch_with_decode(flash_builder_cls):
    seqs = make_seqs() + [decode_seq()]
    skips = {0: 48, 1: 0, 2: 0}
    original = build_flash_input(flash_builder_cls, seqs, {}, chunked=True)
    step = read_step(original)
    assert step.num_decode_tokens == 1
    rebuilt = rebuild_model_input(original, step, [48, 0, 0], BLOCK)
    oracle = build_flash_input(flash_builder_cls, seqs, skips, chunked=True)
    assert_flash_inputs_equal(rebuilt, oracle)


def test_lora_token_mapping_follows_the_kept_tokens():
    from vllm.lora.layers import LoRAMapping

    seqs = make_seqs()
    original = build_cpu_input(seqs, {}, chunked=False)
    ids: List[int] = []
    for seq, lora in zip(seqs, (1, 0, 2)):
        ids += [lora] * len(seq.prompt)
    original = dataclasses.replace(original, lora_mapping=LoRAMapping(tuple(ids), (1, 0, 2), is_prefill=True))
    step = read_step(original)
    rebuilt = rebuild_model_input(original, step, [32, 0, 39], BLOCK)
    assert rebuilt.lora_mapping.index_mapping == tuple([1] * 18 + [0] * 20 + [2])
    assert rebuilt.lora_mapping.prompt_mapping == (1, 0, 2)
    assert rebuilt.lora_mapping.is_prefill


def test_unknown_metadata_is_not_read():
    seqs = make_seqs()
    original = build_cpu_input(seqs, {}, chunked=False)

    class OtherMetadata:
        num_prefills = 3
        num_prefill_tokens = 110
        num_decode_tokens = 0

    assert read_step(dataclasses.replace(original, attn_metadata=OtherMetadata())) is None
