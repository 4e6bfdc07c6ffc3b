"""A thinking model's answers on the chat route: <think>…</think> to `reasoning_content`
(and `reasoning`), streamed and not; `chat_template_kwargs` reaches the template; a
grammar waits for the block's end. The model is the tiny llama with a Qwen3-style
template that opens the block unless `enable_thinking` is false."""

from __future__ import annotations

from functools import partial

import openai
import pytest
from conftest import tiny_llama_with_template
from http_helpers import in_thread, sync_client, tiny_server

THINKING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)
ASK = [{"role": "user", "content": "Is the sea blue?"}]


@pytest.fixture(scope="module")
def thinking_llama(tmp_path_factory):
    return tiny_llama_with_template(tmp_path_factory.mktemp("thinking") / "llama", THINKING)


async def test_reasoning_apart_streamed_and_not_and_enable_thinking(thinking_llama):
    async with tiny_server(thinking_llama) as (engine, url):
        client = sync_client(url)
        ask = partial(client.chat.completions.create, model="m", messages=ASK, max_tokens=16, temperature=0)
        thinking = await in_thread(ask)
        chunks = await in_thread(lambda: list(ask(stream=True)))
        plain = await in_thread(ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        waiting = await in_thread(ask, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        bad = await in_thread(lambda: _status(client, {"chat_template_kwargs": {"messages": []}}))
        free = await engine.complete(engine.render_chat(ASK), max_tokens=16)
    message = thinking.choices[0].message
    # the block never closes in 16 tokens of the tiny model: all of it is reasoning
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == free.text
    assert message.content == ""
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == free.text and not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert plain.choices[0].message.content and "reasoning_content" not in plain.choices[0].message.model_extra
    # the grammar waits for "</think>", which never comes: the same free reasoning
    assert waiting.choices[0].message.model_extra["reasoning_content"] == free.text
    assert bad == 400


def _status(client, extra: dict) -> int:
    try:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=2, extra_body=extra)
    except openai.BadRequestError as exc:
        return exc.status_code
    return 200
