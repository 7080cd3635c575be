"""A BERT sentence-embedding model (Hugging Face safetensors, WordPiece tokenizer) as a
GGUF llama.cpp runs, without torch: ``safetensors`` reads the weights into numpy, and
``gguf``'s tensor-name map says what llama.cpp calls each one. It writes what llama.cpp's
own ``convert_hf_to_gguf.py`` writes for a ``BertModel``: the WordPiece vocabulary in
"phantom space" form (a word-initial piece gets U+2581, a ``##`` continuation loses
its marks), a non-causal encoder, and the pooling the model was trained with.

    forged model convert SRC_DIR OUT.gguf

``SRC_DIR`` holds ``config.json``, ``tokenizer.json``, ``model.safetensors`` and, for a
sentence-transformers model, ``1_Pooling/config.json`` (else mean pooling) and
``sentence_bert_config.json``, whose ``max_seq_length`` is the GGUF's context: the
longest input the model embeds (all-MiniLM-L6-v2: 256 of its 512 positions), as
sentence-transformers, vLLM and text-embeddings-inference take it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np
import numpy.typing as npt
from safetensors import SafetensorError
from safetensors.numpy import load_file

# Hugging Face tensors llama.cpp's BERT graph does not use: the pooler, and the heads of
# pre-training (a checkpoint saved as BertForPreTraining or BertForMaskedLM has them;
# llama.cpp's converter skips them too).
_UNUSED = ("embeddings.position_ids", "pooler.dense.", "cls.predictions.",
           "cls.seq_relationship.")
_SPECIALS = {"unk": "[UNK]", "bos": "[CLS]", "sep": "[SEP]", "pad": "[PAD]",
             "mask": "[MASK]"}


_T = TypeVar("_T", dict[str, Any], list[dict[str, Any]])


class ConvertError(ValueError):
    """The source folder is not a BERT model this converter knows."""


def convert_bert(src: Path, out: Path, *, name: str = "") -> Path:
    """Write ``src``'s BERT model to ``out`` as a GGUF (f16 matrices, f32 the rest),
    named ``name`` or the folder's name. Not config.json's ``_name_or_path``: that is
    the model it was fine-tuned from (all-MiniLM-L6-v2 says
    nreimers/MiniLM-L6-H384-uncased)."""
    config = _json(src / "config.json")
    if config.get("model_type") != "bert":
        raise ConvertError(f"{src}: model_type {config.get('model_type')!r}, not 'bert'")
    tokenizer = _json(src / "tokenizer.json")
    if tokenizer.get("model", {}).get("type") != "WordPiece":
        raise ConvertError(f"{src}: the tokenizer is not WordPiece")
    if (tokenizer.get("normalizer") or {}).get("lowercase") is False:
        # llama.cpp's WordPiece lowercases every text: "Paris" would be read as the
        # piece "paris", or [UNK], and the vectors would silently not be the model's.
        raise ConvertError(f"{src}: a cased tokenizer (lowercase false); llama.cpp's "
                           "BERT reads every text lowercased")
    vocab, specials = _tokens(tokenizer, int(config.get("vocab_size", 0)))
    config, tensors = _positions(config, _tensors(src), _max_seq_length(src))
    write_bert(out, config, vocab, specials, tensors, pooling=_pooling(src),
               name=name or src.resolve().name)
    return out


_POSITIONS = "embeddings.position_embeddings.weight"


def _max_seq_length(src: Path) -> int | None:
    """sentence-transformers' ``max_seq_length``: what it cuts every input to (None:
    no sentence_bert_config.json, or none in it)."""
    path = src / "sentence_bert_config.json"
    if not path.exists():
        return None
    n = _json(path).get("max_seq_length")
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise ConvertError(f"{path}: max_seq_length {n!r} is not a length")
    return n


def _positions(config: dict[str, Any], tensors: dict[str, npt.NDArray[Any]],
               longest: int | None) -> tuple[dict[str, Any], dict[str, npt.NDArray[Any]]]:
    """The model cut to ``longest`` positions. Its context was max_position_embeddings
    (512 for all-MiniLM-L6-v2), so an input of 257 to 512 tokens was embedded whole,
    or cut at 512, where sentence-transformers cuts it at 256: a vector the model never
    gives, from positions its training never reached. llama.cpp's BERT reads the
    context from the GGUF and wants one position row for each: the rows past it go
    (an input within them is embedded as before)."""
    if longest is None or longest >= int(config["max_position_embeddings"]):
        return config, tensors
    cut = {k: v[:longest] if k.removeprefix("bert.") == _POSITIONS else v
           for k, v in tensors.items()}
    return {**config, "max_position_embeddings": longest}, cut


def _tokens(tokenizer: dict[str, Any], vocab_size: int) -> tuple[list[str], set[str]]:
    """The tokens by id, and the special ones. As llama.cpp's converter: added tokens
    beyond the WordPiece vocabulary are in it, and ids up to the config's vocab_size
    that no token has are [PADn] (the embedding matrix has a row for each: a shorter
    list made a GGUF llama.cpp refused to load, "wrong shape")."""
    added = tokenizer.get("added_tokens", [])
    by_id = {int(i): t for t, i in tokenizer["model"]["vocab"].items()}
    by_id.update((int(t["id"]), t["content"]) for t in added if int(t["id"]) not in by_id)
    size = max(vocab_size, max(by_id, default=-1) + 1)
    vocab = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    specials = {t["content"] for t in added if t.get("special")}
    return vocab, specials | {t for i, t in enumerate(vocab) if i not in by_id}


def write_bert(out: Path, config: Mapping[str, Any], vocab: list[str], specials: set[str],
               tensors: Mapping[str, npt.NDArray[Any]], *, pooling: gguf.PoolingType,
               name: str) -> None:
    """The GGUF of a BERT given as Hugging Face's config, vocabulary (by id) and tensors
    (by Hugging Face's names): also how tests write a tiny one."""
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    w.add_name(name)
    _hparams(w, config, pooling)
    _vocabulary(w, vocab, specials)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, int(config["num_hidden_layers"]))
    for hf_name, data in tensors.items():
        if hf_name.removeprefix("bert.").startswith(_UNUSED):
            continue
        new = names.get_name(hf_name.removeprefix("bert."), try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ConvertError(f"no llama.cpp name for the tensor {hf_name}")
        w.add_tensor(new, _typed(new, data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hparams(w: gguf.GGUFWriter, c: Mapping[str, Any], pooling: gguf.PoolingType) -> None:
    w.add_context_length(int(c["max_position_embeddings"]))
    w.add_embedding_length(int(c["hidden_size"]))
    w.add_feed_forward_length(int(c["intermediate_size"]))
    w.add_block_count(int(c["num_hidden_layers"]))
    w.add_head_count(int(c["num_attention_heads"]))
    w.add_layer_norm_eps(float(c.get("layer_norm_eps", 1e-12)))
    w.add_causal_attention(False)
    w.add_pooling_type(pooling)
    w.add_token_type_count(int(c.get("type_vocab_size", 2)))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def _vocabulary(w: gguf.GGUFWriter, vocab: list[str], specials: set[str]) -> None:
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
             for t in vocab]
    # llama.cpp's WordPiece tokenizer matches pieces in this form.
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    pieces = [t if t in specials else t[2:] if t.startswith("##") else "\u2581" + t
              for t in vocab]
    if len(set(pieces)) < len(pieces):  # llama.cpp would abort on loading it
        raise ConvertError("the vocabulary has a piece twice")
    w.add_token_list(pieces)
    w.add_token_types([int(t) for t in types])
    ids = {t: i for i, t in enumerate(vocab)}
    missing = [tok for tok in _SPECIALS.values() if tok not in ids]
    if missing:
        raise ConvertError(f"the vocabulary has no {', '.join(missing)}")
    w.add_unk_token_id(ids[_SPECIALS["unk"]])
    w.add_bos_token_id(ids[_SPECIALS["bos"]])
    w.add_sep_token_id(ids[_SPECIALS["sep"]])
    w.add_pad_token_id(ids[_SPECIALS["pad"]])
    w.add_mask_token_id(ids[_SPECIALS["mask"]])
    # [CLS] text [SEP], as the model was trained.
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)


# Added to f32 activations, which ggml's CPU add takes in f32 only (llama.cpp's
# converter keeps them so too).
_F32_MATRICES = ("position_embd.weight", "token_types.weight")


def _typed(name: str, data: npt.NDArray[Any]) -> npt.NDArray[Any]:
    # As llama.cpp's converter: vectors, norms and what is added stay f32; matrices
    # become f16.
    if data.ndim <= 1 or name.endswith("_norm.weight") or name in _F32_MATRICES:
        return data.astype(np.float32)
    return data.astype(np.float16)


# The sentence-transformers modules a GGUF's BERT, pooling and unit vectors compute.
_MODULES = {"Transformer", "Pooling", "Normalize"}
_POOLINGS = {"pooling_mode_cls_token": gguf.PoolingType.CLS,
             "pooling_mode_mean_tokens": gguf.PoolingType.MEAN}


def _pooling(src: Path) -> gguf.PoolingType:
    """The pooling of the sentence-transformers model (mean without one). A module
    after the pooling (a Dense projection, as LaBSE's) or several poolings at once
    (their vectors concatenated) are refused: llama.cpp computes neither, and the
    GGUF's vectors would be silently other than the model's."""
    folder = "1_Pooling"
    for m in _read(src / "modules.json", []) if (src / "modules.json").exists() else []:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _MODULES:
            raise ConvertError(f"{src / 'modules.json'}: a {kind} module "
                               f"({m.get('path')}), which llama.cpp does not compute")
        folder = str(m.get("path", folder)) if kind == "Pooling" else folder
    path = src / folder / "config.json"
    if not path.exists():
        return gguf.PoolingType.MEAN
    modes = sorted(k for k, on in _json(path).items() if k.startswith("pooling_mode") and on)
    if len(modes) != 1 or modes[0] not in _POOLINGS:
        raise ConvertError(f"{path}: pooling {', '.join(modes) or 'none'}; llama.cpp has "
                           "one of mean and CLS only")
    return _POOLINGS[modes[0]]


def _tensors(src: Path) -> dict[str, npt.NDArray[Any]]:
    path = src / "model.safetensors"
    if not path.is_file():
        # Older sentence-transformers repositories ship pytorch_model.bin alone, which
        # takes torch to read: the user needs the way out, not a traceback.
        only = " (pytorch_model.bin is torch's pickle, which this converter does not " \
            "read: take the repository's safetensors revision, or convert it with " \
            "llama.cpp's convert_hf_to_gguf.py)" if (src / "pytorch_model.bin").exists() else ""
        raise ConvertError(f"{src}: no model.safetensors{only}")
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ConvertError(f"cannot read {path}: {exc}") from exc


def _json(path: Path) -> dict[str, Any]:
    return _read(path, {})


def _read(path: Path, shape: _T) -> _T:
    """``path``'s JSON, which must be of ``shape``'s type (an object, or a list)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConvertError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, type(shape)):
        raise ConvertError(f"{path}: not a JSON {type(shape).__name__}")
    return data
