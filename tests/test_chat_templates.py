"""Real models' chat templates and their quirks, rendered by the daemon's Prompter on
the tiny model's vocabulary (the template given as a model's chat_template is)."""

from __future__ import annotations

from pathlib import Path

import pytest

from forged.engine.prompts import Prompter, system_in_user_turns
from forged.errors import BadRequest

# google/gemma-2-2b-it's template, as its GGUFs carry it: no system role.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System "
    "role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] "
    "== 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\n'}}{% endif %}"
)


def test_a_template_without_a_system_role_gets_the_system_text_in_the_user_turn(
        tiny_model: Path) -> None:
    """Gemma's template raises on a system message: every request with one (every
    coding assistant's, and forged's own tool instructions) was a 400. As llama.cpp
    does, its text opens the next user message instead."""
    with Prompter(str(tiny_model), GEMMA2) as p:
        assert not p.takes_system
        text = p.render_chat([{"role": "system", "content": "Be brief."},
                              {"role": "system", "content": "Write Python."},
                              {"role": "user", "content": "Sort a list."},
                              {"role": "assistant", "content": "sorted(xs)"},
                              {"role": "user", "content": "In place?"}])
        assert text.endswith(
            "<start_of_turn>user\nBe brief.\nWrite Python.\nSort a list.<end_of_turn>\n"
            "<start_of_turn>model\nsorted(xs)<end_of_turn>\n"
            "<start_of_turn>user\nIn place?<end_of_turn>\n<start_of_turn>model\n")
        with pytest.raises(BadRequest, match="alternate"):  # its other rules still hold
            p.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_template_with_a_system_role_is_rendered_as_given(tiny_model: Path) -> None:
    with Prompter(str(tiny_model)) as p:
        assert p.takes_system
        assert p.render_chat([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hi"}]).startswith(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>")


@pytest.mark.parametrize("template", [None, GEMMA2])
def test_a_chat_prompt_begins_with_bos_once_where_the_model_wants_it(
        tiny_model: Path, template: str | None) -> None:
    """The tiny model wants BOS (as Llama's and Mistral's GGUFs do) and its ChatML
    template writes none: llama-server's prompt began with BOS, forged's did not.
    Gemma's writes one: it is there once, and /apply-template's text, as llama-server's,
    leaves it to the tokenizer."""
    with Prompter(str(tiny_model), template) as p:
        hi = [{"role": "user", "content": "Hi"}]
        tokens = p.encode_chat(hi)
        assert tokens[0] == p.vocab.bos and tokens[1] != p.vocab.bos
        assert not p.render_chat(hi).startswith(p.vocab.piece(p.vocab.bos, special=True)
                                                .decode())


def test_system_text_goes_where_llama_cpp_puts_it() -> None:
    def m(role: str, content: str) -> dict[str, str]:
        return {"role": role, "content": content}

    assert system_in_user_turns([m("system", "S"), m("user", "")]) == [m("user", "S")]
    assert system_in_user_turns([m("user", "u"), m("system", "S"), m("assistant", "a")]) \
        == [m("user", "u"), m("user", "S"), m("assistant", "a")]
    assert system_in_user_turns([m("user", "u"), m("system", "S")]) == [m("user", "u"),
                                                                       m("user", "S")]
