"""The prefiller's per-request PD state on the scheduler side (only with `pd_role: sender`).

- `admit(request)`: read `kv_transfer_params["disagg_spec"]` once (`parse_disagg_spec`); a bad
  one is logged naming the field and remembered, and the request is served without a push.
- `step_spec(req_id, tracker, save_spec)`: the `DisaggSpec` a step's store carries to the worker
  (with `is_last_prefill` and `num_transferred_tokens` for this step), or None.
- `finished(request)`: what `request_finished` returns in `kv_transfer_params`: the bad spec's
  error (`disagg_error`, the proxy answers the client with it) and `first_tok` when
  `ret_first_tok` asked for it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from lmcache.experimental.pd.disagg_spec import DISAGG_SPEC_KEY, DisaggSpec, DisaggSpecError, parse_disagg_spec
from lmcache.integration.vllm.v1.request_state import RequestTracker, SaveSpec
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(__name__)

DISAGG_ERROR_KEY = "disagg_error"
RET_FIRST_TOK_KEY = "ret_first_tok"
FIRST_TOK_KEY = "first_tok"


class PDRequests:
    """`DisaggSpec`s (or their errors) of the requests this prefiller is serving."""

    def __init__(self, peer_host: str) -> None:
        self._peer_host = peer_host
        self._specs: dict[str, DisaggSpec] = {}
        self._errors: dict[str, str] = {}

    def admit(self, request: "Request") -> None:
        req_id = request.request_id
        if req_id in self._specs or req_id in self._errors:
            return
        params = getattr(request, "kv_transfer_params", None) or {}
        if DISAGG_SPEC_KEY not in params:
            return
        try:
            self._specs[req_id] = parse_disagg_spec(params[DISAGG_SPEC_KEY], self._peer_host)
        except DisaggSpecError as err:
            logger.error("request %s: bad disagg_spec, its KV is not pushed: %s", req_id, err)
            self._errors[req_id] = str(err)

    def step_spec(self, tracker: RequestTracker, save_spec: SaveSpec) -> Optional[DisaggSpec]:
        spec = self._specs.get(tracker.req_id)
        if spec is None:
            return None
        return dataclasses.replace(
            spec,
            is_last_prefill=save_spec.num_tokens >= tracker.prompt_len,
            num_transferred_tokens=save_spec.skip_leading_tokens,
        )

    def finished(self, request: "Request") -> Optional[dict[str, Any]]:
        params = getattr(request, "kv_transfer_params", None) or {}
        out: dict[str, Any] = {}
        error = self._errors.get(request.request_id)
        if error is not None:
            out[DISAGG_ERROR_KEY] = error
        if params.get(RET_FIRST_TOK_KEY) and request.output_token_ids:
            out[FIRST_TOK_KEY] = request.output_token_ids[0]
        return out or None

    def forget(self, req_id: str) -> None:
        self._specs.pop(req_id, None)
        self._errors.pop(req_id, None)

    def __len__(self) -> int:
        return len(set(self._specs) | set(self._errors))
