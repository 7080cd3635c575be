"""llama.cpp's ``POST /tokenize`` and ``POST /detokenize``, with its shapes.

``{"content", "add_special", "parse_special", "with_pieces"}`` gives ``{"tokens":
[ids]}``, or with pieces ``{"tokens": [{"id", "piece"}]}``: a piece is its text, or
its bytes as a list of integers where they are not UTF-8 on their own (part of a
character). ``{"tokens"}`` gives ``{"content"}``. Both use the daemon's
vocabulary-only model, so they never wait for the engine.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from forged.engine.groups import ModelGroup
from forged.engine.prompts import Prompter
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
_json = msgspec.json.Encoder()


async def tokenize(state: AppState, req: TokenizeRequest) -> bytes:
    """The answer's JSON, made (tokens, pieces and encoding, which all grow with the
    content) in one of the door's threads."""
    with state.models.use(req.model, embed=None) as group:
        return await state.off_loop(_tokenize, group.prompter, req)


def _tokenize(p: Prompter, req: TokenizeRequest) -> bytes:
    tokens = p.tokenize(req.content, add_special=req.add_special,
                        parse_special=req.parse_special)
    if not req.with_pieces:
        return _json.encode({"tokens": tokens})
    # Each distinct token's JSON object, encoded once, then joined: a megabyte of text
    # is some 300,000 tokens, and an object apiece (as msgspec would be given) took
    # about 100 MB for a moment, which glibc's arenas kept: the daemon's memory grew
    # by megabytes with every such request (the soak, docs/benchmarks.md).
    objects: dict[int, bytes] = {}
    for t in tokens:
        if t not in objects:
            objects[t] = _json.encode({"id": t, "piece": _piece(p.piece(t))})
    return b'{"tokens":[' + b",".join([objects[t] for t in tokens]) + b"]}"


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: llama.cpp sends the bytes
        return list(data)


async def detokenize(state: AppState, req: DetokenizeRequest) -> dict[str, Any]:
    """The ids' check and their text in one of the door's threads: both grow with the
    list (the check of a million ids on the event loop stalled every stream 80 ms)."""
    with state.models.use(req.model, embed=None) as group:
        return {"content": await state.off_loop(_detokenize, group, req.tokens)}


def _detokenize(group: ModelGroup, tokens: list[int]) -> str:
    check_ids(group, tokens, "tokens")
    return group.prompter.detokenize(tokens)
