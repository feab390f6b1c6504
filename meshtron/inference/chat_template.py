"""Chat messages -> prompt text, with the tokenizer's own chat template when it has one.

A Hugging Face tokenizer directory may carry a Jinja template (tokenizer_config.json's
`chat_template`, or chat_template.jinja); it is rendered in Jinja's sandbox with `messages`,
`add_generation_prompt=True` and the special tokens. Tokenizers without one (the byte tokenizer,
SentencePiece and tiktoken files) use the documented fallback, ChatML-style:

    <|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n

and generation stops at the string `<|im_end|>` (added to the request's stop strings).
"""

from __future__ import annotations

from typing import Any, Optional

FALLBACK_STOP = "<|im_end|>"


def message_text(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which the text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def fallback_template(messages: list[dict[str, Any]]) -> str:
    parts = [f"<|im_start|>{m['role']}\n{message_text(m.get('content'))}{FALLBACK_STOP}\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def render_chat(messages: list[dict[str, Any]], template: Optional[str], tokenizer) -> tuple[str, tuple[str, ...]]:
    """-> (prompt text, extra stop strings)."""
    if not template:
        return fallback_template(messages), (FALLBACK_STOP,)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    normalized = [{**m, "content": message_text(m.get("content"))} for m in messages]

    def token(token_id: Optional[int]) -> str:
        return tokenizer.decode([token_id]) if token_id is not None else ""

    text = env.from_string(template).render(messages=normalized, add_generation_prompt=True,
                                            bos_token=token(getattr(tokenizer, "bos_id", None)),
                                            eos_token=token(getattr(tokenizer, "eod_id", None)))
    return text, ()
