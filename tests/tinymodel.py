"""The tiny test models live in bench/ (the editor benchmark uses one too)."""

from bench.tinymodel import (
    FIM_TOKENS,
    TOOL_TOKENS,
    tiny_bert_parts,
    write_tiny_bert,
    write_tiny_llama,
)

__all__ = ["FIM_TOKENS", "TOOL_TOKENS", "tiny_bert_parts", "write_tiny_bert",
           "write_tiny_llama"]
