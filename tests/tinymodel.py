"""The tiny test models live in bench/ (the editor benchmark uses one too)."""

from bench.tinymodel import FIM_TOKENS, write_tiny_llama

__all__ = ["FIM_TOKENS", "write_tiny_llama"]
