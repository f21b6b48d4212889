"""Model inputs for v0 tests, built by vLLM's own input builders from real `SequenceGroupMetadata`.

`build_cpu_input` drives the CPU runner's `ModelInputForCPUBuilder` (TorchSDPA metadata);
`build_flash_input` drives the GPU `FlashAttentionMetadataBuilder` with `InterDataForSeqGroup`
objects. Either builds the step vLLM would run for the given sequences when `computed[seq_id]`
prompt tokens are already in the KV cache, which makes them the oracle for the rebuild.
"""

from __future__ import annotations

import dataclasses
import random
import types
from typing import Dict, List, Optional

import torch

BLOCK = 16


@dataclasses.dataclass
class Seq:
    """A test sequence: its prompt, its blocks, and (for decodes) its generated tokens."""

    seq_id: int
    prompt: List[int]
    blocks: List[int]
    output: List[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: Optional[int] = None

    @property
    def is_prompt(self) -> bool:
        return not self.output


def make_seqs() -> List[Seq]:
    """A hit candidate (50), a short miss (20), a full-hit candidate (40); blocks scattered."""
    rng = random.Random(7)
    free = list(range(1, 40))
    rng.shuffle(free)

    def seq(seq_id: int, n: int, output: Optional[List[int]] = None) -> Seq:
        total = n + len(output or [])
        blocks = [free.pop() for _ in range(-(-total // BLOCK))]
        return Seq(seq_id, [rng.randrange(4, 1000) for _ in range(n)], blocks, output or [])

    return [seq(0, 50), seq(1, 20), seq(2, 40)]


def decode_seq() -> Seq:
    return Seq(9, list(range(100, 129)), [33, 34], output=[555])


# ---------------------------------------------------------------- CPU (vLLM's own builder)


def _seq_group(seq: Seq, computed: int, upto: Optional[int] = None):
    from vllm.sampling_params import SamplingParams
    from vllm.sequence import SequenceData, SequenceGroupMetadata

    data = SequenceData.from_seqs(seq.prompt, seq.output or None)
    if seq.is_prompt:
        if computed:
            data.update_num_computed_tokens(computed)
        chunk = (upto or len(seq.prompt)) - computed
    else:
        data.update_num_computed_tokens(data.get_len() - 1)
        chunk = 1
    return SequenceGroupMetadata(
        request_id=f"r{seq.seq_id}",
        is_prompt=seq.is_prompt,
        seq_data={seq.seq_id: data},
        sampling_params=SamplingParams(temperature=0.0, prompt_logprobs=seq.prompt_logprobs),
        block_tables={seq.seq_id: list(seq.blocks)},
        token_chunk_size=chunk,
        computed_block_nums=[],
        # vLLM samples only from the chunk that completes the prompt.
        do_sample=not seq.is_prompt or upto is None or upto == len(seq.prompt),
    )


def build_cpu_input(seqs: List[Seq], computed: Dict[int, int], chunked: bool, upto: Optional[Dict[int, int]] = None):
    """The model input vLLM's CPU runner builds for these sequences (a prompt's step computes
    tokens `[computed[id], upto[id])`, to the prompt's end by default)."""
    from vllm.attention.backends.torch_sdpa import TorchSDPABackend
    from vllm.model_executor import SamplingMetadata
    from vllm.worker.cpu_model_runner import ModelInputForCPUBuilder, ModelInputForCPUWithSamplingMetadata

    runner = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(chunked_prefill_enabled=chunked),
        cache_config=types.SimpleNamespace(enable_prefix_caching=False),
        _model_input_cls=ModelInputForCPUWithSamplingMetadata,
        attn_backend=TorchSDPABackend,
        sliding_window=None,
        block_size=BLOCK,
        device=torch.device("cpu"),
        lora_config=None,
        model_config=types.SimpleNamespace(uses_mrope=False),
    )
    groups = [_seq_group(s, computed.get(s.seq_id, 0), (upto or {}).get(s.seq_id)) for s in seqs]
    builder = ModelInputForCPUBuilder(runner)
    builder.prepare()
    builder.set_seq_group_list(groups)
    model_input = builder.build()
    sampling = SamplingMetadata.prepare(groups, model_input.seq_lens, model_input.query_lens, "cpu", pin_memory=False)
    return dataclasses.replace(model_input, sampling_metadata=sampling, is_prompt=groups[0].is_prompt)


def build_flash_input(builder_cls, seqs: List[Seq], computed: Dict[int, int], chunked: bool):
    """A GPU-runner model input for these sequences, its metadata from vLLM's flash builder."""
    from vllm.model_executor import SamplingMetadata
    from vllm.worker.model_runner import ModelInputForGPUBuilder, ModelInputForGPUWithSamplingMetadata

    inter_list, tokens, positions, seq_lens, query_lens = [], [], [], [], []
    for seq in seqs:
        full = seq.prompt + seq.output
        ctx = computed.get(seq.seq_id, 0) if seq.is_prompt else len(full) - 1
        inter = ModelInputForGPUBuilder.InterDataForSeqGroup(
            request_id=f"r{seq.seq_id}", seq_ids=[seq.seq_id], is_prompt=seq.is_prompt,
            block_tables={seq.seq_id: list(seq.blocks)}, computed_block_nums=[],
        )
        inter.input_tokens[0] = full[ctx:]
        inter.input_positions[0] = list(range(ctx, len(full)))
        inter.seq_lens[0] = inter.orig_seq_lens[0] = len(full)
        inter.query_lens[0] = len(full) - ctx
        inter.context_lens[0] = ctx
        inter_list.append(inter)
        tokens += full[ctx:]
        positions += list(range(ctx, len(full)))
        seq_lens.append(len(full))
        query_lens.append(len(full) - ctx)
    runner = types.SimpleNamespace(device=torch.device("cpu"), pin_memory=False)
    input_builder = types.SimpleNamespace(
        runner=runner, sliding_window=None, block_size=BLOCK,
        inter_data_list=inter_list, chunked_prefill_enabled=chunked,
    )
    builder = builder_cls(input_builder)
    builder.prepare()
    md = builder.build(seq_lens, query_lens, -1, len(seqs))
    groups = [_seq_group(s, computed.get(s.seq_id, 0)) for s in seqs]
    sampling = SamplingMetadata.prepare(groups, seq_lens, query_lens, "cpu", pin_memory=False)
    return ModelInputForGPUWithSamplingMetadata(
        input_tokens=torch.tensor(tokens), input_positions=torch.tensor(positions),
        seq_lens=seq_lens, query_lens=query_lens, attn_metadata=md, sampling_metadata=sampling,
        is_prompt=seqs[0].is_prompt,
    )


def assert_same_tensor(a: Optional[torch.Tensor], b: Optional[torch.Tensor], name: str) -> None:
    assert (a is None) == (b is None), name
    if a is not None:
        assert a.tolist() == b.tolist(), f"{name}: {a.tolist()} != {b.tolist()}"


def assert_cpu_inputs_equal(got, want) -> None:
    assert_same_tensor(got.input_tokens, want.input_tokens, "input_tokens")
    assert_same_tensor(got.input_positions, want.input_positions, "input_positions")
    assert got.seq_lens == want.seq_lens
    assert got.query_lens == want.query_lens
    g, w = got.attn_metadata, want.attn_metadata
    assert g.chunked_prefill and w.chunked_prefill
    for name in ("num_prefills", "num_prefill_tokens", "num_decode_tokens", "seq_lens", "max_query_len",
                 "max_kv_len", "max_decode_seq_len"):
        assert getattr(g, name) == getattr(w, name), name
    for name in ("slot_mapping", "prefill_query_start_loc", "kv_start_loc", "prefill_block_tables",
                 "seq_lens_tensor", "block_tables"):
        assert_same_tensor(getattr(g, name), getattr(w, name), name)
    assert_same_tensor(got.sampling_metadata.selected_token_indices, want.sampling_metadata.selected_token_indices,
                       "selected_token_indices")
    got_q = [sg.query_len for sg in got.sampling_metadata.seq_groups]
    want_q = [sg.query_len for sg in want.sampling_metadata.seq_groups]
    assert got_q == want_q
