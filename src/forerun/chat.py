"""Chat prompts: the tokenizer's own chat template where it has one, else a plain-text layout.

Shared by ``forerun generate --chat`` and the server's ``/v1/chat/completions``.
"""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def plain_chat_text(messages: list[dict]) -> str:
    """The fallback for tokenizers without a chat template: 'Role: content' blocks, then 'Assistant:'."""
    parts = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation ready for the assistant's turn.

    The template is rendered to text and then tokenized without adding special tokens (the
    template writes its own BOS where the model wants one). Rendering to text sidesteps what
    ``apply_chat_template(tokenize=True)`` returns, which differs between transformers releases
    (a list of ids, or a mapping with ``input_ids`` in transformers 5)."""
    if not has_chat_template(tokenizer):
        return list(tokenizer(plain_chat_text(messages)).input_ids)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):  # a batch of one
        text = text[0]
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def uses_chat(tokenizer, chat: str = "auto") -> bool:
    """Whether prompts go in as user turns: ``chat`` "on", or "auto" where the tokenizer has a template."""
    return chat == "on" or (chat == "auto" and has_chat_template(tokenizer))


def prompt_ids(tokenizer, text: str, chat: str = "auto") -> list[int]:
    """A prompt's token ids: as a user turn of the chat template where ``uses_chat``, else the
    text as it is."""
    if uses_chat(tokenizer, chat):
        return chat_ids(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text).input_ids)
