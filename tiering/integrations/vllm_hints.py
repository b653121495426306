"""The continuation hint of a vLLM request: whether a later request is expected to continue it.

vLLM 0.33 hands every offloading manager call a ``ReqContext`` carrying two per-request
channels a client or an orchestrator fills: the request's ``kv_transfer_params`` (the
``kv_transfer_params`` object of an OpenAI-compatible request body) and its ``kv_hints``
(a ``KvHintsEnvelope`` of versioned actions, given to ``LLMEngine.add_request`` or
``AsyncLLM.generate``). The drop-in reads the hint from either:

- ``kv_transfer_params``: ``{"tiering_continues": true}`` (or ``false``);
- ``kv_hints``: an action with ``action_type`` ``"tiering.continues"`` and payload
  ``{"continues": true}`` (or ``false``).

``true``: the client expects a later request to continue this one (a chat session still
open); ``false``: it expects none to (a one-off call, a session the user closed). The hint
reaches the primary tier's policy with the request (:meth:`EvictionPolicy.note_request`'s
``continues``); ``chain`` ranks by it. A request from a client that sends neither is not
hinted. A malformed value is logged and ignored: a client's bad field must not fail its
request, and a hint only ranks.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import ReqContext

__all__ = ["HINT_ACTION", "HINT_PARAM", "request_hint"]

#: The ``kv_transfer_params`` field of the hint.
HINT_PARAM = "tiering_continues"
#: The ``action_type`` of a ``kv_hints`` action carrying the hint (payload ``{"continues": b}``).
HINT_ACTION = "tiering.continues"

logger = logging.getLogger(__name__)


def request_hint(req_context: ReqContext) -> bool | None:
    """The request's hint: from its ``kv_transfer_params``, else its ``kv_hints`` (the last
    action of the hint's type); ``None`` where it has none or a malformed one (logged)."""
    params = req_context.kv_transfer_params
    if params and HINT_PARAM in params:
        return _checked(params[HINT_PARAM], f"kv_transfer_params[{HINT_PARAM!r}]", req_context)
    envelope = req_context.kv_hints
    if envelope is None:
        return None
    for action in reversed(envelope.actions):
        if action.action_type == HINT_ACTION:
            payload = action.payload if isinstance(action.payload, dict) else {}
            where = f"kv_hints action {action.action_id!r} payload['continues']"
            return _checked(payload.get("continues"), where, req_context)
    return None


def _checked(value: object, where: str, req_context: ReqContext) -> bool | None:
    if type(value) is bool:
        return value
    logger.warning(
        "request %s: %s must be true or false, got %r; the request is not hinted",
        req_context.req_id,
        where,
        value,
    )
    return None
