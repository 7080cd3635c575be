"""Prompt building on the daemon side: tokenization and the chat template.

The daemon loads the model's vocabulary only (cheap), so it can count prompt tokens,
refuse prompts that cannot fit before they reach a worker, and render chat messages
with the GGUF's own Jinja2 template through llama-cpp-python's formatter.
"""

from __future__ import annotations

from typing import Any

from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from forged.engine.backend import Model
from forged.errors import BadRequest

# Used when a GGUF carries no template: ChatML, which SmolLM2 and many others speak.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Prompter:
    def __init__(self, model_path: str, chat_template: str = "") -> None:
        self.model = Model(model_path, vocab_only=True)
        template = chat_template or self.model.meta("tokenizer.chat_template") or CHATML
        eos = self.model.piece(self.model.eos, special=True).decode("utf-8", "replace")
        bos = self.model.piece(self.model.bos, special=True).decode("utf-8", "replace")
        self._chat = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                                         add_generation_prompt=True)
        self.n_vocab = self.model.n_vocab
        self.n_ctx_train = self.model.n_ctx_train

    def encode_completion(self, text: str) -> list[int]:
        # Like llama.cpp's server and llama-cpp-python: BOS if the model wants one, and
        # special tokens written in the text are parsed as such.
        return self.model.tokenize(text, add_special=True, parse_special=True)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        try:
            return str(self._chat(messages=messages).prompt)  # type: ignore[arg-type]
        except Exception as exc:  # a template's raise_exception or a Jinja2 error
            raise BadRequest(f"the chat template rejected the messages: {exc}",
                             param="messages") from exc

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template writes BOS itself where the model wants it.
        return self.model.tokenize(self.render_chat(messages), add_special=False,
                                   parse_special=True)

    def close(self) -> None:
        self.model.close()
