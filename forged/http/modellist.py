"""``GET /v1/models`` and ``GET /v1/models/{id}``: each served model under each of its
ids (the configured one and its aliases), with the context a request may use.

Clients size their prompts from this: vLLM's ``max_model_len`` (aider, LiteLLM) and
llama.cpp's ``meta`` (its web UI, llama.vscode). ``max_model_len`` is the context
forged serves (``engine.max_context``, capped by the KV layout), not the model's
training context, which ``meta.n_ctx_train`` gives.

During a model swap the group being loaded, and then the one draining, are listed too,
as ``ID@gN``, with llama-server's ``status`` (``loading``, ``loaded``, ``unloading``);
requests cannot name them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from forged.engine.groups import STATUS_WORDS, ModelGroup, Models


def _object(created: int, group: ModelGroup, model_id: str) -> dict[str, Any]:
    info = group.prompter.info
    return {"id": model_id, "object": "model", "created": created,
            "owned_by": "forged", "root": group.model_id, "parent": None,
            "max_model_len": group.max_context, "role": group.role,
            "status": {"value": STATUS_WORDS[group.status]},
            "meta": {k: v for k, v in msgspec.structs.asdict(info).items()
                     if k != "identity"}}


def model_object(models: Models, created: int, model_id: str) -> dict[str, Any]:
    """The model object of ``model_id``; ModelNotFound unless it is one of ours.
    ``created``: when the daemon started, which OpenAI's clients read as the model's."""
    return _object(created, models.listed(model_id), model_id)


def model_list(models: Models, created: int) -> dict[str, Any]:
    data = []
    for group in models.all():
        ids = group.ids if group.status == "serving" else [group.listed_id]
        data += [_object(created, group, i) for i in ids]
    return {"object": "list", "data": data}


def system_fingerprint(group: ModelGroup) -> str:
    """OpenAI's ``system_fingerprint``: the same while the model and the build are."""
    return "fp_" + group.prompter.info.identity
