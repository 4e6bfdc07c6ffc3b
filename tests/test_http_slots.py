"""`motet serve`'s slot routes (`POST /slots/{id_slot}?action=save|restore|erase`), on the
real server over the tiny llama, called with httpx: a save,
erase and restore round trip that the next request reuses (on both backends), every bad input refused with
the right status and a message, filenames that would leave the slot folder refused (and
nothing written outside it), the API key, and the 501 without `--slot-save-path`.
No mocks; hard timeouts (the server fixture's); no timing assertions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from http_helpers import TIMEOUT, tiny_server

from motet.cli import build_parser
from motet.http.openai_schema import InvalidRequest
from motet.http.slots import FILENAME_PATTERN, MAX_FILENAME_BYTES, check_filename
from motet.runtime.serve_settings import ServeSettings

KEY = "slot-key-0123"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
SLOTS = 4  # http_helpers.TINY


def files_under(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


async def act(http: httpx.AsyncClient, slot, action: str | None, body=None, **kw) -> httpx.Response:
    params = {"action": action} if action is not None else None
    if body is not None:  # as ASCII JSON, so a lone surrogate travels as "\ud800"
        kw["content"] = json.dumps(body)
        kw["headers"] = {"Content-Type": "application/json", **kw.get("headers", {})}
    return await http.post(f"/slots/{slot}", params=params, **kw)


async def complete(http: httpx.AsyncClient, slot: int) -> tuple[str, int]:
    """The text of a short greedy completion of PROMPT pinned to `slot`, and the prompt
    tokens it reused from the slot."""
    response = await http.post("/v1/completions", json={
        "model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "cache_slot": slot})
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_error(response: httpx.Response, status: int, *, param=None, code=None, says: str = ""):
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert says in error["message"], error
    assert "Traceback" not in response.text


# ---- the round trip ------------------------------------------------------------------


async def test_save_erase_restore_round_trip_is_reused_by_the_next_request(serve_tiny, tmp_path):
    """On both backends: the in-process Engine, and `motet mux` under --engine-cmd."""
    folder = tmp_path / "made" / "slots"  # missing: the server creates it
    async with serve_tiny(slot_save_path=folder) as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            text, cached = await complete(http, 0)
            assert cached == 0
            saved = await act(http, 0, "save", {"filename": "chat.bin"})
            assert saved.status_code == 200, saved.text
            warm_text, warm = await complete(http, 0)  # what a slot that kept its KV reuses
            erased = await act(http, 0, "erase")
            cold_text, cold = await complete(http, 0)
            await act(http, 0, "erase")
            restored = await act(http, 0, "restore", {"filename": "chat.bin"})
            assert restored.status_code == 200, restored.text
            again_text, again = await complete(http, 0)
            # into another slot too: the file is not tied to the slot that saved it
            other = await act(http, 3, "restore", {"filename": "chat.bin"})
            other_text, other_cached = await complete(http, 3)
    save = saved.json()
    assert save["id_slot"] == 0 and save["filename"] == "chat.bin"
    assert save["n_saved"] > 0 and save["n_written"] == (folder / "chat.bin").stat().st_size
    assert isinstance(save["timings"]["save_ms"], float)
    assert files_under(tmp_path) == {"made", "made/slots", "made/slots/chat.bin"}  # no temp file left
    assert erased.json() == {"id_slot": 0, "n_erased": save["n_saved"]}  # warm request held the same tokens
    restore = restored.json()
    assert restore["id_slot"] == 0 and restore["filename"] == "chat.bin"
    assert (restore["n_restored"], restore["n_read"]) == (save["n_saved"], save["n_written"])
    assert isinstance(restore["timings"]["restore_ms"], float)
    assert other.status_code == 200 and other.json()["id_slot"] == 3
    assert warm > 0 and cold == 0 and again == warm and other_cached == warm  # the KV came from the file
    assert text == warm_text == cold_text == again_text == other_text


# ---- bad input -----------------------------------------------------------------------


TRAVERSALS = ["../x", "/etc/passwd", "a/b", "..", ".", "a\\b", "..\\x", "./x", "x/", ".hidden"]


async def test_bad_requests_are_refused_with_the_right_status_and_message(llama, tmp_path):
    folder = tmp_path / "box" / "slots"
    outside = tmp_path / "outside.bin"
    async with tiny_server(llama, slot_save_path=folder) as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            save = lambda slot, body: act(http, slot, "save", body)  # noqa: E731
            restore = lambda slot, body: act(http, slot, "restore", body)  # noqa: E731
            assert_error(await act(http, 0, None), 400, param="action", says="none was given")
            assert_error(await act(http, 0, "fly"), 400, param="action", says="'fly'")
            for slot in (SLOTS, "-1", "abc", "1e3", "0x1", " 1", "99999999999"):
                assert_error(await act(http, slot, "erase"), 400, param="id_slot", says=f"[0, {SLOTS - 1}]")
            assert_error(await save(0, None), 400, param="filename", says="is required")
            assert_error(await save(0, {}), 400, param="filename", says="is required")
            assert_error(await save(0, {"filename": 5}), 400, param="filename", says="must be a string")
            assert_error(await save(0, {"filename": ""}), 400, param="filename", says="is empty")
            assert_error(await save(0, [{"filename": "a.bin"}]), 400, says="JSON object")
            bad_json = await http.post("/slots/0", params={"action": "save"}, content=b'{"filename": ',
                                       headers={"Content-Type": "application/json"})
            assert_error(bad_json, 400, says="not valid JSON")
            for name in TRAVERSALS + ["a\x00b", "tab\there", "x" * (MAX_FILENAME_BYTES + 1), "\ud800"]:
                assert_error(await save(0, {"filename": name}), 400, param="filename")
                assert_error(await restore(0, {"filename": name}), 400, param="filename")
            # a link in the folder that leads out of it
            outside.write_bytes(b"outside")
            (folder / "link.bin").symlink_to(outside)
            assert_error(await save(0, {"filename": "link.bin"}), 400, param="filename", says="leads out")
            assert_error(await restore(0, {"filename": "link.bin"}), 400, param="filename", says="leads out")
            assert outside.read_bytes() == b"outside"
            (folder / "link.bin").unlink()

            assert_error(await restore(0, {"filename": "nothing.bin"}), 404, param="filename",
                         code="file_not_found", says="'nothing.bin'")
            (folder / "sub").mkdir()
            assert_error(await restore(0, {"filename": "sub"}), 400, param="filename", code="is_a_folder")
            assert_error(await save(0, {"filename": "sub"}), 400, param="filename", code="is_a_folder")

            # a refused session file: the reason, and the slot keeps its KV
            _, _ = await complete(http, 1)
            (folder / "junk.bin").write_bytes(b"not a session file at all")
            assert_error(await restore(1, {"filename": "junk.bin"}), 400, param="filename",
                         code="invalid_session_file", says="'junk.bin' cannot be restored: ")
            _, cached = await complete(http, 1)
            assert cached > 0

            # a busy slot
            assert (await save(0, {"filename": "ok.bin"})).status_code == 200
            async with engine.hold_slot(2):
                busy = [await save(2, {"filename": "busy.bin"}), await restore(2, {"filename": "ok.bin"}),
                        await act(http, 2, "erase")]
                for response in busy:
                    assert_error(response, 409, param="id_slot", code="slot_busy", says="busy")
                    assert response.headers["Retry-After"] == "1"
            assert (await act(http, 2, "erase")).status_code == 200  # free again

            # the file system fails: a sentence, no trace, and the folder's path stays out of it
            shutil.rmtree(folder)
            failed = await save(0, {"filename": "gone.bin"})
            assert_error(failed, 500, code="file_error", says="the slot could not be saved to 'gone.bin': ")
            assert str(folder) not in failed.text
    # nothing was written outside the folder (which is gone now)
    assert files_under(tmp_path) == {"box", "outside.bin"}


def test_check_filename_takes_plain_names_only():
    for name in ("chat.bin", "a", "a..b", "x.y.z", "slot-0_ok", "é" * 100, "a b", "x" * MAX_FILENAME_BYTES):
        assert check_filename(name) == name
    for name in TRAVERSALS + [None, 3, "", "a\x00", "a\nb", "\x7f", "é" * 101, "\udc80", "x" * 201]:
        with pytest.raises(InvalidRequest) as refused:
            check_filename(name)
        assert refused.value.param == "filename" and refused.value.message.startswith("'filename' ")


def test_the_documented_pattern_refuses_what_check_filename_refuses():
    import re

    pattern = re.compile(FILENAME_PATTERN)
    for name in TRAVERSALS + ["", "a\x00", "a\nb", "\x7f"]:
        assert pattern.search(name) is None, name
    for name in ("chat.bin", "a..b", "é"):
        assert pattern.search(name), name


# ---- without the folder, and with a key --------------------------------------------------


async def test_without_slot_save_path_save_and_restore_are_501_and_erase_works(llama):
    async with tiny_server(llama) as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            for action in ("save", "restore"):
                response = await act(http, 0, action, {"filename": "chat.bin"})
                assert_error(response, 501, code="not_supported", says="without --slot-save-path")
            await complete(http, 0)
            erased = await act(http, 0, "erase")
            document = (await http.get("/openapi.json")).json()
    assert erased.status_code == 200 and erased.json()["n_erased"] > 0
    action = document["paths"]["/slots/{id_slot}"]["post"]["parameters"][1]
    assert action["name"] == "action" and action["schema"] == {"enum": ["erase"]}


async def test_the_api_key_guards_the_slot_routes(llama, tmp_path):
    async with tiny_server(llama, api_key=KEY, slot_save_path=tmp_path) as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            body = {"filename": "k.bin"}
            none = await act(http, 0, "save", body)
            wrong = await act(http, 0, "save", body, headers={"Authorization": "Bearer nope"})
            wrong_erase = await act(http, 0, "erase", headers={"x-api-key": KEY + "x"})
            written_without_key = files_under(tmp_path)
            bearer = await act(http, 0, "save", body, headers={"Authorization": f"Bearer {KEY}"})
            x_api_key = await act(http, 0, "restore", body, headers={"x-api-key": KEY})
            erase = await act(http, 0, "erase", headers={"x-api-key": KEY})
            document = (await http.get("/openapi.json")).json()
    for response in (none, wrong, wrong_erase):
        assert_error(response, 401, code="invalid_api_key")
    assert written_without_key == set()
    assert (bearer.status_code, x_api_key.status_code, erase.status_code) == (200, 200, 200)
    operation = document["paths"]["/slots/{id_slot}"]["post"]
    assert operation["security"] == [{"bearer": []}, {"apiKey": []}]
    assert operation["parameters"][1]["schema"] == {"enum": ["save", "restore", "erase"]}


# ---- the flag and the setting ------------------------------------------------------------


def test_the_flag_reaches_the_settings_and_a_file_is_no_folder(tmp_path):
    args = build_parser().parse_args(["serve", "--slot-save-path", str(tmp_path / "s")])
    assert args.slot_save_path == tmp_path / "s"
    relative = ServeSettings(slot_save_path="rel/slots").slot_save_path
    assert relative == Path.cwd().resolve() / "rel" / "slots"  # absolute: a request's cwd never matters
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        ServeSettings(slot_save_path=tmp_path / "file")
