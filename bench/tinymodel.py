"""Write a tiny random-weight llama GGUF with the ``gguf`` package, for fast tests.

The vocabulary is a SentencePiece-style one: three specials, the 256 byte-fallback
tokens and the printable ASCII characters, so any text tokenizes and any byte
sequence (UTF-8 split across tokens included) can be generated. The weights are
random, so the text is nonsense, but llama.cpp runs the full llama graph on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

N_EMBD, N_LAYER, N_HEAD, N_FF, N_CTX = 64, 2, 4, 128, 4096
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# A Hermes tool-calling template in the manner of Qwen2.5's: the tools in the system
# turn, calls as <tool_call> blocks, results as <tool_response> blocks in user turns.
HERMES_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{{ m.content or '' }}{% for tc in m.tool_calls %}<tool_call>\n"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TOOL_TOKENS = ("<tool_call>", "</tool_call>")


# Qwen2.5-Coder's fill-in-the-middle tokens (and their GGUF metadata keys), for the
# tiny model that serves /infill in tests.
FIM_TOKENS = {
    "<|fim_prefix|>": gguf.Keys.Tokenizer.FIM_PRE_ID,
    "<|fim_suffix|>": gguf.Keys.Tokenizer.FIM_SUF_ID,
    "<|fim_middle|>": gguf.Keys.Tokenizer.FIM_MID_ID,
    "<|fim_pad|>": gguf.Keys.Tokenizer.FIM_PAD_ID,
    "<|repo_name|>": gguf.Keys.Tokenizer.FIM_REP_ID,
    "<|file_sep|>": gguf.Keys.Tokenizer.FIM_SEP_ID,
}


def _vocab(fim: bool = False, tools: bool = False
           ) -> tuple[list[bytes], list[float], list[int]]:
    T = gguf.TokenType
    toks: list[bytes] = [b"<unk>", b"<s>", b"</s>"]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL]
    for b in range(256):
        toks.append(f"<0x{b:02X}>".encode())
        types.append(T.BYTE)
    for c in range(0x20, 0x7F):
        ch = "\u2581" if c == 0x20 else chr(c)  # SentencePiece writes spaces as U+2581
        toks.append(ch.encode())
        types.append(T.NORMAL)
    specials = ["<|im_start|>", "<|im_end|>", *(FIM_TOKENS if fim else ()),
                *(TOOL_TOKENS if tools else ())]
    for special in specials:
        toks.append(special.encode())
        types.append(T.CONTROL)
    scores = [0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(0x7F - 0x20)]
    return toks, scores + [0.0] * len(specials), [int(t) for t in types]


def write_tiny_llama(path: Path, seed: int = 0, *, fim: bool = False,
                     tools: bool = False, broken: bool = False) -> Path:
    """With ``fim``, the vocabulary ends with FIM_TOKENS, named in the metadata; with
    ``tools``, with TOOL_TOKENS, and the chat template is HERMES_TOOLS. ``broken``
    leaves a tensor out: the vocabulary loads, the model does not."""
    rng = np.random.default_rng(seed)
    toks, scores, types = _vocab(fim, tools)
    n_vocab = len(toks)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("forged-tiny-test")
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(HERMES_TOOLS if tools else CHATML)
    if fim:
        for text, key in FIM_TOKENS.items():
            w.add_uint32(key, toks.index(text.encode()))

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", n_vocab, N_EMBD)
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(f"blk.{i}.{name}.weight", N_EMBD, N_EMBD)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    if not broken:
        w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    # Large output weights make sampling decisive, so greedy runs are long and varied.
    t("output.weight", n_vocab, N_EMBD, scale=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":
    import sys

    write_tiny_llama(Path(sys.argv[1]), fim="--fim" in sys.argv)


# A tiny BERT for embedding tests: a WordPiece vocabulary of BERT's specials, lower-
# case letters, digits and a few words and continuations, written by the same code that
# converts a real one (forged.convert), from Hugging Face's tensor names.
BERT_EMBD, BERT_LAYER, BERT_HEAD, BERT_FF, BERT_CTX = 32, 2, 4, 64, 128
_BERT_WORDS = ["def", "return", "class", "import", "the", "function", "error", "test",
               "##ing", "##ed", "(", ")", ":", ".", ",", "=", "_"]


def _bert_vocab() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    digits = [str(d) for d in range(10)]
    return [*specials, *letters, *(f"##{c}" for c in letters + digits), *digits,
            *_BERT_WORDS]


def write_tiny_bert(path: Path, seed: int = 0) -> Path:
    from forged.convert import write_bert

    config, vocab, tensors = tiny_bert_parts(seed)
    specials = {t for t in vocab if t.startswith("[")}
    write_bert(path, config, vocab, specials, tensors, pooling=gguf.PoolingType.MEAN,
               name="forged-tiny-bert")
    return path


def tiny_bert_parts(seed: int = 0) -> tuple[dict[str, Any], list[str], dict[str, np.ndarray]]:
    """The tiny BERT as Hugging Face has it: its config.json, vocabulary (by id) and
    tensors (by their names)."""
    rng = np.random.default_rng(seed)
    vocab = _bert_vocab()
    config = {"max_position_embeddings": BERT_CTX, "hidden_size": BERT_EMBD,
              "intermediate_size": BERT_FF, "num_hidden_layers": BERT_LAYER,
              "num_attention_heads": BERT_HEAD, "type_vocab_size": 2}

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {"embeddings.word_embeddings.weight": r(len(vocab), BERT_EMBD),
               "embeddings.position_embeddings.weight": r(BERT_CTX, BERT_EMBD),
               "embeddings.token_type_embeddings.weight": r(2, BERT_EMBD),
               "embeddings.LayerNorm.weight": np.ones(BERT_EMBD, np.float32),
               "embeddings.LayerNorm.bias": np.zeros(BERT_EMBD, np.float32)}
    for i in range(BERT_LAYER):
        p = f"encoder.layer.{i}."
        for name, shape in (("attention.self.query", (BERT_EMBD, BERT_EMBD)),
                            ("attention.self.key", (BERT_EMBD, BERT_EMBD)),
                            ("attention.self.value", (BERT_EMBD, BERT_EMBD)),
                            ("attention.output.dense", (BERT_EMBD, BERT_EMBD)),
                            ("intermediate.dense", (BERT_FF, BERT_EMBD)),
                            ("output.dense", (BERT_EMBD, BERT_FF))):
            tensors[p + name + ".weight"] = r(*shape)
            tensors[p + name + ".bias"] = r(shape[0])
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            tensors[p + norm + ".weight"] = np.ones(BERT_EMBD, np.float32)
            tensors[p + norm + ".bias"] = np.zeros(BERT_EMBD, np.float32)
    return config, vocab, tensors
