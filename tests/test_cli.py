"""`python -m motet` end to end: answers on stdout, logs on stderr."""

from __future__ import annotations

import subprocess
import sys

from conftest import COMPILE_CACHE, GOLDEN, REPO


def motet(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "motet", *args, "--compile-cache", str(COMPILE_CACHE)],
        input=stdin, capture_output=True, text=True, cwd=REPO, timeout=300,
    )


def test_chat_one_shot_answers_paris(default_model_file):
    result = motet("chat", "What is the capital of France?", "--max-tokens", "20")
    assert result.returncode == 0, result.stderr
    # stdout is the answer alone, streamed and ended with a newline; logs went to stderr.
    assert result.stdout == "The capital of France is Paris.\n"
    assert "motet: loading" in result.stderr


def test_info_describes_the_default_model(default_model_file):
    result = motet("info")
    assert result.returncode == 0, result.stderr
    rows = dict(line.split(None, 1) for line in result.stdout.splitlines())
    assert rows["architecture"] == "llama"
    assert rows["layers"] == "30"
    assert rows["experts"] == "0"
    assert 130_000_000 < int(rows["parameters"]) < 140_000_000
    assert rows["path"].endswith(".gguf")
    assert rows["weights"] == "quantized" and rows["kv_dtype"] == "float16"  # llama.cpp's cache type
    # 30 layers, K and V, 3 KV heads of 64, two bytes each
    assert "KV cache: float16, 23,040 bytes a position" in result.stdout
    float32 = motet("info", "--dtype", "float32")
    assert "KV cache: float32, 46,080 bytes a position" in float32.stdout
    chosen = motet("info", "--kv-dtype", "bfloat16")
    assert "KV cache: bfloat16, 23,040 bytes a position" in chosen.stdout


def test_info_tiny_moe():
    result = motet("info", "--model", str(GOLDEN / "qwen3_moe"))
    assert result.returncode == 0, result.stderr
    rows = dict(line.split(None, 1) for line in result.stdout.splitlines())
    assert rows["architecture"] == "qwen3_moe"
    assert (rows["layers"], rows["experts"], rows["moe_layers"]) == ("3", "8", "2")


def test_chat_interactive_reads_stdin_until_eof():
    result = motet("chat", "--model", str(GOLDEN / "llama"), "--max-tokens", "4",
                   stdin="Hello there\n\nTell me about the sea.\n")
    assert result.returncode == 0, result.stderr
    # One answer line per non-empty input line (the tiny model's 4-token greedy answers
    # hold no newline); no "> " prompt marker, since stdin is not a tty.
    assert len(result.stdout.splitlines()) == 2, result.stdout
    assert "> " not in result.stderr
    assert "Traceback" not in result.stderr
