"""The verifiable instructions: each kind's sentence in a prompt, how it is read back, and its check.

A constraint is a dict ``{"kind": <name>, <parameter>: <value>}`` (IFEval's instruction ids, Zhou et al. 2023,
cut to what a 135M model can meet). `render` writes its sentence, `parse` finds every constraint sentence in a
prompt (so the judge needs the prompt text only, and a prompt a user writes with these sentences is judged the
same way), `check` tells whether a response meets it. Pure Python, no model.

How the checks read text:

- words: runs of letters and digits, joined by an apostrophe or a hyphen (``don't``, ``well-known`` are one
  word; ``3.5`` is two); markdown marks and punctuation are not words;
- sentences: text up to ``.``, ``!`` or ``?`` (a run such as ``?!`` or ``...`` ends one) followed by a space or
  the end; a last fragment without one counts when it holds a word. A decimal point (``3.5``) ends none, an
  abbreviation (``e.g. this``) does;
- a word's presence: the whole word, any case (``Blue`` meets "blue"; ``blueberry`` does not);
- letters: case-insensitive; upper and lower case are Unicode's (``É`` is upper case);
- the ending: the last character other than spaces, closing quotes and brackets and markdown ``*``/``_``;
- bullets: lines starting (after spaces) with ``-``, ``*`` or ``•`` and a space (``**bold**`` and ``---`` are
  not bullets, nor numbered lines);
- JSON: the whole reply, or the one code fence (```` ```json ... ``` ````) that is the whole reply, parses as an
  object with exactly the keys asked for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
"""counts up to ten are written as words in the prompts"""
END_MARKS = {"?": "a question mark", "!": "an exclamation mark", ".": "a period"}

_WORD = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")
_SENTENCE_END = re.compile(r"[.!?\u2026]+(?=\s|$)")
_BULLET = re.compile(r"^[ \t]*[-*\u2022][ \t]+\S", re.M)
_FENCE = re.compile(r"^```[\w-]*[ \t]*\n(.*?)\n?```$", re.S)
_TRAILING = "\"'\u201d\u2019)]}*_ \t\r\n"


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def sentences(text: str) -> list[str]:
    """The sentences of `text`, each with a word in it (a stray "!" or a bullet mark alone is none)."""
    pieces, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        pieces.append(text[start : m.end()])
        start = m.end()
    pieces.append(text[start:])
    return [p.strip() for p in pieces if words(p)]


def has_word(text: str, word: str) -> bool:
    return any(w.lower() == word.lower() for w in words(text))


def json_object(text: str) -> dict | None:
    """The JSON object the whole reply is (or the one code fence that is the whole reply holds); None otherwise."""
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def ending(text: str) -> str:
    """The reply's last character other than spaces, closing quotes and brackets, markdown emphasis."""
    stripped = text.rstrip(_TRAILING)
    return stripped[-1] if stripped else ""


def _count(n: int) -> str:
    return NUMBERS[n] if 0 <= n < len(NUMBERS) else str(n)


def _quoted(items: list[str]) -> str:
    quoted = [f'"{k}"' for k in items]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


# kind -> (sentence template, check(spec, response)); a template's {n} is a count written as a word
KINDS: dict[str, tuple[str, Callable[[dict, str], bool]]] = {
    "max_words": ("Answer in at most {n} words.", lambda c, r: len(words(r)) <= c["n"]),
    "min_words": ("Answer in at least {n} words.", lambda c, r: len(words(r)) >= c["n"]),
    "exact_words": ("Answer in exactly {n} words.", lambda c, r: len(words(r)) == c["n"]),
    "exact_sentences": ("Answer in exactly {n} sentences.", lambda c, r: len(sentences(r)) == c["n"]),
    "include_word": ('Use the word "{word}" in your answer.', lambda c, r: has_word(r, c["word"])),
    "exclude_word": ('Do not use the word "{word}".', lambda c, r: not has_word(r, c["word"])),
    "letter_count": ('Use the letter "{letter}" at least {n} times.',
                     lambda c, r: r.lower().count(c["letter"]) >= c["n"]),
    "exclude_letter": ('Do not use the letter "{letter}" anywhere.', lambda c, r: c["letter"] not in r.lower()),
    "lowercase": ("Write your whole answer in lowercase letters, with no capital letters.",
                  lambda c, r: any(ch.isalpha() for ch in r) and not any(ch.isupper() for ch in r)),
    "uppercase": ("Write your whole answer in capital letters.",
                  lambda c, r: any(ch.isalpha() for ch in r) and not any(ch.islower() for ch in r)),
    "end_with": ("End your answer with {mark}.", lambda c, r: ending(r) == c["mark"]),
    "bullets": ('Answer with exactly {n} bullet points, each on its own line starting with "- ".',
                lambda c, r: len(_BULLET.findall(r)) == c["n"]),
    "json_keys": ("Answer with only a JSON object that has exactly the keys {keys}.",
                  lambda c, r: (obj := json_object(r)) is not None and set(obj) == set(c["keys"])),
    "no_commas": ("Do not use any commas.", lambda c, r: "," not in r and "\uff0c" not in r),
}


def render(constraint: dict) -> str:
    """The sentence that asks for `constraint`."""
    template = KINDS[constraint["kind"]][0]
    fields = {k: v for k, v in constraint.items() if k != "kind"}
    if "n" in fields:
        fields["n"] = _count(fields["n"])
    if "mark" in fields:
        fields["mark"] = END_MARKS[fields["mark"]]
    if "keys" in fields:
        fields["keys"] = _quoted(fields["keys"])
    return template.format(**fields)


def _pattern(template: str) -> re.Pattern:
    slots = {"n": r"(?P<n>\w+)", "word": r'(?P<word>[^"]+)', "letter": r"(?P<letter>\w)",
             "mark": "(?P<mark>" + "|".join(END_MARKS.values()) + ")", "keys": r'(?P<keys>"[^"]+"(?:(?:, | and )"[^"]+")*)'}
    text = re.escape(template)
    for name, slot in slots.items():
        text = text.replace(re.escape("{" + name + "}"), slot)
    return re.compile(text)


_PATTERNS = {kind: _pattern(template) for kind, (template, _) in KINDS.items()}
_MARKS = {name: mark for mark, name in END_MARKS.items()}


def parse(prompt: str) -> list[dict]:
    """Every constraint whose sentence is in `prompt`, in the order they appear."""
    found = []
    for kind, pattern in _PATTERNS.items():
        for m in pattern.finditer(prompt):
            spec = {"kind": kind}
            for name, value in m.groupdict().items():
                if name == "n":
                    spec["n"] = NUMBERS.index(value) if value in NUMBERS else int(value) if value.isdigit() else None
                    if spec["n"] is None:
                        break
                elif name == "mark":
                    spec["mark"] = _MARKS[value]
                elif name == "keys":
                    spec["keys"] = re.findall(r'"([^"]+)"', value)
                else:
                    spec[name] = value
            else:
                found.append((m.start(), spec))
    return [spec for _, spec in sorted(found, key=lambda x: x[0])]


def check(constraint: dict, response: str) -> bool:
    return bool(KINDS[constraint["kind"]][1](constraint, response))


__all__ = ["END_MARKS", "KINDS", "check", "ending", "has_word", "json_object", "parse", "render", "sentences", "words"]
