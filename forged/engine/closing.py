"""What holds a resource (a llama.cpp handle, a file descriptor, a model's group) frees
it with ``close()``, and is a context manager that does, as Python's files are: what
``open_*`` returns is closed by ``with``, or handed on to whoever will close it."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class Closing:
    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
