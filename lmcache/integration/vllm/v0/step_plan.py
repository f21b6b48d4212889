"""What the v0 door does with one step, decided once: which prefills it serves, under which keys.

A prefill of a v0 step computes tokens `[c, s)` of its sequence (`c` tokens of context are in
vLLM's paged cache already: an earlier chunk of a chunked prefill, or vLLM's own prefix cache).
Its chunk keys hash the whole prefix `[0, s)`, so the door needs all `s` tokens, not only the
step's; and to load or store a chunk that straddles `c` it needs the slots of the context too:

```
  sequence   0 ............. floor(c/C)*C ...... c ................... s
  tokens     from vLLM's sequence data (driver)   | this step's input  |
  slots      vLLM's block table row               | this step's slots  |
  load       -1 for every token below c (vLLM has them), chunks from floor(c/C)*C
```

Operations:
- `plan_step(model_input) -> Optional[StepPlan]`: the plan (None for an attention backend
  `model_input` does not know).
- `StepPlans`: remembers the plan of the last step for vLLM's own v0 connector, which calls the
  door four times per step with the original and then the rebuilt input.

A prefill is served (`PrefillPlan.served`) when its salt is known (`cache_identity`; None for
inputs that shape KV beyond tokens and unnamed LoRA adapters) and its tokens and slots are:
a step from position 0 has them in its input on every worker; a later chunk needs the driver's
sequence data (other tensor-parallel workers only see the step's own tokens), so there it is
served on the driver only, and the cross-worker agreement on loaded tokens makes that a miss.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from lmcache.integration.vllm.request_identity import cache_identity
from lmcache.integration.vllm.v0.model_input import SeqSpan, StepLayout, prefill_block_row, read_step
from lmcache.logging import init_logger

logger = init_logger(__name__)


@functools.lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    logger.warning(message)


@dataclass
class PrefillPlan:
    """One prefill of the step, and what the door may do with it."""

    seq: SeqSpan
    # The cache salt of its keys; None when the sequence bypasses the cache.
    salt: Optional[str]
    # Tokens [0, seq_len) of the sequence (CPU, int64); None when unknown on this worker.
    tokens: Optional[torch.Tensor]
    # vLLM's block table row (None when vLLM left it out) and the slots of the step's own tokens.
    block_row: Optional[List[int]]
    step_slots: torch.Tensor
    # Whether a cached prefix may replace computation (False when the request wants prompt
    # logprobs, which need every prompt token computed).
    may_skip: bool
    # Whether this step computes the prompt's last token (so the trailing partial chunk is final).
    completes_prompt: bool
    # Tokens of this step's query whose KV was loaded from LMCache (set by the retrieve).
    loaded: int = 0

    @property
    def served(self) -> bool:
        has_context_slots = self.seq.context_len == 0 or self.block_row is not None
        return self.salt is not None and self.tokens is not None and has_context_slots

    def slots(self, block_size: int) -> torch.Tensor:
        """Slot of each token [0, seq_len) in vLLM's paged cache: the context's from the block
        table row, the step's own from its slot mapping."""
        context = self.seq.context_len
        if context == 0:
            return self.step_slots
        needed = -(-context // block_size)
        if self.block_row is None or len(self.block_row) < needed:
            raise ValueError(f"prefill {self.seq.index}: no block table row covers its {context} context tokens")
        blocks = torch.tensor(self.block_row[:needed], dtype=torch.long)
        offsets = torch.arange(block_size, dtype=torch.long)
        context_slots = (blocks[:, None] * block_size + offsets[None, :]).flatten()[:context]
        return torch.cat([context_slots.to(self.step_slots.device, self.step_slots.dtype), self.step_slots])


@dataclass
class StepPlan:
    """One step as vLLM built it, with the door's decision per prefill."""

    step: StepLayout
    prefills: List[PrefillPlan] = field(default_factory=list)

    @property
    def loaded(self) -> List[int]:
        return [p.loaded for p in self.prefills]


def _step_bypass_reason(model_input: Any) -> Optional[str]:
    """Why a whole step cannot use the cache, or None."""
    if getattr(model_input, "inputs_embeds", None) is not None:
        return "prompt embeddings"
    if getattr(model_input, "multi_modal_kwargs", None):
        return "multimodal inputs"
    if getattr(model_input, "token_types", None) is not None or getattr(model_input, "token_type_ids", None) is not None:
        return "token types"
    if getattr(model_input, "prompt_adapter_requests", None):
        return "prompt adapters"
    if getattr(model_input, "previous_hidden_states", None) is not None:
        return "speculative hidden states"
    positions = model_input.input_positions
    if positions is None or positions.dim() != 1:
        return "M-RoPE positions"
    return None


def _lora_salt(model_input: Any, token_index: int) -> Optional[str]:
    """The empty salt without LoRA, the adapter's identity for a LoRA sequence, None if unnamed."""
    mapping = getattr(model_input, "lora_mapping", None)
    if mapping is None or not mapping.index_mapping:
        return ""
    lora_id = mapping.index_mapping[token_index]
    if lora_id <= 0:
        return ""
    for request in getattr(model_input, "lora_requests", None) or ():
        if request.lora_int_id == lora_id:
            return cache_identity(lora_request=request).cache_salt
    return None


def _prompt_groups(model_input: Any, step: StepLayout) -> List[Any]:
    """vLLM's sampling groups of the prefills, in prefill order, when this worker has them (the
    driver does; other tensor-parallel workers get only the selected token indices)."""
    sampling = model_input.sampling_metadata
    groups = [g for g in (getattr(sampling, "seq_groups", None) or []) if g.is_prompt]
    if len(groups) != step.num_prefills:
        return []
    for group, seq in zip(groups, step.prefills):
        if group.seq_len != seq.seq_len or group.query_len != seq.query_len or len(group.seq_ids) != 1:
            return []
    return groups


def _sequence_tokens(group: Any, seq: SeqSpan, step_tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Tokens [0, seq_len) from vLLM's sequence data, checked against the step's own tokens."""
    data = group.seq_data[group.seq_ids[0]]
    tokens = torch.tensor(list(data.get_token_ids()[: seq.seq_len]), dtype=torch.long)
    if tokens.shape[0] != seq.seq_len or not torch.equal(tokens[seq.context_len :], step_tokens.to(torch.long)):
        warn_once("LMCache v0 door: a sequence's data does not match its step's tokens; that prefill bypasses the cache")
        return None
    return tokens


def plan_step(model_input: Any) -> Optional[StepPlan]:
    """The plan of a step as vLLM built it (no prefills for decode-only steps); None for attention
    backends `model_input` does not know."""
    step = read_step(model_input)
    if step is None:
        warn_once(
            f"LMCache v0 door: attention metadata {type(model_input.attn_metadata).__name__} is not "
            "supported (TorchSDPAMetadata, FlashAttentionMetadata are); the cache is bypassed"
        )
        return None
    plan = StepPlan(step)
    if step.num_prefills == 0:
        return plan
    reason = _step_bypass_reason(model_input)
    if reason is not None:
        warn_once(f"LMCache v0 door: steps with {reason} bypass the cache")
    slot_mapping = model_input.attn_metadata.slot_mapping
    input_tokens = model_input.input_tokens.cpu()
    selected = model_input.sampling_metadata.selected_token_indices.cpu() if model_input.sampling_metadata else None
    groups = _prompt_groups(model_input, step)
    for seq in step.prefills:
        step_slots = slot_mapping[seq.start : seq.end]
        salt = None if reason is not None else _lora_salt(model_input, seq.start)
        if salt is not None and bool((step_slots < 0).any()):
            salt = None  # tokens without a slot (sliding window, profiling) cannot be stored or loaded
        step_tokens = input_tokens[seq.start : seq.end]
        if groups:
            tokens = _sequence_tokens(groups[seq.index], seq, step_tokens)
        else:
            tokens = step_tokens.to(torch.long) if seq.context_len == 0 else None
        sampled = 0 if selected is None else int(((selected >= seq.start) & (selected < seq.end)).sum())
        if groups:
            completes = bool(groups[seq.index].do_sample)
        else:
            completes = selected is None or bool((selected == seq.end - 1).any())
        plan.prefills.append(
            PrefillPlan(
                seq=seq,
                salt=salt,
                tokens=tokens,
                block_row=prefill_block_row(model_input, step, seq.index) if seq.context_len else None,
                step_slots=step_slots,
                may_skip=sampled <= 1,
                completes_prompt=completes,
            )
        )
    return plan


class StepPlans:
    """The plan of the step in flight, found again from the input vLLM hands back.

    vLLM's own v0 connector asks the door about the original input (should retrieve, retrieve)
    and then the rebuilt one (should store, store); both map to one plan, so a step is planned
    once. Inputs are held weakly, and only the last step's are kept."""

    def __init__(self) -> None:
        self._inputs: List[weakref.ref] = []
        self._plan: Optional[StepPlan] = None

    def remember(self, model_input: Any, plan: Optional[StepPlan], *, same_step: bool = False) -> None:
        """Record `plan` for `model_input`; `same_step` adds an input to the current step's."""
        if not same_step:
            self._inputs = []
        try:
            self._inputs.append(weakref.ref(model_input))
        except TypeError:  # not a vLLM model input (a test's stand-in): planned again when asked
            return
        self._plan = plan

    def get(self, model_input: Any) -> Optional[StepPlan]:
        """The remembered plan of `model_input`, else a new one (remembered)."""
        if any(ref() is model_input for ref in self._inputs):
            return self._plan
        plan = plan_step(model_input)
        self.remember(model_input, plan)
        return plan
