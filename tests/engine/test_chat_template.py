"""Chat templates with tools, and the gateway's tokenizer: what the API asks before a
request reaches an engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.chat_template import render_chat_ids, template_has_tools
from engine.models.loader import load_tokenizer
from engine.remote.tokenizer import LocalTokenizer
from engine.structured import INVALID_GRAMMAR, StructuredOutput, StructuredOutputError
from engine.testing import FakeEngine

TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
    "{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("template", "has_tools"), [
    (TOOLS_TEMPLATE, True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    # `tools` set by the template itself is not the caller's variable.
    ("{% set tools = [] %}{{ tools }}{% for m in messages %}{% break %}{% endfor %}", False),
    ({"default": TOOLS_TEMPLATE, "tool_use": TOOLS_TEMPLATE}, True),
    ("{% for m in messages %}", False),  # does not parse
    (None, False),
])
def test_template_has_tools(template: object, has_tools: bool) -> None:
    assert template_has_tools(SimpleNamespace(chat_template=template)) is has_tools


def test_tools_reach_the_template(smollm2_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    tokenizer.chat_template = TOOLS_TEMPLATE
    with_tools = render_chat_ids(tokenizer, MESSAGES, TOOLS)
    assert tokenizer.decode(with_tools) == "<tools>get_weather;</tools><user>hi<assistant>"
    assert tokenizer.decode(render_chat_ids(tokenizer, MESSAGES)) == "<user>hi<assistant>"


def test_the_gateway_tokenizer_checks_specs_itself(
        tiny_model_factory: Callable[[str], Path], tmp_path: Path) -> None:
    local = LocalTokenizer(str(tiny_model_factory("llama_gqa")), tmp_path)
    assert local.vocab_size == local.model_config.vocab_size == 49152
    assert local.chat_template_has_tools is False
    assert local.apply_chat_template(MESSAGES, TOOLS) == local.apply_chat_template(MESSAGES)
    local.check_structured_output(StructuredOutput.regex("[a-z]+"))
    with pytest.raises(StructuredOutputError) as refused:
        local.check_structured_output(StructuredOutput.regex("(unclosed"))
    assert refused.value.code == INVALID_GRAMMAR
    stats = local.grammar_compiler.stats()
    assert (stats.num_compiles, stats.num_refused) == (2, 1)
    local.check_structured_output(StructuredOutput.regex("[a-z]+"))
    assert local.grammar_compiler.stats().hits == 1


def test_the_fake_engine_is_a_gateway_tokenizer() -> None:
    from engine.remote.tokenizer import Tokenizing

    tokenizer: Tokenizing = FakeEngine()  # what the scale-out tests hand RemoteEngine
    assert tokenizer.vocab_size == 256
