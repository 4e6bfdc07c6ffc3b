"""The web page of `motet serve`, in a real headless Chromium (the system's, driven by
Playwright; nothing downloads a browser) against the real server on the tiny OLMoE
checkpoint: a typed message streams an answer into the page, the conversation goes back
in full on the next turn, and the expert map draws the server's rows × cols and changes
as tokens are routed. A screenshot is left in tests/artifacts/web_page.png.

Without Chromium or Playwright the test skips, except in CI (CI=true), where it fails."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import COMPILE_CACHE, GOLDEN, REPO

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
SERVER_START_S = 300  # loading and compiling the tiny model, first run without a cache
ANSWER_S = 120
ARTIFACT = REPO / "tests" / "artifacts" / "web_page.png"

# In the page: every length the assistant's text had and every (seq, hits) the map showed.
RECORDER = """() => {
  const rec = (window.__rec = { lengths: [], maps: [] });
  new MutationObserver(() => {
    const el = document.querySelector(".msg.assistant:last-of-type .text");
    const n = el ? el.textContent.length : 0;
    if (n && n !== rec.lengths.at(-1)) rec.lengths.push(n);
  }).observe(document.getElementById("messages"), { subtree: true, childList: true, characterData: true });
  const map = document.getElementById("expert-map");
  new MutationObserver(() => rec.maps.push([+map.dataset.seq, +map.dataset.hits]))
    .observe(map, { attributes: true, attributeFilter: ["data-seq", "data-hits"] });
}"""

# Distinct colours among the canvas's drawn pixels (a blank canvas has none).
CANVAS_COLOURS = """(c) => {
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  for (let i = 0; i < d.length; i += 4) if (d[i + 3]) seen.add(d[i] << 16 | d[i + 1] << 8 | d[i + 2]);
  return seen.size;
}"""


def _unavailable(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why} (CI needs it: .ci/run installs Debian's chromium)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def chromium() -> str:
    if importlib.util.find_spec("playwright") is None:
        _unavailable("Playwright for Python is not installed (pip install -e '.[test]')")
    for name in CHROMIUM_NAMES:
        if path := shutil.which(name):
            return path
    _unavailable(f"no Chromium on PATH (looked for {', '.join(CHROMIUM_NAMES)}; "
                 "apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(chromium, tmp_path_factory):
    """`motet serve` on the tiny OLMoE (2 MoE layers × 8 experts), as a subprocess."""
    with _serve(tmp_path_factory.mktemp("serve")) as base:
        yield base


@contextlib.contextmanager
def _serve(log_dir: Path, *extra: str):
    port = _free_port()
    log_path = log_dir / "serve.log"
    cmd = [sys.executable, "-m", "motet", "serve", "--port", str(port),
           "--model", str(GOLDEN / "olmoe"), "--kv-slots", "2", "--max-context", "256",
           "--compile-cache", str(COMPILE_CACHE), *extra]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not _healthy(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                pytest.fail(f"`motet serve` did not become healthy (exit status {proc.poll()}):\n{tail}")
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_page_streams_an_answer_and_the_expert_map_follows(server, chromium, tmp_path):
    from playwright.sync_api import sync_playwright

    experts = httpx.get(f"{server}/experts", timeout=10).json()
    assert (experts["rows"], experts["cols"]) == (2, 8)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800}, color_scheme="dark")
            problems: list[str] = []
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
            bodies: list[dict] = []
            page.on("request", lambda r: r.url.endswith("/v1/chat/completions")
                    and bodies.append(json.loads(r.post_data)))
            page.set_default_timeout(30_000)

            page.goto(server)
            page.wait_for_selector("#expert-map[data-rows]")
            canvas = page.locator("#expert-map")
            shape = canvas.evaluate("c => [+c.dataset.rows, +c.dataset.cols]")
            assert shape == [experts["rows"], experts["cols"]]
            assert canvas.evaluate(CANVAS_COLOURS) >= 2, "the expert map drew nothing"
            page.wait_for_function("document.getElementById('model').textContent !== '…'")
            assert page.inner_text("#model") == httpx.get(f"{server}/v1/models").json()["data"][0]["id"]
            seq0 = int(canvas.get_attribute("data-seq"))
            before = canvas.evaluate("c => c.toDataURL()")
            page.evaluate(RECORDER)

            # Turn one: typed, sent with the button, streamed in.
            page.fill("#max-tokens", "32")
            page.fill("#prompt", "Name three rivers.")
            page.click("#send")
            answer = page.locator(".msg.assistant").last
            page.wait_for_selector(".msg.assistant[data-state=done]", timeout=ANSWER_S * 1000)
            text = answer.locator(".text").text_content()
            assert text.strip(), "the answer is empty"
            lengths = page.evaluate("window.__rec.lengths")
            assert len(lengths) >= 2 and lengths == sorted(lengths), f"not streamed: {lengths}"
            assert int(answer.get_attribute("data-chunks")) >= 2
            assert "tokens" in answer.locator(".meta").inner_text()  # the turn's stats

            # The map followed: a new HITS window with routed experts, and new pixels.
            page.wait_for_function(f"+document.getElementById('expert-map').dataset.seq > {seq0}")
            maps = page.evaluate("window.__rec.maps")
            assert any(hits > 0 for _, hits in maps), f"no routed experts shown: {maps}"
            assert canvas.evaluate("c => c.toDataURL()") != before, "the expert map did not change"
            assert page.inner_text("#slots").endswith("/2")
            assert float(page.inner_text("#tok-s")) >= 0

            # Turn two, sent with Enter: the whole conversation goes back to the server.
            page.fill("#prompt", "And one more?")
            page.press("#prompt", "Enter")
            page.wait_for_function(
                "document.querySelectorAll('.msg.assistant[data-state=done]').length === 2",
                timeout=ANSWER_S * 1000)
            assert [m["role"] for m in bodies[-1]["messages"]] == ["user", "assistant", "user"]
            assert bodies[-1]["messages"][1]["content"] == text
            assert all(b["stream"] is True for b in bodies)

            shot = tmp_path / "web_page.png"
            page.screenshot(path=str(shot))
            ARTIFACT.parent.mkdir(exist_ok=True)
            shutil.copyfile(shot, ARTIFACT)
            assert not problems, problems
        finally:
            browser.close()


def test_page_asks_for_the_api_key_the_server_wants(chromium, tmp_path):
    from playwright.sync_api import sync_playwright

    with _serve(tmp_path, "--api-key", "s3cret") as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.goto(base)  # the page itself needs no key
            page.wait_for_selector("#key-form:not([hidden])")
            page.wait_for_selector("#health[data-ok=no]")  # /experts refused too
            page.fill("#api-key", "s3cret")
            page.click("#key-form button")
            page.wait_for_selector("#expert-map[data-rows='2'][data-cols='8']")
            page.wait_for_function("document.getElementById('model').textContent === 'olmoe'")
            assert page.get_attribute("#health", "data-ok") == "yes"
            assert page.is_hidden("#key-form")
        finally:
            browser.close()
