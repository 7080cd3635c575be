"""llama.cpp's ``POST /tokenize`` and ``POST /detokenize``, with its shapes.

``{"content", "add_special", "parse_special", "with_pieces"}`` gives ``{"tokens":
[ids]}``, or with pieces ``{"tokens": [{"id", "piece"}]}``: a piece is its text, or
its bytes as a list of integers where they are not UTF-8 on their own (part of a
character). ``{"tokens"}`` gives ``{"content"}``. Both use the daemon's
vocabulary-only model, so they never wait for the engine.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import trio
from msgspec import Struct

from forged.http.infill import check_ids
from forged.http.state import AppState


class TokenizeRequest(Struct, kw_only=True):
    content: str = ""
    model: str | None = None  # whose vocabulary (default: the default model's)
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int] = []
    model: str | None = None


tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


async def tokenize(state: AppState, req: TokenizeRequest) -> dict[str, Any]:
    with state.models.use(req.model) as group:
        p = group.prompter
        tokens = await trio.to_thread.run_sync(functools.partial(
            p.tokenize, req.content, add_special=req.add_special,
            parse_special=req.parse_special))
        if not req.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": _piece(p.piece(t))} for t in tokens]}


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: llama.cpp sends the bytes
        return list(data)


async def detokenize(state: AppState, req: DetokenizeRequest) -> dict[str, Any]:
    with state.models.use(req.model) as group:
        check_ids(group, req.tokens, "tokens")
        return {"content": await trio.to_thread.run_sync(group.prompter.detokenize,
                                                          req.tokens)}
