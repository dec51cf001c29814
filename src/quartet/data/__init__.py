"""Datasets in, token ids out: read and validate rows, render chat templates, encode and pad.

- readers.py   ``read_table``: JSONL / JSON / CSV / Parquet / save_to_disk dirs / ``task:<name>/<split>``
- schemas.py   ``load_prompts`` / ``load_sft`` / ``load_preferences`` / ``load_samples``: rows -> validated examples
- templates.py ``render_prompt`` / ``split_conversation`` / ``render_conversation``: chat text
- collate.py   ``encode_prompts`` / ``encode_sft`` / ``encode_pairs`` / ``left_pad`` / ``right_pad``
"""

from quartet.data.collate import (
    IGNORE_INDEX,
    EncodedPrompts,
    EncodedSFT,
    encode_pairs,
    encode_prompts,
    encode_sft,
    left_pad,
    right_pad,
)
from quartet.data.readers import Table, read_rows, read_table
from quartet.data.schemas import (
    PreferenceExample,
    Prompt,
    PromptExample,
    SFTExample,
    load_preferences,
    load_prompts,
    load_samples,
    load_sft,
)
from quartet.data.templates import (
    has_chat_template,
    prompt_text,
    render_conversation,
    render_prompt,
    split_conversation,
)

__all__ = [
    "prompt_text",
    "IGNORE_INDEX",
    "EncodedPrompts",
    "EncodedSFT",
    "PreferenceExample",
    "Prompt",
    "PromptExample",
    "SFTExample",
    "Table",
    "encode_pairs",
    "encode_prompts",
    "encode_sft",
    "has_chat_template",
    "left_pad",
    "load_preferences",
    "load_prompts",
    "load_samples",
    "load_sft",
    "read_rows",
    "read_table",
    "render_conversation",
    "render_prompt",
    "right_pad",
    "split_conversation",
]
