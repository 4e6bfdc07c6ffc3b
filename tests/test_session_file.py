"""The session file: round trips, the byte layout of docs/sessions.md, every refusal with
its reason, corruption and truncation anywhere, and atomic writes that leave nothing
behind when they fail."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from motet.protocol.session_file import (
    MAGIC,
    Session,
    SessionError,
    SessionHeader,
    open_session,
    read_session,
    write_session,
)
from motet.protocol.wire import layer_checksum

HEADER = SessionHeader(
    model="sha256:5e5510n",
    engine_version="0.1.0",
    dtype="bfloat16",
    layers=3,
    kv_heads=2,
    head_dim=4,
    k_layout="tokens,kv_heads,head_dim",
    v_layout="tokens,kv_heads,head_dim",
    max_context=16,
    rope_theta=10000,
    rope_scaling="",
    settings={"backend": "cpu"},
)
TOKENS = (1, 2, 3, 2**32 - 1, 0)
ROW = HEADER.kv_heads * HEADER.head_dim * 2  # bytes per token of K (or V) in bfloat16
LAYERS = tuple(
    (bytes(random.Random(i).randbytes(ROW * len(TOKENS))), bytes(random.Random(~i).randbytes(ROW * len(TOKENS))))
    for i in range(HEADER.layers)
)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def path(tmp_path):
    return tmp_path / "slot.session"


def saved(path, header=HEADER, tokens=TOKENS, layers=LAYERS) -> bytes:
    write_session(path, header, tokens, layers)
    return path.read_bytes()


def refusal(path, data: bytes, expect=HEADER) -> str:
    path.write_bytes(data)
    with pytest.raises(SessionError) as exc:
        read_session(path, expect)
    return str(exc.value)


def layout(data: bytes) -> dict:
    """Offsets of the parts of a file of HEADER's shape, found from the format's own
    length fields (the spec in docs/sessions.md, written a second time)."""
    at = len(MAGIC) + 4
    (head_len,) = struct.unpack_from("<I", data, at)
    at += 4 + head_len
    out = {"header": len(MAGIC) + 8, "count": at}
    (count,) = struct.unpack_from("<Q", data, at)
    at += 16 + 4 * count
    for i in range(HEADER.layers):
        out[f"mark {i}"] = at
        at += 4
        for which in "KV":
            (n,) = struct.unpack_from("<Q", data, at)
            out[f"layer {i} {which}"] = (at + 16, n)
            at += 16 + n
    out["end"] = at
    return out


def test_a_session_round_trips(path):
    size = write_session(path, HEADER, TOKENS, iter(LAYERS))
    assert size == path.stat().st_size
    assert read_session(path, HEADER) == Session(HEADER, TOKENS, LAYERS)
    assert path.stat().st_mode & 0o777 == 0o600  # KV holds the conversation
    assert os.listdir(path.parent) == [path.name]


def test_the_bytes_follow_the_documented_layout(path):
    data = saved(path)
    assert data.startswith(b"motet session\n\x01\x00\x00\x00")
    head_len = struct.unpack_from("<I", data, len(MAGIC) + 4)[0]
    head = json.loads(data[len(MAGIC) + 8 : len(MAGIC) + 8 + head_len])
    assert head["settings"] == {"backend": "cpu"} and head["rope_theta"] == 10000.0 and head["layers"] == 3
    parts = layout(data)
    count, token_sum = struct.unpack_from("<QQ", data, parts["count"])
    token_bytes = data[parts["count"] + 16 : parts["count"] + 16 + 4 * count]
    assert struct.unpack(f"<{count}I", token_bytes) == TOKENS and token_sum == layer_checksum(token_bytes)
    for i, (k, v) in enumerate(LAYERS):
        assert struct.unpack_from("<I", data, parts[f"mark {i}"]) == (i,)
        for which, blob in zip("KV", (k, v)):
            at, n = parts[f"layer {i} {which}"]
            assert data[at : at + n] == blob
            assert struct.unpack_from("<Q", data, at - 8) == (layer_checksum(blob),)
    assert parts["end"] == len(data)


def test_layers_can_be_read_one_at_a_time(path):
    data = bytearray(saved(path))
    at, _ = layout(data)["layer 2 V"]
    data[at] ^= 1
    path.write_bytes(data)
    with open_session(path, HEADER) as s:
        assert s.tokens == TOKENS
        layers = s.layers()
        assert next(layers) == LAYERS[0] and next(layers) == LAYERS[1]
        with pytest.raises(SessionError, match="^layer 2 V: "):
            next(layers)


def test_any_buffer_can_be_written(path):
    arrays = [(np.arange(4, dtype=np.float32), bytearray(b"v")), (memoryview(b"k"), b""), (b"", b"")]
    write_session(path, HEADER, [], arrays)
    assert read_session(path, HEADER).layers == ((np.arange(4, dtype=np.float32).tobytes(), b"v"), (b"k", b""), (b"", b""))


# ---- refusals ------------------------------------------------------------------------


def test_not_a_session_file(path):
    assert refusal(path, b"GGUF" + bytes(100)) == "not a session file: it does not start with motet's session magic"


def test_an_unsupported_version(path):
    data = bytearray(saved(path))
    data[len(MAGIC)] = 2
    assert refusal(path, data) == "unsupported session format version 2 (this motet reads version 1)"


CHANGES = {
    "model": "sha256:other",
    "engine_version": "0.2.0",
    "dtype": "float32",
    "layers": 4,
    "kv_heads": 8,
    "head_dim": 64,
    "k_layout": "kv_heads,tokens,head_dim",
    "v_layout": "kv_heads,head_dim,tokens",
    "max_context": 4096,
    "rope_theta": 500000.0,
    "rope_scaling": "yarn factor=4",
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_each_header_field_is_checked_and_named(path, name):
    data = saved(path)
    expect = dataclasses.replace(HEADER, **{name: CHANGES[name]})
    message = refusal(path, data, expect)
    assert message == (
        f"the session does not match this engine: {name}: expected {CHANGES[name]!r}, found {getattr(HEADER, name)!r}"
    )


def test_settings_are_checked_key_by_key(path):
    data = saved(path)
    expect = dataclasses.replace(HEADER, dtype="float32", settings={"backend": "cuda", "flash": "1"})
    assert refusal(path, data, expect) == (
        "the session does not match this engine: dtype: expected 'float32', found 'bfloat16'; "
        "settings['backend']: expected 'cuda', found 'cpu'; settings['flash']: expected '1', found nothing"
    )


def test_an_unreadable_header(path):
    data = bytearray(saved(path))
    data[len(MAGIC) + 8] = ord("[")
    assert refusal(path, data).startswith("the header is not readable: ")
    data[len(MAGIC) + 4 : len(MAGIC) + 8] = struct.pack("<I", 2**31)
    assert refusal(path, data) == "the header is not readable: it claims 2147483648 bytes, over the limit of 1048576"


def test_a_token_count_out_of_range(path):
    data = bytearray(saved(path))
    data[layout(data)["count"]] = HEADER.max_context + 1
    assert refusal(path, data) == "token count 17 out of range: the max context is 16"
    with pytest.raises(ValueError, match="do not fit the max context of 16"):
        write_session(path, HEADER, range(17), LAYERS)


def test_a_changed_token_is_caught(path):
    data = bytearray(saved(path))
    data[layout(data)["count"] + 16] ^= 4
    assert refusal(path, data).startswith("the token ids: the checksum says ")


def test_a_layer_record_out_of_place(path):
    data = bytearray(saved(path))
    data[layout(data)["mark 1"]] = 5
    assert refusal(path, data) == "layer 1: the record is marked layer 5"


def test_trailing_bytes(path):
    assert refusal(path, saved(path) + b"xyz") == "trailing bytes after the last layer (3 of them)"


@FAST
@given(st.integers(0, HEADER.layers - 1), st.sampled_from("KV"), st.integers(0, 10**6), st.integers(1, 255))
def test_a_flipped_byte_in_the_layer_data_is_refused_naming_the_layer(path, layer, which, pos, mask):
    data = bytearray(saved(path))
    at, n = layout(data)[f"layer {layer} {which}"]
    data[at + pos % n] ^= mask
    assert refusal(path, data).startswith(f"layer {layer} {which}: the checksum says ")


def test_a_flipped_byte_anywhere_is_refused(path):
    data = saved(path)
    for pos in range(len(data)):
        for mask in (0x01, 0x80):
            flipped = bytearray(data)
            flipped[pos] ^= mask
            refusal(path, flipped)


def test_truncation_anywhere_is_refused(path):
    data = saved(path)
    for end in range(len(data)):
        assert refusal(path, data[:end]).startswith("truncated: the file ends inside ")


@FAST
@given(st.integers(1, 40), st.data())
def test_truncation_of_larger_files_is_refused(path, tokens, draw):
    layers = [(random.randbytes(ROW * tokens), random.randbytes(ROW * tokens)) for _ in range(HEADER.layers)]
    header = dataclasses.replace(HEADER, max_context=64)
    data = saved(path, header, range(tokens), layers)
    end = draw.draw(st.integers(0, len(data) - 1))
    assert refusal(path, data[:end], header).startswith("truncated: ")


# ---- atomic writes -------------------------------------------------------------------


def crashing_layers():
    yield LAYERS[0]
    raise OSError("the device went away")


def test_a_crash_mid_write_leaves_no_file_and_no_temp_file(path):
    with pytest.raises(OSError, match="went away"):
        write_session(path, HEADER, TOKENS, crashing_layers())
    assert os.listdir(path.parent) == []


@pytest.mark.parametrize(
    "layers, error",
    [(crashing_layers, OSError), (lambda: LAYERS[:2], ValueError), (lambda: LAYERS * 2, ValueError)],
)
def test_a_failed_write_leaves_the_old_file_untouched(path, layers, error):
    good = saved(path)
    with pytest.raises(error):
        write_session(path, dataclasses.replace(HEADER, engine_version="0.2.0"), TOKENS, layers())
    assert path.read_bytes() == good and os.listdir(path.parent) == [path.name]
    assert read_session(path, HEADER).layers == LAYERS


def test_bad_tokens_are_refused_before_anything_is_written(path):
    for tokens in ([-1], [2**32], ["7"]):
        with pytest.raises(ValueError, match="token ids are integers"):
            write_session(path, HEADER, tokens, LAYERS)
    assert os.listdir(path.parent) == []


@pytest.mark.parametrize(
    "change", [{"layers": 0}, {"head_dim": True}, {"rope_theta": float("nan")}, {"dtype": None}, {"settings": {"a": 1}}]
)
def test_a_header_that_could_not_match_is_refused(change):
    with pytest.raises(ValueError):
        dataclasses.replace(HEADER, **change)
