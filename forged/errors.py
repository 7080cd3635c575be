"""The small vocabulary of errors the engine raises; ``forged.http.responses`` maps them."""

from __future__ import annotations


class ForgedError(Exception):
    """Base of every error a caller may see."""


class BadRequest(ForgedError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextTooLong(BadRequest):
    def __init__(self, message: str, asked: tuple[int, int, int] | None = None) -> None:
        """``asked``: the prompt's tokens, the completion's asked for and the context,
        when both together pass it (a dialect may say it in its own words)."""
        super().__init__(message, param="messages", code="context_length_exceeded")
        self.asked = asked


class ModelNotFound(ForgedError):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")
        self.model = model


class NotServedHere(BadRequest):
    """The model exists but does not serve this kind of request: an embedding model
    asked to generate, or a generation model asked for embeddings."""

    def __init__(self, model: str, embed: bool) -> None:
        what = ("is not an embedding model: no embedding model serves this request"
                if embed else "is an embedding model: it makes embeddings only")
        super().__init__(f"The model `{model}` {what}.", param="model",
                         code="model_not_supported")
        self.model = model


class Overloaded(ForgedError):
    """No room in the queue. The caller should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueTimeout(Overloaded):
    pass


class RateLimited(Overloaded):
    """This API key is over one of its own limits; other keys are unaffected."""


class Unauthorized(ForgedError):
    pass


class Forbidden(ForgedError):
    """This API key may not use what it asked for (a repository index it is not given)."""


class NotFound(BadRequest):
    """A named thing (a repository index) that does not exist: 404, not 400."""


class UnsupportedEncoding(ForgedError):
    """A request body in a content coding forged does not decode (415)."""


class Unavailable(ForgedError):
    """No worker can take the request now (loading, restarting or draining)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WorkerLost(ForgedError):
    """The worker serving the request died; the daemon restarts it."""


class EngineError(ForgedError):
    """llama.cpp failed a step for this request."""


class SwapRefused(Exception):
    """A model swap (or addition) that did not happen; ``str()`` says why, for the
    admin. The models serving serve on."""


def sole_fault(exc: BaseException, kinds: type[Exception] | tuple[type[Exception], ...]
               ) -> Exception | None:
    """The first exception of ``kinds`` in ``exc``, if that is all ``exc`` holds
    (nurseries wrap errors in groups); None if it holds anything else, such as
    ``Cancelled``, which must propagate. The one unwrapper: a start-up failure, a
    worker's fault and a new model's failed load are each told apart with it."""
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(kinds)
        if match is None or rest is not None:
            return None
        leaf: BaseException = match
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        exc = leaf
    return exc if isinstance(exc, kinds) else None
