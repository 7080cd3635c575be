"""The rest of the API that coding tools use (issue 18, points 5 and 6): the model's
context in /v1/models, /tokenize and /detokenize, vLLM's extra sampling fields,
stop_reason and system_fingerprint, and an honest 400 for what forged does not do."""

from __future__ import annotations

from pathlib import Path

from forged.engine.limits import scheduler_limits
from forged.engine.prompts import Prompter
from tests.conftest import make_config

# --- the model's context ------------------------------------------------------------


def test_the_training_context_of_a_vocabulary_only_model_is_read_from_its_gguf(
        tiny_model: Path, tmp_path: Path) -> None:
    """llama.cpp loads no hyperparameters with vocab_only, so the daemon's model says
    n_ctx_train 0; max_context 0 (the model's context) then refused every request."""
    p = Prompter(str(tiny_model))
    try:
        assert p.n_ctx_train == 4096  # the tiny GGUF's llama.context_length
    finally:
        p.close()
    cfg = make_config(tiny_model, tmp_path, engine={"max_context": 0})
    assert scheduler_limits(cfg, 4096).max_context == min(cfg.engine.room, 4096)


