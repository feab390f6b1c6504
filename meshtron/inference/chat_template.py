"""Chat messages -> prompt text for serving: the tokenizer's own chat template when it has one,
else the ChatML fallback, with `add_generation_prompt=True` (rendering lives in data/chat.py,
shared with supervised fine-tuning). With the fallback, generation stops at `<|im_end|>`.
"""

from __future__ import annotations

from typing import Any, Optional

from meshtron.data.chat import FALLBACK_STOP, fallback_template, message_text, render_messages

__all__ = ["FALLBACK_STOP", "fallback_template", "message_text", "render_chat"]


def render_chat(messages: list[dict[str, Any]], template: Optional[str], tokenizer) -> tuple[str, tuple[str, ...]]:
    """-> (prompt text, extra stop strings)."""
    text = render_messages(messages, template, tokenizer, add_generation_prompt=True)
    return text, (() if template else (FALLBACK_STOP,))
