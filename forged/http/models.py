"""``GET /v1/models`` and ``GET /v1/models/{id}``: the served model under each of its
ids (the configured one and its aliases), with the context a request may use.

Clients size their prompts from this: vLLM's ``max_model_len`` (aider, LiteLLM) and
llama.cpp's ``meta`` (its web UI, llama.vscode). ``max_model_len`` is the context
forged serves (``engine.max_context``, capped by the KV layout), not the model's
training context, which ``meta.n_ctx_train`` gives.
"""

from __future__ import annotations

from typing import Any

import msgspec

from forged import errors as e
from forged.http.state import AppState


def model_object(state: AppState, model_id: str) -> dict[str, Any]:
    """The model object of ``model_id``; ModelNotFound unless it is one of ours."""
    if model_id not in state.model_ids:
        raise e.ModelNotFound(model_id)
    info = state.prompter.info
    return {"id": model_id, "object": "model", "created": int(state.started),
            "owned_by": "forged", "root": state.cfg.model_id, "parent": None,
            "max_model_len": state.max_context,
            "meta": {k: v for k, v in msgspec.structs.asdict(info).items()
                     if k != "identity"}}


def model_list(state: AppState) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(state, m) for m in state.model_ids]}


def system_fingerprint(state: AppState) -> str:
    """OpenAI's ``system_fingerprint``: the same while the model and the build are."""
    return "fp_" + state.prompter.info.identity
