"""Prompt and conversation text, with or without the tokenizer's chat template.

With a chat template (the tokenizer has one and ``chat_template`` is true), a text prompt becomes one
user turn and is rendered with ``add_generation_prompt=True``; a conversation is rendered by the
template with the response as the final assistant turn. Without one, a text prompt is used as is,
a message list becomes ``"role: content"`` lines ending in ``"assistant: "``, and the response is
appended directly (:func:`render_conversation`, the reward model's view, puts a newline between).

The prompt/response boundary is kept exact: :func:`split_conversation` returns the rendered prompt
and the rest of the conversation, and callers tokenize the two parts separately and concatenate
(tests check this equals tokenizing the whole text for a real chat template).
"""

from __future__ import annotations

from quartet.data.schemas import Prompt
from quartet.errors import DataError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def uses_template(tokenizer, chat_template: bool = True) -> bool:
    return chat_template and has_chat_template(tokenizer)


def as_messages(prompt: Prompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def prompt_text(prompt: Prompt) -> str:
    """What a reward function reads as the prompt: the text, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")


def render_prompt(tokenizer, prompt: Prompt, chat_template: bool = True) -> str:
    """The text a policy continues: chat-templated with the generation prompt, or plain."""
    if uses_template(tokenizer, chat_template):
        return _apply(tokenizer, as_messages(prompt), add_generation_prompt=True)
    if isinstance(prompt, str):
        return prompt
    return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "


def split_conversation(tokenizer, prompt: Prompt, response: str, chat_template: bool = True) -> tuple[str, str]:
    """(rendered prompt, rendered rest) whose concatenation is the whole rendered conversation.

    With a chat template the rest includes the template's end-of-turn text (e.g. ``<|im_end|>\\n``).
    If a template does not render the conversation as prompt + something (rare), the rest falls back
    to ``response + eos_token``.
    """
    head = render_prompt(tokenizer, prompt, chat_template)
    if not uses_template(tokenizer, chat_template):
        return head, response
    full = _apply(tokenizer, as_messages(prompt) + [{"role": "assistant", "content": response}])
    if full.startswith(head):
        return head, full[len(head) :]
    return head, response + (tokenizer.eos_token or "")


def render_conversation(tokenizer, prompt: Prompt, response: str, chat_template: bool = True) -> str:
    """Full prompt + response text, as a reward model scores it.

    With a chat template this is exactly ``head + rest`` of :func:`split_conversation`. Without one,
    a text prompt that does not end in whitespace is joined to the response by a newline, so that a
    reward model never reads the last prompt word glued to the first response word.
    """
    head, rest = split_conversation(tokenizer, prompt, response, chat_template)
    if not uses_template(tokenizer, chat_template) and head and not head[-1].isspace():
        return head + "\n" + rest
    return head + rest


def _apply(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja raises TemplateError/TypeError for messages a template rejects
        raise DataError(f"chat template failed on a prompt ({type(e).__name__}: {e}); "
                        f"fix the messages or set `chat_template: false`") from None
