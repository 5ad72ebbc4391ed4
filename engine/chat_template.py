"""Rendering chats with the model's own template (Hugging Face tokenizers), tools included."""

from __future__ import annotations

from typing import Any

import jinja2
import jinja2.meta


def render_chat_ids(tokenizer: Any, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt token ids of `messages`, ending with the assistant turn."""
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    # NOTE: templates write their own special tokens (BOS included) into the text.
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)


def template_has_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads a `tools` variable. A tokenizer with
    several named templates counts its default one; no template, or one that does not
    parse, reads none."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("default")
    if not isinstance(source, str):
        return False
    # The extensions Hugging Face renders templates with, so that they parse the same.
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError:
        return False
