"""Embedded demo: generated preference data and the tools that build the ``tiny`` preset's tokenizer.

Everything here runs without network access. ``dschat.demo.corpus`` is pure stdlib; the tokenizer builder
imports sentencepiece only when called. The library never imports this package (``tests/dschat/test_imports.py``):
the stage mains and the demo commands pass ``demo_data`` in where a run is given no ``--data``.
"""

from dschat.demo.corpus import (
    generate_judge_pairs,
    generate_pairwise,
    generate_prompts,
    tokenizer_training_text,
    write_demo_files,
)
from dschat.demo.files import demo_data, demo_files
from dschat.demo.tokenizer import build_tokenizer_model

__all__ = [
    "build_tokenizer_model",
    "demo_data",
    "demo_files",
    "generate_judge_pairs",
    "generate_pairwise",
    "generate_prompts",
    "tokenizer_training_text",
    "write_demo_files",
]
