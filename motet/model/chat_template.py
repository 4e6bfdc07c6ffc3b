"""Render a conversation into a prompt with the model's Jinja chat template.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable
sandbox, set up the way `transformers` sets it up, so that a template renders here exactly as
it does in `apply_chat_template`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# For models that ship no template: ChatML, which the SmolLM and Qwen families use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{{ message['content'] }}{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation, or could not be compiled or rendered."""


class _Raised(jinja2.TemplateError):
    """A template's own `raise_exception`: its message is meant for the caller as is."""


def _raise_exception(message: str):
    raise _Raised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which could reach CPython internals."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra,
) -> str:
    """The prompt text for `messages`; `extra` (tools, documents, ...) reaches the template."""
    # Like transformers: a key set to None is dropped, since templates test for a missing key
    # (OpenAI clients send content=None beside tool_calls) but would print "None".
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    extra.setdefault("tools", None)
    extra.setdefault("documents", None)
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except _Raised as exc:
        raise ChatTemplateError(str(exc)) from exc
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        # Syntax errors, undefined names, sandbox refusals, and a template doing arithmetic
        # on the wrong types all mean the template cannot take this conversation.
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
