"""Text to token ids and back, over a Hugging Face `tokenizers` pipeline.

Two sources: a Hugging Face model folder (`tokenizer.json` and its config files), or the
metadata of a GGUF file, which holds only the vocabulary and merges; for GGUF we rebuild the
pipeline the model was trained with from `tokenizer.ggml.pre`.

BOS is never added by the `tokenizers` post-processor: `encode(add_special=True)` prepends it
when the model's metadata asks for it, so both sources behave the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .errors import ModelFileError, UnsupportedModelError

# Tokens that end an assistant turn in the chat formats we know; a model's EOS set is its
# declared EOS plus whichever of these its vocabulary has as special tokens.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Split patterns of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`; the same
# strings transformers uses for these models.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _digits_then_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # SmolLM's tokenizer.json: every digit is its own piece before the GPT-2 split. This is
    # not the same as GPT-2 alone: "a  1" gives "a", "  ", "1" here but "a", " ", " 1" there.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()]
    )


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


_GGUF_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_pre,
    "gpt-2": _gpt2_pre,
    "smollm": _digits_then_gpt2_pre,
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
}


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def _alphabet_to_byte() -> dict[str, int]:
    return {ch: b for b, ch in _byte_alphabet().items()}


def _byte_level_bytes(token: str) -> bytes:
    to_byte = _alphabet_to_byte()
    if all(ch in to_byte for ch in token):
        return bytes(to_byte[ch] for ch in token)
    return token.encode("utf-8")


def _sentencepiece_bytes(token: str) -> bytes:
    # Byte-fallback pieces are spelled <0xNN>; U+2581 stands for a space.
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    return token.replace("\u2581", " ").encode("utf-8")


class Tokenizer:
    """A model's tokenizer: encode, decode, and the raw bytes of each token."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        byte_level: bool,
        bos_token: str | None,
        eos_tokens: Iterable[str],
        eos_ids: Iterable[int] = (),
        add_bos: bool,
        chat_template: str | None,
    ):
        self._hf = hf
        self._add_bos = add_bos
        self._chat_template = chat_template or None
        vocab_size = hf.get_vocab_size(with_added_tokens=True)

        added = hf.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        # Every id's bytes up front, so the detokenizer does a list lookup per token.
        spell = _byte_level_bytes if byte_level else _sentencepiece_bytes
        table = [b""] * vocab_size
        for token, i in hf.get_vocab(with_added_tokens=False).items():
            table[i] = spell(token)
        for i, tok in added.items():
            table[i] = tok.content.encode("utf-8")
        self._bytes = table

        self._bos_id = hf.token_to_id(bos_token) if bos_token else None
        self._bos_token = bos_token if self._bos_id is not None else None
        eos_tokens = [t for t in eos_tokens if t]
        self._eos_token = eos_tokens[0] if eos_tokens else None
        declared = {hf.token_to_id(t) for t in eos_tokens} | set(eos_ids)
        # End-of-turn names only count as special tokens: a plain vocabulary entry spelled
        # "<|end|>" is just text.
        turn_ends = {i for i in self._special_ids if added[i].content in END_OF_TURN_TOKENS}
        self._eos_ids = frozenset(
            i for i in declared | turn_ends if i is not None and 0 <= i < vocab_size
        )

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """From a Hugging Face model folder: tokenizer.json and the configs beside it."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelFileError(f"{path}: no tokenizer.json")
        spec = _read_json(tokenizer_file)
        try:
            hf = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers reports a bad file as a bare Exception
            raise ModelFileError(f"{tokenizer_file}: cannot be loaded: {exc}") from exc

        config = _read_json(path / "tokenizer_config.json")
        model_config = _read_json(path / "config.json")
        generation = _read_json(path / "generation_config.json")

        bos_token = _token_text(config.get("bos_token"))
        if bos_token is None and isinstance(model_config.get("bos_token_id"), int):
            bos_token = hf.id_to_token(model_config["bos_token_id"])
        eos_token = _token_text(config.get("eos_token"))
        eos_ids = _ids(generation.get("eos_token_id")) | _ids(model_config.get("eos_token_id"))
        if eos_token is None and eos_ids:
            eos_token = hf.id_to_token(min(eos_ids))

        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = bos_token is not None and _post_processor_adds(spec.get("post_processor"), bos_token)

        return cls(
            hf,
            byte_level=_uses_byte_level(spec),
            bos_token=bos_token,
            eos_tokens=[eos_token] if eos_token else [],
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=_chat_template(path, config),
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, object]) -> Tokenizer:
        """A byte-level BPE from GGUF metadata (`tokenizer.ggml.*` keys as plain values)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"GGUF pre-tokenizer {pre!r} is not supported "
                f"(supported: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))})"
            )
        try:
            tokens = _strings(meta, "tokenizer.ggml.tokens")
            # a merge without its space fails to unpack: ValueError
            merges = [(a, b) for a, b in (m.split(" ", 1) for m in _strings(meta, "tokenizer.ggml.merges"))]
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"GGUF tokenizer lacks its vocabulary or merges: {exc}") from exc
        given_types = meta.get("tokenizer.ggml.token_type")
        types = given_types if isinstance(given_types, list) else [1] * len(tokens)

        alphabet = set(_byte_alphabet().values())
        spelling = _byte_alphabet()
        # A vocabulary entry written with characters outside the byte alphabet (a raw space,
        # say) is respelled into it, as transformers does, so that BPE can reach it.
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        hf.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
        hf.decoder = decoders.ByteLevel()

        # Control tokens whose text is not in the byte alphabet are llama.cpp mislabels;
        # adding them would push the vocabulary past the embedding table.
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _CONTROL and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types)
            if kind == _USER_DEFINED and t in vocab
        ]
        hf.add_special_tokens(control)
        hf.add_tokens(user)

        def token_at(key: str) -> str | None:
            i = meta.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        template = meta.get("tokenizer.chat_template")
        return cls(
            hf,
            byte_level=True,
            bos_token=token_at("tokenizer.ggml.bos_token_id"),
            eos_tokens=[t for t in [token_at("tokenizer.ggml.eos_token_id"),
                                    token_at("tokenizer.ggml.eot_token_id")] if t],
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=template if isinstance(template, str) else None,
        )

    # -- properties ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def special_ids(self) -> frozenset[int]:
        """Control tokens: they carry structure, not text."""
        return self._special_ids

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    # -- encode / decode -------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become those tokens."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_special and self._add_bos and self._bos_id is not None:
            ids.insert(0, self._bos_id)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids: BOS first where the model wants one, unless the text opens with
        it already (a rendered chat template)."""
        return self.encode(text, add_special=self.add_bos and not (self.bos_token and text.startswith(self.bos_token)))

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for; a special token gives its text as UTF-8."""
        if not 0 <= token_id < len(self._bytes):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._bytes)}")
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids


