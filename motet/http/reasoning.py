"""A thinking model's answer in two parts, as the text streams in: what it wrote inside
<think>…</think> (the reasoning: `reasoning_content` and `reasoning` on the chat route)
and the rest (the content). Pure.

The block is the answer's reasoning when the answer opens it first thing (Qwen3, and
DeepSeek-R1), or when the chat template already opened it at the end of the prompt
(Qwen3's thinking templates); a <think> later in the text is content. An answer that
never closes the block is reasoning to its end.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def opens_reasoning(prompt: str) -> bool:
    """Whether the chat template left a think block open for the answer."""
    return prompt.rstrip().endswith(START)


class ReasoningSplitter:
    """push(text) → (reasoning, content) ready to send; flush() at the end for what was
    held back (a part that could still become a marker)."""

    def __init__(self, inside: bool):
        self.state = "inside" if inside else "start"  # start → inside → content, or start → content
        self.pending = ""

    def push(self, text: str) -> tuple[str, str]:
        buf = self.pending + text
        self.pending = ""
        if self.state == "start":
            lead = buf.lstrip()
            if lead.startswith(START):
                self.state, buf = "inside", lead[len(START):]
            elif START.startswith(lead):  # nothing but what could still be "<think>"
                self.pending = buf
                return "", ""
            else:
                self.state = "content"
        if self.state == "content":
            return "", buf
        end = buf.find(END)
        if end >= 0:
            self.state = "content"
            return buf[:end], buf[end + len(END):]
        hold = next((k for k in range(min(len(END) - 1, len(buf)), 0, -1) if buf.endswith(END[:k])), 0)
        self.pending = buf[len(buf) - hold:]
        return buf[: len(buf) - hold], ""

    def flush(self) -> tuple[str, str]:
        held, self.pending = self.pending, ""
        return (held, "") if self.state == "inside" else ("", held)


def split(text: str, inside: bool) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    splitter = ReasoningSplitter(inside)
    reasoning, content = splitter.push(text)
    more_reasoning, more_content = splitter.flush()
    return reasoning + more_reasoning, content + more_content
