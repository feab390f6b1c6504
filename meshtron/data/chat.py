"""Chat messages -> text, with a tokenizer's own Jinja chat template when it has one.

A Hugging Face tokenizer directory may carry a Jinja template (tokenizer_config.json's
`chat_template`, or chat_template.jinja); it is rendered in Jinja's sandbox with `messages`,
`add_generation_prompt` and the bos/eos tokens. Without one, the documented fallback is ChatML:

    <|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n

(the last line only with add_generation_prompt). Serving renders prompts with it (stopping at
`<|im_end|>`); supervised fine-tuning renders whole conversations (data/sft.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

FALLBACK_STOP = "<|im_end|>"


def message_text(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which the text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def fallback_template(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    parts = [f"<|im_start|>{m['role']}\n{message_text(m.get('content'))}{FALLBACK_STOP}\n" for m in messages]
    return "".join(parts) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def render_messages(messages: list[dict[str, Any]], template: Optional[str], tokenizer,
                    add_generation_prompt: bool = True) -> str:
    """The text of `messages` under `template` (None: the ChatML fallback)."""
    if not template:
        return fallback_template(messages, add_generation_prompt)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    normalized = [{**m, "content": message_text(m.get("content"))} for m in messages]

    def token(token_id: Optional[int]) -> str:
        return tokenizer.decode([token_id]) if token_id is not None else ""

    return env.from_string(template).render(messages=normalized, add_generation_prompt=add_generation_prompt,
                                            bos_token=token(getattr(tokenizer, "bos_id", None)),
                                            eos_token=token(getattr(tokenizer, "eod_id", None)))


def read_chat_template(tokenizer_dir: Optional[str]) -> Optional[str]:
    """The Jinja chat template of a Hugging Face tokenizer directory, or None."""
    if not tokenizer_dir:
        return None
    root = Path(tokenizer_dir)
    root = root if root.is_dir() else root.parent
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    config = root / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template
    return None
