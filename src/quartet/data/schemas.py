"""The three dataset kinds (prompts, SFT demonstrations, preference pairs), validated row by row.

A prompt is either plain text or a chat: a list of ``{"role": ..., "content": ...}`` messages.
``DataConfig.columns`` maps a canonical field name to the name used in the file
(``columns: {prompt: question}``). Every bad row raises a one-line DataError naming file, row, field.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from quartet.config import DataConfig
from quartet.data.readers import Table, read_table
from quartet.errors import DataError

log = logging.getLogger("quartet")

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}
Prompt = str | list  # plain text, or a list of Message ending with a user (or system) turn
ROLES = ("system", "user", "assistant")


@dataclass
class PromptExample:
    prompt: Prompt


@dataclass
class SFTExample:
    prompt: Prompt
    completion: str


@dataclass
class PreferenceExample:
    prompt: Prompt
    chosen: str
    rejected: str
    margin: float | None = None
    """how much better chosen is than rejected (optional `margin` column)"""


FIELDS = {
    "prompts": ("prompt", "messages", "chosen"),
    "sft": ("prompt", "completion", "messages"),
    "preferences": ("prompt", "chosen", "rejected", "margin"),
    "samples": ("prompt", "completion"),
}


# --------------------------------------------------------------------------- loaders
def load_prompts(cfg: DataConfig) -> list[PromptExample]:
    """The prompts of a prompts, SFT or preference file, each prompt once, per row:

    - `prompt` (text or messages), whatever else the row holds (an SFT `completion`, a pair's `chosen`/`rejected`);
    - `messages` (a trailing assistant turn, an SFT row's completion, is dropped);
    - no `prompt`: `chosen` as a whole conversation (Anthropic HH, message list or "\\n\\nHuman: ..." text),
      whose turns before its last assistant turn are the prompt (the prefix it shares with `rejected`).

    A prompt that repeats (a preference file holds several pairs per prompt) is kept at its first row.
    """
    table, col = _open(cfg, "prompts")
    out, seen = [], set()
    for i, row in enumerate(table.rows):
        where = table.where(i)
        if col["messages"] in row and col["prompt"] not in row:
            msgs = _messages(row[col["messages"]], where, col["messages"])
            if msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            prompt = _check_prompt_turns(msgs, where, col["messages"])
        elif col["chosen"] in row and col["prompt"] not in row:
            prompt = _conversation_prompt(row[col["chosen"]], where, col["chosen"])
        else:
            prompt = _prompt(row, col["prompt"], where)
        key = prompt if isinstance(prompt, str) else tuple((m["role"], m["content"]) for m in prompt)
        if key not in seen:
            seen.add(key)
            out.append(PromptExample(prompt))
    if len(out) < len(table.rows):
        log.info("data: %d repeated prompts in %s kept once", len(table.rows) - len(out), table.source)
    return _done(out, table, "prompts")


def load_sft(cfg: DataConfig) -> list[SFTExample]:
    """Rows with `prompt` + `completion`, or `messages` whose last assistant turn is the completion."""
    table, col = _open(cfg, "sft")
    out = []
    for i, row in enumerate(table.rows):
        where = table.where(i)
        if col["prompt"] in row or col["messages"] not in row:
            prompt = _prompt(row, col["prompt"], where)
            completion = _text(row, col["completion"], where)
        else:
            name = col["messages"]
            msgs = _messages(row[name], where, name)
            last = _last_assistant(msgs, where, name)
            prompt = _check_prompt_turns(msgs[:last], where, name)
            completion = msgs[last]["content"]
        out.append(SFTExample(prompt, completion))
    return _done(out, table, "SFT examples")


def load_samples(cfg: DataConfig) -> list[SFTExample]:
    """A policy's answers: rows with `prompt` + `completion`, where a completion may be empty (an empty answer is
    one the policy gave). The label stage writes them (`<output>.samples.jsonl`)."""
    table, col = _open(cfg, "samples")
    out = []
    for i, row in enumerate(table.rows):
        where = table.where(i)
        prompt = _prompt(row, col["prompt"], where)
        _require(row, col["completion"], where)
        completion = row[col["completion"]]
        if not isinstance(completion, str):
            raise DataError(f"{where}: field '{col['completion']}' must be text, got {_kind(completion)}")
        out.append(SFTExample(prompt, completion))
    return _done(out, table, "policy answers")


def load_preferences(cfg: DataConfig) -> list[PreferenceExample]:
    """Preference pairs in any of three shapes (per row):

    - `prompt` + `chosen` + `rejected`, all text;
    - `prompt` (text or messages) + `chosen`/`rejected` as message lists whose last assistant turn is
      the response (UltraFeedback-binarized);
    - no `prompt`: `chosen`/`rejected` are whole conversations sharing a prefix (Anthropic HH), as
      message lists or as HH text ("\\n\\nHuman: ... \\n\\nAssistant: ..."); the shared prefix is the prompt.

    An optional numeric `margin` column is kept.
    """
    table, col = _open(cfg, "preferences")
    out = []
    for i, row in enumerate(table.rows):
        where = table.where(i)
        cn, rn = col["chosen"], col["rejected"]
        for name in (cn, rn):
            _require(row, name, where)
        if col["prompt"] in row:
            prompt = _prompt(row, col["prompt"], where)
            chosen = _response(row[cn], where, cn)
            rejected = _response(row[rn], where, rn)
        else:
            prompt, chosen, rejected = _split_shared_prefix(row[cn], row[rn], where, cn, rn)
        if chosen.strip() == rejected.strip():
            raise DataError(f"{where}: fields '{cn}' and '{rn}' are identical; a pair needs two different responses")
        margin = _margin(row, col["margin"], where)
        out.append(PreferenceExample(prompt, chosen, rejected, margin))
    return _done(out, table, "preference pairs")


# --------------------------------------------------------------------------- helpers
def _open(cfg: DataConfig, kind: str) -> tuple[Table, dict[str, str]]:
    if not cfg.path:
        raise DataError(f"data path is empty: set `path:` to a {kind} file, a directory or task:<name>/<split>")
    for key in cfg.columns:
        if key not in FIELDS[kind]:
            raise DataError(
                f"{cfg.path}: columns: '{key}' is not a {kind} field (canonical fields: {', '.join(FIELDS[kind])})"
            )
    table = read_table(cfg.path, cfg.max_line_mb)
    if cfg.limit is not None:
        if cfg.limit < 1:
            raise DataError(f"{cfg.path}: limit must be > 0, got {cfg.limit}")
        table.rows, table.numbers = table.rows[: cfg.limit], table.numbers[: cfg.limit]
    col = {name: str(cfg.columns.get(name, name)) for name in FIELDS[kind]}
    for key, name in cfg.columns.items():  # a remap names a field the user expects in every row
        if name not in table.rows[0] and key != "margin":
            present = ", ".join(map(str, table.rows[0])) or "none"
            raise DataError(
                f"{table.where(0)}: columns maps '{key}' to field '{name}', which is missing (fields in the row: {present})"
            )
    return table, col


def _done(examples: list, table: Table, what: str) -> list:
    log.info("data: read %d %s from %s", len(examples), what, table.source)
    return examples


def _require(row: dict, name: str, where: str) -> None:
    if name not in row:
        present = ", ".join(map(str, row)) or "none"
        raise DataError(
            f"{where}: missing field '{name}' (fields in the row: {present}; "
            f"map other names with `columns:`, e.g. columns: {{{name}: <your field>}})"
        )


def _text(row: dict, name: str, where: str) -> str:
    _require(row, name, where)
    return _nonempty_str(row[name], where, name)


def _nonempty_str(value, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}' must be text, got {_kind(value)}")
    if not value.strip():
        raise DataError(f"{where}: field '{name}' is empty")
    return value


def _prompt(row: dict, name: str, where: str) -> Prompt:
    _require(row, name, where)
    value = row[name]
    if isinstance(value, list):
        return _check_prompt_turns(_messages(value, where, name), where, name)
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}' must be text or a list of chat messages, got {_kind(value)}")
    return _nonempty_str(value, where, name)


def _messages(value, where: str, name: str) -> list[Message]:
    if not isinstance(value, list):
        raise DataError(f"{where}: field '{name}' must be a list of chat messages, got {_kind(value)}")
    if not value:
        raise DataError(f"{where}: field '{name}' is an empty list of messages")
    out = []
    for j, m in enumerate(value):
        at = f"{where}: field '{name}' message {j + 1}"
        if not isinstance(m, dict):
            raise DataError(f"{at}: must be an object with 'role' and 'content', got {_kind(m)}")
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{at}: missing '{key}' (a message needs 'role' and 'content')")
        if m["role"] not in ROLES:
            raise DataError(f"{at}: unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        content = m["content"]
        if not isinstance(content, str):
            raise DataError(f"{at}: 'content' must be text, got {_kind(content)}")
        if not content.strip():
            raise DataError(f"{at}: 'content' is empty")
        out.append({"role": m["role"], "content": content})
    return out


def _last_assistant(msgs: list[Message], where: str, name: str) -> int:
    for j in range(len(msgs) - 1, -1, -1):
        if msgs[j]["role"] == "assistant":
            return j
    raise DataError(f"{where}: field '{name}' has no assistant turn (the response must be an assistant message)")


def _check_prompt_turns(msgs: list[Message], where: str, name: str) -> list[Message]:
    if not any(m["role"] == "user" for m in msgs):
        raise DataError(f"{where}: field '{name}' has no user turn before the response")
    if msgs[-1]["role"] == "assistant":
        raise DataError(f"{where}: field '{name}' ends with an assistant turn; a prompt must end with a user turn")
    return msgs


def _response(value, where: str, name: str) -> str:
    """A response is text, or the last assistant message of a message list."""
    if isinstance(value, list):
        msgs = _messages(value, where, name)
        if msgs[-1]["role"] != "assistant":
            raise DataError(f"{where}: field '{name}' must end with the assistant response, not a {msgs[-1]['role']} turn")
        return msgs[-1]["content"]
    return _nonempty_str(value, where, name)


_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")


def _hh_text_to_messages(text: str, where: str, name: str) -> list[Message]:
    parts = _HH_TURN.split("\n\n" + text.lstrip("\n"))
    if len(parts) < 3 or parts[0].strip():
        raise DataError(
            f"{where}: field '{name}' is text but there is no `prompt` field; give a prompt, "
            f"or whole conversations as message lists or HH text ('\\n\\nHuman: ...\\n\\nAssistant: ...')"
        )
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[r], "content": c.strip()} for r, c in zip(parts[1::2], parts[2::2])]


def _conversation_prompt(value, where: str, name: str) -> Prompt:
    """The turns of a whole conversation (message list or HH text) before its last assistant turn."""
    if isinstance(value, str):
        value = _hh_text_to_messages(_nonempty_str(value, where, name), where, name)
    msgs = _messages(value, where, name)
    return _check_prompt_turns(msgs[: _last_assistant(msgs, where, name)], where, name)


def _split_shared_prefix(chosen, rejected, where: str, cn: str, rn: str) -> tuple[Prompt, str, str]:
    convs = []
    for value, name in ((chosen, cn), (rejected, rn)):
        if isinstance(value, str):
            value = _hh_text_to_messages(_nonempty_str(value, where, name), where, name)
        convs.append(_messages(value, where, name))
    c, r = convs
    if c == r:
        raise DataError(f"{where}: fields '{cn}' and '{rn}' are identical; a pair needs two different responses")
    k = 0
    while k < min(len(c), len(r)) and c[k] == r[k]:
        k += 1
    for conv, name in ((c, cn), (r, rn)):
        rest = conv[k:]
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            raise DataError(
                f"{where}: '{cn}' and '{rn}' must be the same conversation differing only in the final "
                f"assistant turn (field '{name}' differs in {len(rest)} turn(s) after the shared prefix)"
            )
    prompt = _check_prompt_turns(c[:k], where, cn) if k else None
    if prompt is None:
        raise DataError(f"{where}: '{cn}' and '{rn}' share no prompt turns; add a `prompt` field")
    return prompt, c[k]["content"], r[k]["content"]


def _margin(row: dict, name: str, where: str) -> float | None:
    if name not in row or row[name] is None or row[name] == "":
        return None
    value = row[name]
    if isinstance(value, str):  # CSV cells are text
        try:
            value = float(value)
        except ValueError:
            raise DataError(f"{where}: field '{name}' must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: field '{name}' must be a finite number, got {value!r}")
    return float(value)


def _kind(value) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
