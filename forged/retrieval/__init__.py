"""The repository index: chunking (pure), the SQLite FTS5 store, and its CLI.

Never imports the engine: retrieval and decoding meet only in ``http``."""