# -- helpers for the Hugging Face folder ---------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise ModelFileError(f"{path}: not readable JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value: object) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _chat_template(path: Path, config: dict) -> str | None:
    # Newer repos keep the template in its own file, which wins over the config's copy.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _components(node: object, kind: str) -> list[dict]:
    """Every component of type `kind` in a (possibly nested Sequence) pipeline stage."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == kind:
        return [node]
    inner = node.get("pretokenizers") or node.get("decoders") or node.get("processors") or []
    return [c for part in inner for c in _components(part, kind)]


def _uses_byte_level(spec: dict) -> bool:
    return bool(_components(spec.get("decoder"), "ByteLevel")
                or _components(spec.get("pre_tokenizer"), "ByteLevel"))


def _post_processor_adds(post: object, bos_token: str) -> bool:
    # Llama 3 style: no add_bos_token flag, but a TemplateProcessing that starts with BOS.
    for template in _components(post, "TemplateProcessing"):
        single = template.get("single") or []
        first = single[0] if single else {}
        if first.get("SpecialToken", {}).get("id") == bos_token:
            return True
    return False


def _strings(meta: Mapping[str, object], key: str) -> list[str]:
    """A GGUF metadata array of strings: KeyError where absent, TypeError where not one."""
    value = meta[key]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise TypeError(f"{key!r} is not an array of strings")
    return value
