"""``POST /v1/retrieve``, and the chunks a generation with ``repo`` draws on.

A repository's index (``forged index add``, :mod:`forged.retrieval`) is searched in a
worker thread, at most ``retrieval.search_threads`` at once: never on the event loop
(a search is milliseconds of CPU, and every stream's next frame would wait behind it)
and never in the decode worker, which only ever sees the finished prompt.

Access: an API key with ``repos`` in keys.toml may search only those indexes (403 for
any other); a key without it, or an API with no keys, may search every index. A key's
``default_repo`` is the index its generations draw on when they name none.

A generation's chunks are chosen by :func:`context`: the best ``context_chunks`` hits
for the code around the cursor, kept in rank order while their tokens (path line and
text) fit ``context_tokens`` together; one that would pass the budget is left out whole,
a smaller one after it may still fit. The response names them under ``retrieved``.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from forged import errors as e
from forged.auth import KeyEntry
from forged.engine.fim import SNIPPET_SEPARATOR
from forged.engine.prompts import Prompter
from forged.http.door import in_thread
from forged.http.schemas import ChatMessage, ChatRequest, ContentPart
from forged.http.sse import Format, MakeFormat
from forged.http.state import AppState
from forged.retrieval.errors import IndexError_
from forged.retrieval.query import Searcher
from forged.retrieval.store import Hit

log = logging.getLogger("forged")


class RetrieveRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # The index's name; absent: the API key's default_repo.
    repo: str | None = None
    query: Annotated[str, Meta(min_length=1, max_length=16384)]
    k: Annotated[int, Meta(ge=1)] = 10


retrieve_decoder = msgspec.json.Decoder(RetrieveRequest)


@dataclass(frozen=True)
class Retrieved:
    """The chunks found for one request in ``repo``, best first."""

    repo: str
    hits: list[Hit]

    def named(self) -> list[dict[str, Any]]:
        """What a generation's response says it used: where each chunk is, not its text."""
        return [{"repo": self.repo, "path": h.path, "start_line": h.start_line,
                 "end_line": h.end_line, "score": h.score} for h in self.hits]


def resolve_repo(searcher: Searcher, repo: str | None, key: KeyEntry | None) -> str | None:
    """The index a request names (or its key's default), checked: the key may read it
    (403) and it exists (404). None when neither names one."""
    name = repo or (key.default_repo if key else "") or None
    if name is None:
        return None
    if key is not None and not key.may_read(name):
        raise e.Forbidden(f"API key {key.name!r} may not read the repository index {name!r}")
    try:
        found = searcher.exists(name)
    except IndexError_ as exc:
        raise e.BadRequest(str(exc), param="repo") from exc
    if not found:
        raise e.NotFound(f"no repository index {name!r}: `forged index list` shows them",
                         param="repo", code="repo_not_found")
    return name


async def search(state: AppState, repo: str, query: str, k: int,
                 focus: Sequence[str] = (), key: KeyEntry | None = None, *,
                 by_meaning: bool = False) -> list[Hit]:
    """The ``k`` best chunks of ``repo`` for ``query`` (definitions of ``focus``
    first), searched in a thread: by BM25 and, ``by_meaning`` with an embedding model
    whose vectors the index holds, by meaning too (forged.retrieval.vectors).

    Only questions are searched by meaning (/v1/retrieve, chat): the code around an
    editor's cursor is not. Measured on trio's call sites (docs/benchmarks.md), fusing
    all-MiniLM-L6-v2's nearest chunks into BM25's found the definition no more often
    (recall@5 0.702 against 0.704), and embedding the query cost ~190 ms of CPU, which
    a completion's TTFT would pay."""
    # Here, not at the top: forged.http.embeddings imports api, which imports this.
    from forged.http.embeddings import query_vector

    vector, model = await query_vector(state, query, key.tenant if key else "") \
        if by_meaning else (b"", "")
    try:
        return await in_thread(state.search_limiter, state.cfg.server.door_timeout,
                               state.cfg.limits.retry_after, state.searcher.search,
                               repo, query, k, focus, vector, model)
    except IndexError_ as exc:  # removed between the check and the search
        raise e.NotFound(str(exc), param="repo", code="repo_not_found") from exc
    except sqlite3.OperationalError as exc:
        # `forged index update` holds the file for longer than the search waits (a
        # large first build spilling its cache): try again shortly.
        log.warning("index %r unreadable: %s", repo, exc)
        raise e.Unavailable(f"the repository index {repo!r} is being updated; retry",
                            state.cfg.limits.retry_after) from exc
    except sqlite3.DatabaseError as exc:  # damaged: `forged index rm` and add it again
        log.error("index %r cannot be read: %s", repo, exc)
        raise e.Unavailable(f"the repository index {repo!r} cannot be read: {exc}",
                            state.cfg.limits.retry_after) from exc


async def retrieve(state: AppState, req: RetrieveRequest, key: KeyEntry | None
                   ) -> dict[str, Any]:
    """``/v1/retrieve``'s answer: ranked chunks with their text."""
    limit = state.cfg.retrieval.max_k
    if req.k > limit:
        raise e.BadRequest(f"k is {req.k}; at most {limit} chunks may be asked for",
                           param="k")
    repo = resolve_repo(state.searcher, req.repo, key)
    if repo is None:
        raise e.BadRequest("name the repository index to search in `repo` (`forged index "
                           "list` shows them)", param="repo")
    hits = await search(state, repo, req.query, req.k, key=key, by_meaning=True)
    return {"object": "list", "repo": repo, "data": [
        {"repo": repo, "path": h.path, "start_line": h.start_line, "end_line": h.end_line,
         "score": h.score, "text": h.text} for h in hits]}


