"""Which constraint kinds may share a prompt, and which pairs only eval prompts combine."""

from __future__ import annotations

SLOTS = {
    "max_words": "words", "min_words": "words", "exact_words": "words", "exact_sentences": "sentences",
    "include_word": "lexical", "exclude_word": "lexical", "letter_count": "letters", "exclude_letter": "letters",
    "lowercase": "case", "uppercase": "case", "end_with": "ending", "bullets": "format", "json_keys": "format",
    "no_commas": "commas",
}
"""kind -> slot: a prompt holds at most one kind of each slot"""
CONFLICTS = {
    frozenset(p) for p in [
        *(("json_keys", k) for k in ("max_words", "min_words", "exact_words", "exact_sentences", "end_with",
                                      "no_commas", "uppercase")),
        ("bullets", "exact_words"), ("bullets", "exact_sentences"), ("bullets", "end_with"),
        ("exact_words", "exact_sentences"),
    ]
}
"""kind pairs that contradict each other (a JSON object with two keys needs a comma, its keys are lower case)"""
HELD_OUT = {
    frozenset(p) for p in [("lowercase", "end_with"), ("include_word", "exact_sentences"), ("bullets", "lowercase"),
                           ("max_words", "no_commas"), ("uppercase", "exclude_word"), ("json_keys", "include_word")]
}
"""kind pairs that share no train prompt: eval's held-out combinations"""


def compatible(constraints: list[dict]) -> bool:
    """No two constraints share a slot or contradict each other; no banned letter is in a required word or key."""
    kinds = [c["kind"] for c in constraints]
    if len({SLOTS[k] for k in kinds}) < len(kinds):
        return False
    if any(frozenset((a, b)) in CONFLICTS for i, a in enumerate(kinds) for b in kinds[i + 1 :]):
        return False
    banned = {c["letter"] for c in constraints if c["kind"] == "exclude_letter"}
    needed = "".join(c.get("word", "") + "".join(c.get("keys", ())) for c in constraints if c["kind"] != "exclude_word")
    return not banned & set(needed)


def has_held_out_pair(constraints: list[dict]) -> bool:
    kinds = [c["kind"] for c in constraints]
    return any(frozenset((a, b)) in HELD_OUT for i, a in enumerate(kinds) for b in kinds[i + 1 :])


__all__ = ["CONFLICTS", "HELD_OUT", "SLOTS", "compatible", "has_held_out_pair"]
