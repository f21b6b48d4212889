"""CacheBlend on the scheduler side: which prompts blend, what their segments are, and when the
worker blends (`BlendStep.load`) or stores segments (`BlendStep.store`).

A prompt blends when it has at least `blend_min_tokens` tokens and one segment (a document
between two separators, see `lmcache.experimental.blend.segments`). For such a prompt the
prefix lookup is replaced by one lookup per segment (under `segment_salt`); when any segment is
cached, the scheduler reports every prompt token but the last as matched and the worker blends
them. Segments that were not cached are stored once the prompt's KV is complete. A blending
request stores no prefix chunks: its KV is the blend's, reusable only through its segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from lmcache.experimental.blend.segments import Segment, segment_salt, split_segments
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.integration.vllm.v1.worker_channel import ChannelError, WorkerChannel
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


@dataclass(frozen=True)
class BlendStep:
    """The worker's CacheBlend instructions for one request this step."""

    segments: Tuple[Segment, ...]  # every segment of the prompt
    cached: Tuple[bool, ...]  # per segment: the scheduler's lookup found it (a hint: a miss on fetch is recomputed)
    load: bool  # blend now: the scheduler promised all prompt tokens but the last
    store: Tuple[Segment, ...]  # store these segments' KV after this step (the prompt's KV is complete)

    @property
    def num_tokens(self) -> int:
        """Leading prompt tokens the worker needs (ids and slots) for the stores."""
        return max((seg.end for seg in self.store), default=0)


@dataclass
class _BlendState:
    segments: Tuple[Segment, ...]
    cached: Tuple[bool, ...]
    may_save: bool  # the request's policy allows stores
    stored: bool = False


def check_blending(vllm_config: "VllmConfig") -> None:
    """Refuse `enable_blending` where CacheBlend cannot run (vLLM line, model architecture)."""
    from lmcache.integration.vllm.vllm_compat import blend_unsupported_reason

    model = vllm_config.model_config
    reason = blend_unsupported_reason(
        list(model.architectures or ()), getattr(model.hf_config, "rope_scaling", None)
    )
    if reason is not None:
        raise ValueError(f"enable_blending=True: {reason} (set enable_blending to false)")


def separator_token_ids(vllm_config: "VllmConfig", separator: str) -> List[int]:
    """`blend_separator` encoded by the model's tokenizer without special tokens."""
    from transformers import AutoTokenizer

    model = vllm_config.model_config
    tokenizer = AutoTokenizer.from_pretrained(
        model.tokenizer, revision=model.tokenizer_revision, trust_remote_code=model.trust_remote_code
    )
    ids = list(tokenizer.encode(separator, add_special_tokens=False))
    if not ids:
        raise ValueError(f"blend_separator={separator!r} encodes to no tokens with {model.tokenizer}")
    return ids


@dataclass
class BlendScheduler:
    """Per-request CacheBlend state between the lookup and the request's end."""

    separator: Sequence[int]
    min_tokens: int
    _states: Dict[str, _BlendState] = field(default_factory=dict)

    @classmethod
    def from_config(cls, vllm_config: "VllmConfig", config: LMCacheEngineConfig) -> Optional["BlendScheduler"]:
        if not config.enable_blending:
            return None
        check_blending(vllm_config)
        return cls(separator_token_ids(vllm_config, config.blend_separator), config.blend_min_tokens)

    def segments_of(self, req_id: str, prompt: Sequence[int]) -> Optional[List[Segment]]:
        """The prompt's segments, or None when it does not blend (logged)."""
        if len(prompt) < self.min_tokens:
            logger.info("request %s: not blended: %d tokens < blend_min_tokens=%d", req_id, len(prompt), self.min_tokens)
            return None
        segments = split_segments(prompt, self.separator)
        if not segments:
            logger.info("request %s: not blended: no segment between two blend separators", req_id)
            return None
        return segments

    def match(
        self, req_id: str, prompt: Sequence[int], cache_salt: str, may_save: bool, channel: WorkerChannel
    ) -> Optional[int]:
        """For a blending prompt: the tokens of it that are cached segments (0 for none); None
        when the prompt does not blend and takes the prefix path."""
        self._states.pop(req_id, None)
        segments = self.segments_of(req_id, prompt)
        if segments is None:
            return None
        salt = segment_salt(cache_salt)
        cached = []
        for seg in segments:
            try:
                hit = channel.lookup(prompt[seg.start : seg.end], salt)
            except ChannelError as err:
                logger.error("request %s: CacheBlend segment lookup failed, recomputing it: %s", req_id, err)
                hit = 0
            cached.append(hit >= seg.length)
        self._states[req_id] = _BlendState(tuple(segments), tuple(cached), may_save)
        return sum(seg.length for seg, hit in zip(segments, cached) if hit)

    def blends(self, req_id: str) -> bool:
        return req_id in self._states

    def step(self, req_id: str, num_tokens: int, prompt_len: int, load: bool) -> Optional[BlendStep]:
        """This step's instructions for a blending request that has `num_tokens` scheduled."""
        state = self._states.get(req_id)
        if state is None:
            return None
        store: Tuple[Segment, ...] = ()
        if state.may_save and not state.stored and num_tokens >= prompt_len:
            state.stored = True
            store = tuple(seg for seg, hit in zip(state.segments, state.cached) if not hit)
        if not load and not store:
            return None
        return BlendStep(state.segments, state.cached, load, store)

    def forget(self, req_id: str) -> None:
        self._states.pop(req_id, None)