async def context(state: AppState, prompter: Prompter, repo: str | None,
                  key: KeyEntry | None, query: str, focus: Sequence[str] = (), *,
                  by_meaning: bool = False) -> Retrieved | None:
    """The chunks a generation draws on: None when it names no index (nor its key).
    ``prompter``: the model's, whose tokens the budget counts; ``by_meaning``: a
    question (a chat's), searched by meaning too (:func:`search`)."""
    name = resolve_repo(state.searcher, repo, key)
    if name is None:
        return None
    cfg = state.cfg.retrieval
    if cfg.context_chunks == 0 or cfg.context_tokens == 0:
        return Retrieved(name, [])
    try:
        hits = await search(state, name, query, cfg.context_chunks, focus, key,
                            by_meaning=by_meaning)
    except (e.Unavailable, e.Overloaded):  # the completion goes on without context,
        return Retrieved(name, [])           # and says so
    kept = await state.off_loop(within_budget, prompter, hits, cfg.context_tokens)
    return Retrieved(name, kept)


def chunk_tokens(prompter: Prompter, hit: Hit) -> int:
    """A chunk's share of the budget: its path line and its text, as the model reads them."""
    tokenize = functools.partial(prompter.tokenize, add_special=False,
                                 parse_special=False)
    return len(tokenize(hit.path + "\n")) + len(tokenize(hit.text)) + 1


def within_budget(prompter: Prompter, hits: list[Hit], budget: int) -> list[Hit]:
    kept, used = [], 0
    for hit in hits:
        n = chunk_tokens(prompter, hit)
        if used + n <= budget:
            kept.append(hit)
            used += n
    return kept


def query_around(prefix: str, suffix: str, lines: int) -> str:
    """An infill's query: the prefix's last ``lines`` lines and the suffix's first. Only
    those are split off (on the event loop: a 4 MiB prefix split whole took 30-60 ms)."""
    if lines <= 0:
        return ""
    before, after = _last_lines(prefix, lines), suffix.split("\n", lines)
    if len(after) <= lines and after[-1] == "":
        after.pop()  # the newline ending the suffix starts no line
    return "\n".join(line.removesuffix("\r") for line in [*before, *after[:lines]])


def _last_lines(text: str, n: int) -> list[str]:
    """``text.splitlines()[-n:]`` (for "\\n" and "\\r\\n"), splitting off only those."""
    parts = text.rsplit("\n", n + 1)
    if parts[-1] == "":
        parts.pop()  # the newline ending the text starts no line
    return parts[-n:]


def code_text(code: str | list[str | int]) -> str:
    """The text parts of llama.cpp's mixed text (token ids carry no identifiers here)."""
    return code if isinstance(code, str) else "".join(p for p in code if isinstance(p, str))


def with_retrieved(fmt: MakeFormat, found: Retrieved | None) -> MakeFormat:
    """``fmt``, its responses naming the chunks ``found`` (when a repository was used)."""
    if found is None:
        return fmt

    def make(*args: Any, **kwargs: Any) -> Format:
        out = fmt(*args, **kwargs)
        out.retrieved = found.named()
        return out

    return make


def as_snippets(found: Retrieved | None) -> str:
    """A plain completion's context before its prompt, as llama.cpp lays out extra files
    for a model without a file-separator token: each chunk after the snippet separator,
    under its path, the best last (nearest the prompt)."""
    if not found or not found.hits:
        return ""
    return "".join(f"{SNIPPET_SEPARATOR}{h.path}\n{h.text}"
                   for h in reversed(found.hits)) + SNIPPET_SEPARATOR


def last_user_text(req: ChatRequest) -> str:
    """A chat's query: its last user message's text."""
    for m in reversed(req.messages):
        if m.role == "user":
            if isinstance(m.content, str):
                return m.content
            return "\n".join(p.text or "" for p in m.content or [])
    return ""


def chat_with_context(req: ChatRequest, found: Retrieved | None) -> ChatRequest:
    """The chat with the chunks ``found`` as a system-context block: added to its leading
    system message when that is text, else as a system message of its own in front."""
    if not found or not found.hits:
        return req
    block = f"Code from the repository {found.repo} that may be relevant:\n\n" + "\n\n".join(
        f"{h.path} (lines {h.start_line}-{h.end_line}):\n```\n{h.text}\n```"
        for h in found.hits)
    first, rest = req.messages[0], req.messages[1:]
    if first.role in ("system", "developer") and isinstance(first.content, str):
        messages = [msgspec.structs.replace(first, content=f"{first.content}\n\n{block}"),
                    *rest]
    elif first.role in ("system", "developer") and first.content:  # parts: as its text
        parts = [*first.content, ContentPart("text", f"\n\n{block}")]
        messages = [msgspec.structs.replace(first, content=parts), *rest]
    else:
        messages = [ChatMessage(role="system", content=block), *req.messages]
    return msgspec.structs.replace(req, messages=messages)
