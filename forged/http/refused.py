"""Request fields forged knows but does not implement: a 400 that names the field.

A client that sends one of these expects something forged does not do (audio, a
predicted output, web search, a stored completion, a regular-expression constraint,
beam search, ...). Answering as if the field were absent would let it believe it got
what it asked for, so forged refuses, with OpenAI's error body and the field as
``param``. Each entry lists the values that ask for nothing (the field's default,
which some clients send explicitly): those are accepted. Fields forged has never heard
of are ignored, as OpenAI-compatible servers do; fields forged implements are not here.

The table is data, and README's API section lists it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from forged import errors as e


@dataclass(frozen=True)
class Refused:
    why: str
    # Values that ask for nothing: accepted and ignored.
    harmless: tuple[Any, ...] = (None,)


FIELDS: dict[str, Refused] = {
    # OpenAI's
    "audio": Refused("audio output is not supported"),
    "modalities": Refused("only text output is supported", (None, ["text"])),
    "prediction": Refused("predicted outputs are not supported"),
    "web_search_options": Refused("web search is not supported"),
    "store": Refused("stored completions are not supported", (None, False)),
    "functions": Refused("the legacy functions are not supported: use tools", (None, [])),
    "function_call": Refused("the legacy function_call is not supported: use tool_choice",
                             (None, "none")),
    "reasoning_effort": Refused("reasoning effort is not supported: a model thinks as "
                                "its chat template says (see chat_template_kwargs)"),
    "verbosity": Refused("verbosity is not supported"),
    # The SDK's (openai 3.x): moderated input and output, "block" refusing them.
    "moderation": Refused("moderation is not supported: nothing is scored nor blocked"),
    "service_tier": Refused("service tiers are not supported: use forged's priority "
                            "classes (an API key's priority)", (None, "auto", "default")),
    # vLLM's
    "guided_regex": Refused("regular-expression constraints are not supported: use "
                            "`grammar` (llama.cpp's GBNF)"),
    "guided_grammar": Refused("use `grammar` (llama.cpp's GBNF) instead"),
    "guided_whitespace_pattern": Refused("a whitespace pattern is not supported"),
    "structured_outputs": Refused("use response_format, json_schema, guided_json, "
                                  "guided_choice or grammar instead"),
    "use_beam_search": Refused("beam search is not supported", (None, False)),
    "prompt_logprobs": Refused("prompt logprobs are not supported"),
    "truncate_prompt_tokens": Refused("prompts are never truncated: one that does not "
                                      "fit is refused"),
    "allowed_token_ids": Refused("use logit_bias or grammar instead"),
    "bad_words": Refused("use logit_bias instead", (None, [])),
    "skip_special_tokens": Refused("special tokens are always left out of the text",
                                   (None, True)),
    "chat_template": Refused("a request's own chat template is not supported: the "
                             "model's (or model.chat_template) is used"),
    "add_generation_prompt": Refused("the assistant's turn is always begun", (None, True)),
    "continue_final_message": Refused("continuing the last message is not supported",
                                      (None, False)),
    "documents": Refused("documents for the chat template are not supported"),
    # llama.cpp's
    "adaptive_target": Refused("adaptive-p sampling is not supported", (None, -1, -1.0)),
    "penalty_last_n": Refused("use repeat_last_n (llama.cpp's name)"),
    "post_sampling_probs": Refused("probabilities after the samplers are not supported: "
                                   "n_probs gives the model's", (None, False)),
    "return_progress": Refused("prompt progress events are not supported", (None, False)),
    "timings_per_token": Refused("timings come with the last event only", (None, False)),
    "lora": Refused("LoRA adapters are not supported", (None, [])),
    "n_cmpl": Refused("one completion per /completion request: send it again, or use "
                      "/v1/completions with n", (None, 1)),
    "n_cache_reuse": Refused("reusing cached chunks by shifting them is not supported: "
                             "forged reuses the longest cached prefix", (None, 0)),
    "image_data": Refused("images are not supported: this model reads text only",
                          (None, [])),
    "multimodal_data": Refused("images and audio are not supported: this model reads "
                               "text only", (None, [])),
}

# Content parts of chat messages other than text, by type: what they would carry.
PARTS = {"image_url": "images", "input_audio": "audio", "file": "files",
         "video_url": "video", "audio_url": "audio"}

# Each refusable field as it came, UNSET where absent: decoded beside the request.
_Given = msgspec.defstruct("_Given", [(name, Any, msgspec.UNSET) for name in FIELDS])
_given_decoder = msgspec.json.Decoder(_Given)


def unsupported(why: str, param: str) -> e.BadRequest:
    """The 400 for what forged knows but does not do, naming the field as ``param``."""
    return e.BadRequest(f"`{param}` is not supported by this server: {why}", param=param,
                        code="unsupported_field")


def refuse(given: object, table: dict[str, Refused], prefix: str = "") -> None:
    """A 400 naming the first field of ``table`` that ``given`` (a decoded body, or a
    part of one at ``prefix``) sets to something other than its harmless values."""
    for name, refused in table.items():
        if getattr(given, name, None) not in refused.harmless:
            raise unsupported(refused.why, prefix + name)


def check(body: bytes) -> None:
    """BadRequest naming the first field of the table that asks for something."""
    given = _given_decoder.decode(body)
    for name, refused in FIELDS.items():
        value = getattr(given, name)
        if value is not msgspec.UNSET and value not in refused.harmless:
            raise unsupported(refused.why, name)


def part_error(kind: str, where: str) -> e.BadRequest:
    what = PARTS.get(kind)
    message = (f"{what} in messages are not supported: this model reads text only"
               if what else f"content parts of type {kind!r} are not supported")
    return e.BadRequest(message, param=where, code="unsupported_field" if what else None)
