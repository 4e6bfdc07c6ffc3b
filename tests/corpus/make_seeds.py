"""Writes the seed files of tests/corpus/ (run from the repo root: `.venv/bin/python
tests/corpus/make_seeds.py`). The files are kept in the repo; a crash found later is
added as its own `regression_<what>` file, here or by hand."""
import json
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "tests")
from test_session_file import HEADER, LAYERS, TOKENS

from motet.protocol import legacy, mux, wire
from motet.protocol.session_file import write_session

root = Path("tests/corpus")
def put(parser, name, data):
    d = root / parser; d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())

S = mux.Submit(7, 1, 64, 0.7, 0.95, "line one\nligne deux: é 🎉".encode())
put("mux_request", "submit_cancel_stop.bin", mux.encode_submit(S) + mux.encode_cancel(7) + mux.encode_stop(9))
put("mux_request", "grammar.bin", mux.encode_submit(mux.Submit(3, 0, 8, 0.0, 1.0, b"prompt", b"root ::= x")))
put("mux_request", "bad_frame.bin", b"SUBMIT 5 0 3 8 0 1\nabcXCANCEL 5\n")
put("mux_request", "unreadable_headers.bin", b"SUBMIT x y\nHELLO\nCANCEL 0\nCANCEL 4\nSTOP 18446744073709551616\n")
put("mux_request", "bad_field_skips_payload.bin", b"SUBMIT 6 0 5 many 0.5 1\nhello\nCANCEL 6\n")
put("mux_request", "blank_and_crlf.bin", b"\n\n\r\nCANCEL 8\r\n\t \nSTOP 8\n")
put("mux_request", "overlong_line.bin", b"X" * (mux.MAX_LINE + 10) + b"\nSTOP 2\n")
put("mux_request", "odd_numbers.bin", b"SUBMIT 1 -1 2 -5 nan inf\nab\nSUBMIT 2 0 1 1 1e999 -0\nx\nSUBMIT 3 0 99999999999 1 1 1\n")
# regression: a line of \x1c-\x1f alone (str.split() whitespace, not bytes.strip()'s) crashed the decoder
put("mux_request", "regression_info_separator_line.bin", b"\x1c\n\x1f\x1e\nSUBMIT\x1c1 0 1 1 1 1\nx\nCANCEL 1\n")

turn = (mux.encode_data(7, "héllo\nworld") + mux.encode_topk(7, [(-0.1, b"a"), (-2.5, b"\n b"), (-3.0, b"")])
        + b"TURN 7 1 12 0.031\nPERF 7 0.5 0 0 0.4 0 0 0.01\nENTROPY 1.5 2.0\nGPUS 1 0.5 1.0 8\n"
        + b"REPIN 0 1 2 3\nHITS 2 4 a5\n" + mux.encode_done(mux.Done(7, 12, 31.5, 100.0, 1.25, 40, True)))
put("mux_response", "startup.bin", mux.encode_ready() + b"STAT 0 0.00 0.0 0.81\nHWINFO 16 62.0 40.1 0 0.0 cpu|\n"
    b"TIERS 8 0 0 0.1 0.0\nEMAP 2 4 0102030405060708\n")
put("mux_response", "turn.bin", turn)
put("mux_response", "errors.bin", mux.encode_error(9, "CONTEXT_EXCEEDED", 5000, 4096) + mux.encode_error(0, "BAD_REQUEST")
    + mux.encode_error(3, "CANCELLED") + b"ERROR 4 CONTEXT_EXCEEDED x\n")
put("mux_response", "bad_lines.bin", b"DONE 1 STAT x\nTOPK 1 2 -0.1 zz\nERROR\nDATA 1 2\nab\nDATA 1 5\nabc\nTURN 1 2\nFUTURE 1 2\n")
put("mux_response", "load_fail.bin", b"LOAD_FAIL kind=io the model file is gone\n")
put("mux_response", "short_telemetry.bin", b"PERF 1\nPERF 1 0.5\nGPUS 3 1\nEMAP 1\nHITS 1 1 zz\nREPIN\nENTROPY x\n")

put("legacy", "frames.bin", b"hello\n\n\x02RESET\n\x02MORE\n" + legacy.encode_prompt(legacy.RawPrompt("rendered\nprompt é".encode(), 16, 0.7, 0.9, 1)) + b"bye\r\n")
put("legacy", "malformed.bin", b"\x02NOPE\n\x02PROMPT 3 x 0 1\nabc\n\x02PROMPT\nnext\n\x02PROMPT -1 1 1 1\n")
put("legacy", "bad_frame.bin", b"\x02PROMPT 3 4 0 1\nabcXmore\n")
put("legacy", "not_utf8.bin", b"\xff\xfe line\n\x02\x1c\n\x02PROMPT 2 1 nan inf 7\nab\n")

msg = wire.encode_msg(wire.Msg({"id": 5, "max_tokens": 64, "prompt_len": 3}, "the body\nwith lines"))
put("wire_frames", "msgs_and_layer.bin", wire.encode_frame(wire.K_GEN, msg) + wire.encode_frame(wire.K_FIRST, b"")
    + wire.encode_frame(wire.K_LAYER, wire.encode_layer(3, 7, bytes(range(20)))) + wire.encode_frame(200, b"?"))
