"""forged: a Trio daemon serving a local llama.cpp model over an OpenAI-compatible API."""

__version__ = "0.1.0"
