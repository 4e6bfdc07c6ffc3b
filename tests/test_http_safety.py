"""`motet serve`'s safety, on the real server: API keys, CORS, the body limit, static
files that never leave the web folder, and the bind check. The requests whose exact
bytes matter (`..`, `%2e%2e`, `%2f`) go over raw sockets, since HTTP clients normalise
such paths before sending them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
import trio
from conftest import GOLDEN, REPO, metric
from http_helpers import HELLO, TIMEOUT, in_thread, sync_client, tiny_server, wait_until

from motet.runtime.serve_settings import ServeSettings

KEY = "s3cret-key"


async def raw_get(url: str, target: str) -> tuple[int, bytes]:
    """GET `target` exactly as written; the status and the body (read to its length)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(f"GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                      if k.lower() == "content-length")
        while len(body) < length:
            body += await stream.receive_some(65536)
    return int(lines[0].split()[1]), body


# ---- API keys ----------------------------------------------------------------------


async def test_api_key_required_on_the_api_not_on_health_or_the_page(llama, tmp_path):
    (tmp_path / "index.html").write_text("<p>page</p>")
    async with tiny_server(llama, api_key=KEY, web_dir=tmp_path) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            none = await http.get("/v1/models")
            wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
            bearer = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            x_api_key = await http.get("/v1/models", headers={"x-api-key": KEY})
            experts = await http.get("/experts")
            metrics = await http.get("/metrics", headers={"x-api-key": KEY})
            health = await http.get("/health")
            page = await http.get("/")
        with pytest.raises(openai.AuthenticationError):
            await in_thread(sync_client(url, api_key="wrong").chat.completions.create,
                            model="m", messages=HELLO, max_tokens=1)
        answer = await in_thread(sync_client(url, api_key=KEY).chat.completions.create,
                                 model="m", messages=HELLO, max_tokens=1)
    for refused in (none, wrong, experts):
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.json()["error"]["type"] == "invalid_request_error"
    assert bearer.status_code == x_api_key.status_code == metrics.status_code == 200
    assert health.status_code == 200 and page.text == "<p>page</p>"
    assert answer.choices[0].finish_reason == "length"


def test_public_bind_needs_a_key_or_an_explicit_choice():
    with pytest.raises(ValueError, match="--allow-insecure-bind"):
        ServeSettings(host="0.0.0.0")
    ServeSettings(host="0.0.0.0", api_key=KEY)
    ServeSettings(host="0.0.0.0", allow_insecure_bind=True)
    ServeSettings(host="::1")
    ServeSettings(host="localhost")


def test_timeouts_must_be_positive():
    for name in ("send_timeout_s", "body_timeout_s", "header_timeout_s"):
        for bad in (0, -1.0, float("nan")):
            with pytest.raises(ValueError, match=name):
                ServeSettings(**{name: bad})
    assert ServeSettings().send_timeout_s == 30.0


def test_cli_refuses_a_public_bind_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "MOTET_API_KEY"}
    result = subprocess.run([sys.executable, "-m", "motet", "serve", "--host", "0.0.0.0"],
                            capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert result.returncode == 2
    assert "without an API key" in result.stderr and result.stdout == ""


# ---- CORS and limits ---------------------------------------------------------------


async def test_cors_allow_list_and_preflight(llama):
    allowed, other = "http://localhost:5173", "http://evil.example"
    async with tiny_server(llama, cors_origins=(allowed,), api_key=KEY) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            def preflight(origin):
                return http.options("/v1/chat/completions", headers={
                    "Origin": origin, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type"})
            ok = await preflight(allowed)
            refused = await preflight(other)
            get = await http.get("/v1/models", headers={"Origin": allowed, "x-api-key": KEY})
            get_other = await http.get("/v1/models", headers={"Origin": other, "x-api-key": KEY})
            unauthorized = await http.get("/v1/models", headers={"Origin": allowed})
    assert ok.status_code == 204  # answered before auth: a preflight carries no key
    assert ok.headers["Access-Control-Allow-Origin"] == allowed
    assert "POST" in ok.headers["Access-Control-Allow-Methods"]
    assert "authorization" in ok.headers["Access-Control-Allow-Headers"].lower()
    assert "Access-Control-Allow-Origin" not in refused.headers
    assert get.headers["Access-Control-Allow-Origin"] == allowed and "Origin" in get.headers["Vary"]
    assert "Access-Control-Allow-Origin" not in get_other.headers
    # an error the page must be able to read carries the header too
    assert unauthorized.status_code == 401 and unauthorized.headers["Access-Control-Allow-Origin"] == allowed


async def test_body_too_large_is_413(llama):
    async with tiny_server(llama, max_body_bytes=4096) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            big = await http.post("/v1/completions", json={"model": "m", "prompt": "x" * 8000})
            fits = await http.post("/v1/completions",
                                   json={"model": "m", "prompt": "x" * 100, "max_tokens": 1})
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    assert fits.status_code == 200


# ---- static files ------------------------------------------------------------------


@pytest.fixture
def web(tmp_path):
    """A web folder, with a secret beside it and a symlink in it that points at it."""
    root = tmp_path / "web"
    (root / "js").mkdir(parents=True)
    (root / "index.html").write_text("<p>index</p>")
    (root / "js" / "app.js").write_text("console.log(1)")
    (tmp_path / "secret.txt").write_text("SECRET")
    (tmp_path / "secret").write_text("SECRET")
    (root / "link.txt").symlink_to(tmp_path / "secret.txt")
    (root / "linkdir").symlink_to(tmp_path)
    return root


async def test_static_files_and_the_page_fallback(llama, web):
    async with tiny_server(llama, web_dir=web) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            index = await http.get("/")
            script = await http.get("/js/app.js")
            fallback = await http.get("/chat/some-view")  # no extension: the page's own route
            missing = await http.get("/js/missing.js")
            api = await http.get("/v1/nothing")
    assert index.text == "<p>index</p>" and index.headers["content-type"].startswith("text/html")
    assert script.text == "console.log(1)" and "javascript" in script.headers["content-type"]
    assert fallback.status_code == 200 and fallback.text == "<p>index</p>"
    assert missing.status_code == 404 and api.status_code == 404
    assert api.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("target", [
    "/../secret.txt", "/../secret", "/%2e%2e/secret.txt", "/%2E%2E/secret", "/js/../../secret.txt",
    "/static/..%2f..%2fsecret.txt", "/..%2fsecret.txt", "/..%5csecret.txt", "/..\\secret.txt",
    "//etc/passwd", "/link.txt", "/linkdir/secret.txt", "/linkdir/secret", "/./index.html",
    "/index.html%00.js",
])
async def test_path_traversal_is_404(llama, web, target):
    async with tiny_server(llama, web_dir=web) as (engine, url):
        status, body = await raw_get(url, target)
    assert status in (400, 404), (target, status)
    assert b"SECRET" not in body


async def test_a_name_too_long_for_the_file_system_is_404(llama, web):
    """A segment past the file system's 255 bytes (what the fuzzer sent: combining
    marks, 3 bytes each), with an extension and without: a 404 and the page, not a 500."""
    long_name = "o\u0336\u0319" * 60
    async with tiny_server(llama, web_dir=web) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            with_extension = await http.get(f"/{long_name}.js")
            without = await http.get(f"/{long_name}")
    assert with_extension.status_code == 404
    assert without.status_code == 200 and without.text == "<p>index</p>"


async def test_repo_file_is_not_reachable_through_the_default_web_dir(llama):
    async with tiny_server(llama) as (engine, url):  # the package's web/, two folders below pyproject.toml
        for target in ("/../pyproject.toml", "/../../pyproject.toml", "/%2e%2e/%2e%2e/pyproject.toml",
                       "/static/..%2f..%2f..%2fpyproject.toml"):
            status, body = await raw_get(url, target)
            assert status == 404, target
            assert b"[project]" not in body


async def test_missing_web_dir_shows_a_built_in_page(llama, tmp_path):
    async with tiny_server(llama, web_dir=tmp_path / "nowhere") as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            page = await http.get("/")
            other = await http.get("/app.js")
    assert page.status_code == 200 and "does not exist" in page.text and "nowhere" in page.text
    assert other.status_code == 404


async def test_slow_body_is_408_and_slow_headers_are_cut(llama):
    async with tiny_server(llama, body_timeout_s=0.5, header_timeout_s=0.5) as (engine, url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)) as slow_body:
            await slow_body.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 100\r\n\r\n{\"model\":")
            data = b""
            while b"\r\n\r\n" not in data:
                data += await slow_body.receive_some(65536)
        async with await trio.open_tcp_stream(host, int(port)) as slow_headers:
            await slow_headers.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends
            left = await slow_headers.receive_some(65536)
    assert data.startswith(b"HTTP/1.1 408")
    assert left == b""  # closed without an answer


async def test_every_protected_route_needs_the_key_and_the_open_ones_do_not(llama, monkeypatch):
    # Every route of the app, from its own URL map: a new route is covered by default.
    import hmac

    from motet.http import app as app_module

    compared, original = [], hmac.compare_digest

    def compare_digest(a, b):
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", compare_digest)
    async with tiny_server(llama, api_key=KEY) as (engine, url):
        rules = [(r.rule, m) for r in engine_app_rules() for m in r.methods - {"HEAD", "OPTIONS"}]
        async with httpx.AsyncClient(base_url=url) as http:
            answers = {}
            for rule, method in rules:
                path = rule.replace("<path:model_id>", "llama").replace("<path:path>", "app.js")
                answers[rule] = await http.request(method, path, json={"model": "m", "prompt": "x", "max_tokens": 1})
            compared.clear()
            both = await http.get("/v1/models", headers={"Authorization": "Bearer nope", "x-api-key": "nope2"})
    for rule, response in answers.items():
        protected = rule.startswith(("/v1/", "/experts", "/metrics", "/slots", "/tokenize", "/detokenize"))
        assert (response.status_code == 401) == protected, (rule, response.status_code)
    assert both.status_code == 401
    # both candidates went through the constant-time compare (no early `==` on either)
    assert sorted(compared) == [(b"nope", KEY.encode()), (b"nope2", KEY.encode())]


def engine_app_rules():
    from motet.http.app import create_app

    return list(create_app(None, ServeSettings()).url_map.iter_rules())


def test_the_key_is_not_in_the_settings_repr():
    assert KEY not in repr(ServeSettings(api_key=KEY)) and KEY not in str(ServeSettings(api_key=KEY))


# ---- limits on what one request may ask ------------------------------------------


async def test_request_limits_are_400s_naming_the_field(llama):
    limits = dict(max_context=64, max_messages=3, max_stops=2, max_stop_chars=5, max_prompt_chars=100)
    async with tiny_server(llama, **limits) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            def chat(**body):
                return http.post("/v1/chat/completions", json={"model": "m", "messages": HELLO, **body})

            answers = {
                "messages": await chat(messages=HELLO * 4),
                "max_tokens": await chat(max_tokens=65),
                "max_completion_tokens": await chat(max_completion_tokens=65),
                "stop": await chat(stop=["a", "b", "c"]),
                "stop_chars": await chat(stop="abcdef"),
                "prompt_chars": await chat(messages=[{"role": "user", "content": "x" * 101}]),
                "completion_prompt": await http.post("/v1/completions", json={"model": "m", "prompt": "x" * 101}),
                "surrogate": await http.post("/v1/completions", content=b'{"model": "m", "prompt": "a\\ud800"}'),
            }
            within = await chat(max_tokens=2, stop=["a", "bcdef"], messages=HELLO * 3)
    params = {"stop_chars": "stop", "prompt_chars": "messages", "completion_prompt": "prompt", "surrogate": "prompt"}
    for name, response in answers.items():
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == params.get(name, name), (name, error)
    assert "at most 3" in answers["messages"].json()["error"]["message"]
    assert "[1, 64]" in answers["max_tokens"].json()["error"]["message"]
    assert within.status_code == 200, within.text


async def test_oversized_headers_are_431_and_deeply_nested_json_is_400(llama):
    async with tiny_server(llama, max_header_bytes=4096) as (engine, url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        statuses = []
        for size in (5000, 20_000, 100_000):  # one read, a few, past h11's own limit
            async with await trio.open_tcp_stream(host, int(port)) as stream:
                await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
                head = b""
                while b"\r\n" not in head:
                    head += await stream.receive_some(65536)
                statuses.append(int(head.split()[1]))
        async with httpx.AsyncClient(base_url=url) as http:
            fits = await http.get("/health", headers={"X-Small": "a" * 1000})
            nested = await http.post("/v1/chat/completions", content=b"[" * 5000 + b"]" * 5000)
    assert statuses == [431, 431, 431] and fits.status_code == 200
    assert nested.status_code == 400 and nested.json()["error"]["message"] == "the request body is not valid JSON"


# ---- the chat template's sandbox ---------------------------------------------------


async def test_template_syntax_in_a_message_is_text_not_code(llama):
    hostile = "{{ ''.__class__.__mro__ }}{% for x in range(10**9) %}{% endfor %}"
    async with tiny_server(llama) as (engine, url):
        prompt = engine.render_chat([{"role": "user", "content": hostile}])
        async with httpx.AsyncClient(base_url=url) as http:
            answer = await http.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": hostile}], "max_tokens": 2})
    assert hostile in prompt and "<class" not in prompt  # as written, not evaluated
    assert answer.status_code == 200, answer.text


async def test_a_hostile_model_template_meets_the_sandbox_and_a_clean_400(tmp_path):
    from motet.model import load_model

    model_dir = tmp_path / "llama"
    shutil.copytree(GOLDEN / "llama", model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ messages[0].content }}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    async with tiny_server(load_model(model_dir)) as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            answer = await http.post("/v1/chat/completions", json={"model": "m", "messages": HELLO})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages" and "unsafe" in error["message"]
    assert "<class" not in answer.text and "subclasses" not in error["message"].split("unsafe")[1]


# ---- a client that stops reading ----------------------------------------------------


async def test_a_client_that_stops_reading_loses_its_request_and_its_slot(llama):
    # A streamed answer made bulky with logprobs (about 180 KB), to a client whose receive
    # buffer is tiny and which never reads: the server's write blocks once the buffers are
    # full; past send_timeout_s the server closes the connection, which ends the stream's
    # body (counted as cancelled) and the engine request with it, while another client is
    # served as usual.
    async with tiny_server(llama, send_timeout_s=1.0) as (engine, url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": "m", "messages": HELLO, "max_tokens": 240, "stream": True,
                           "logprobs": True, "top_logprobs": 5}).encode()
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 1024)  # before connect
        await sock.connect((host, int(port)))
        async with trio.SocketStream(sock) as stalled:
            await stalled.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Type: application/json\r\n"
                                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await wait_until(lambda: engine.statistics().running == 1)
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                other = await http.post("/v1/completions",
                                        json={"model": "m", "prompt": "hi", "max_tokens": 2})
                with trio.fail_after(60):
                    while 'finish_reason="cancelled"' not in (metrics := (await http.get("/metrics")).text):
                        await trio.sleep(0.05)
                    await wait_until(lambda: engine.statistics().running == 0)
            received = b""  # now what the buffers held, then the end: no [DONE]
            with trio.fail_after(60):
                try:
                    while data := await stalled.receive_some(1 << 16):
                        received += data
                except trio.BrokenResourceError:  # a reset instead of the end: cut all the same
                    pass
    assert other.status_code == 200, other.text
    assert metric(metrics, "motet_requests_total", finish_reason="cancelled") == 1
    assert metric(metrics, "motet_requests_total", finish_reason="length") == 1
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