put("wire_frames", "zero_length.bin", wire.encode_frame(wire.K_GEN, b"a=1\n\n") + b"\x00\x00\x00\x00" + wire.encode_frame(1, b""))
put("wire_frames", "over_limit.bin", struct.pack("<IB", wire.MAX_FRAME + 2, 1) + b"xx")
put("wire_frames", "cut_short.bin", wire.encode_frame(wire.K_RESULT, b"text=abc\n\n")[:-3])
put("wire_msg", "header_and_body.bin", msg)
put("wire_msg", "lenient.bin", b"z=1\na=2\na=3\n=\n\n\n\nbody\n")
put("wire_msg", "no_equals.bin", b"a=1\nno equals sign\n\nbody")
put("wire_msg", "crlf.bin", b"a=1\r\n\r\n")
put("wire_msg", "not_utf8.bin", b"a=1\n\n\xff")
put("wire_layer", "layer.bin", wire.encode_layer(5, 2, b"\x01" + bytes(15)))
put("wire_layer", "short_head.bin", b"\x00" * 15)
bad = bytearray(wire.encode_layer(5, 1, b"\x01" + bytes(15))); bad[-1] ^= 0x80
put("wire_layer", "checksum_mismatch.bin", bytes(bad))

tmp = Path(tempfile.mkdtemp()) / "s.session"
write_session(tmp, HEADER, TOKENS, LAYERS)
good = tmp.read_bytes()
put("session_file", "valid.bin", good)
put("session_file", "truncated.bin", good[: len(good) // 2])
flipped = bytearray(good); flipped[-5] ^= 1
put("session_file", "flipped_layer_byte.bin", bytes(flipped))
put("session_file", "not_a_session.bin", b"GGUF\x03\x00\x00\x00")
put("session_file", "version_2.bin", good[:14] + struct.pack("<I", 2) + good[18:])
def with_header(raw):
    return good[:18] + struct.pack("<I", len(raw)) + raw
put("session_file", "header_not_object.bin", with_header(b"[1, 2]"))
# regressions: json.loads raised RecursionError / ValueError (digit limit) out of the reader
put("session_file", "regression_deep_header.bin", with_header(b"[" * 5000))
put("session_file", "regression_huge_int_header.bin", with_header(b'{"layers": ' + b"9" * 5000 + b"}"))

def js(parser, name, obj, raw=None):
    put(parser, name, raw if raw is not None else json.dumps(obj, indent=1))
HI = [{"role": "user", "content": "Hello!"}]
js("openai_chat", "minimal.json", {"model": "m", "messages": HI})
js("openai_chat", "every_field.json", {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
    {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}],
    "max_completion_tokens": 8, "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "stop": ["x", "y"],
    "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 3, "seed": 1,
    "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u", "cache_slot": 0, "metadata": {"a": 1}})
js("openai_chat", "image_part.json", {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
js("openai_chat", "wrong_types.json", {"model": 5, "messages": "hi", "temperature": "1", "stream": "yes", "stop": [""], "n": True})
js("openai_chat", "limits.json", {"model": "m", "messages": HI * 300, "stop": ["a" * 300], "max_tokens": 10**12})
js("openai_chat", "template_injection.json", {"model": "m", "messages": [{"role": "user", "content": "{{ ''.__class__.__mro__ }}{% for x in range(10**9) %}{% endfor %}"}]})
# regressions: an unhashable role raised TypeError; a lone surrogate reached the tokenizer (500)
js("openai_chat", "regression_role_is_a_list.json", {"model": "m", "messages": [{"role": ["user"], "content": "x"}]})
js("openai_chat", "regression_role_is_an_object.json", {"model": "m", "messages": [{"role": {"a": 1}, "content": "x"}]})
js("openai_chat", "regression_lone_surrogate.json", None, '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}')
js("openai_chat", "regression_lone_surrogate_stop.json", None, '{"model": "m", "messages": [{"role": "user", "content": "a"}], "stop": "\\udfff"}')
js("openai_chat", "nan_and_infinity.json", None, '{"model": "m", "messages": [{"role": "user", "content": "a"}], "temperature": NaN, "top_p": Infinity, "seed": -Infinity}')
js("openai_completion", "minimal.json", {"model": "m", "prompt": "Once upon a time"})
js("openai_completion", "every_field.json", {"model": "m", "prompt": ["Once"], "max_tokens": 4, "temperature": 0,
    "top_p": 1, "stop": "x", "stream": False, "logprobs": 2, "seed": 3, "echo": False, "best_of": 1, "suffix": ""})
js("openai_completion", "refused_fields.json", {"model": "m", "prompt": ["a", "b"], "echo": True, "best_of": 2, "suffix": "s"})
js("openai_completion", "token_ids.json", {"model": "m", "prompt": [1, 2, 3]})
js("openai_completion", "regression_lone_surrogate.json", None, '{"model": "m", "prompt": "\\ud83d"}')
js("openai_completion", "huge_numbers.json", None, '{"model": "m", "prompt": "a", "max_tokens": 1' + "0" * 400 + ', "logprobs": 1e400}')

put("http_body", "not_json.bin", b"{'model': 'm'")
put("http_body", "not_utf8.bin", b'{"model": "\xff"}')
put("http_body", "empty.bin", b"")
put("http_body", "array.json", b"[1, 2, 3]")
# regressions: nesting past the recursion limit raised RecursionError out of json.loads (a 500)
put("http_body", "regression_deep_nesting.json", b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}")
put("http_body", "huge_int.json", b'{"model": "m", "prompt": "a", "seed": ' + b"1" * 5000 + b"}")
put("http_body", "bom.json", b'\xef\xbb\xbf{"model": "m", "prompt": "a", "max_tokens": 1}')
print("ok")
