"""POST /tokenize and /detokenize (vLLM's shape), and `model` left out, against the real
server on both backends: the in-process Engine and a `motet mux` child."""

from __future__ import annotations

import httpx
from http_helpers import HELLO, tiny_server

TEXT = "The quick brown fox jumps over the lazy dog."


async def test_tokenize_and_detokenize_as_the_engine_reads_and_writes(serve_tiny):
    async with serve_tiny() as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            plain = (await http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False})).json()
            prompt = (await http.post("/tokenize", json={"model": "m", "prompt": TEXT})).json()
            content = (await http.post("/tokenize", json={"content": TEXT})).json()  # llama.cpp's name
            chat = (await http.post("/tokenize", json={"messages": HELLO})).json()
            back = await http.post("/detokenize", json={"tokens": plain["tokens"]})
            answer = await http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 2})  # no model
        expected_chat = engine.tokenize(engine.render_chat(HELLO))
        assert plain["tokens"] == engine.tokenize(TEXT, add_special=False) and plain["count"] == len(plain["tokens"])
        assert prompt["tokens"] == content["tokens"] == engine.tokenize(TEXT)
        assert prompt["tokens"][-len(plain["tokens"]):] == plain["tokens"]  # at most a BOS before
        assert chat["tokens"] == expected_chat and chat["max_model_len"] > 0
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}
    assert answer.status_code == 200 and answer.json()["model"] == "llama"


async def test_bad_token_requests_are_400_naming_the_field(llama):
    async with tiny_server(llama) as (engine, url):
        vocab = engine.tokenizer.vocab_size
        async with httpx.AsyncClient(base_url=url) as http:
            answers = {
                "two texts": await http.post("/tokenize", json={"prompt": "a", "messages": HELLO}),
                "no text": await http.post("/tokenize", json={"model": "m"}),
                "not a bool": await http.post("/tokenize", json={"prompt": "a", "add_special_tokens": "yes"}),
                "surrogate": await http.post("/tokenize", content=b'{"prompt": "a\\ud800"}'),
                "empty model": await http.post("/tokenize", json={"prompt": "a", "model": ""}),
                "negative id": await http.post("/detokenize", json={"tokens": [1, -1]}),
                "not ids": await http.post("/detokenize", json={"tokens": ["a"]}),
                "past the vocabulary": await http.post("/detokenize", json={"tokens": [vocab]}),
            }
    params = {name: r.json()["error"]["param"] for name, r in answers.items()}
    assert all(r.status_code == 400 for r in answers.values()), {k: r.text for k, r in answers.items()}
    assert params == {"two texts": "prompt", "no text": "prompt", "not a bool": "add_special_tokens",
                      "surrogate": "prompt", "empty model": "model", "negative id": "tokens",
                      "not ids": "tokens", "past the vocabulary": None}
    assert f"outside the vocabulary of {vocab}" in answers["past the vocabulary"].json()["error"]["message"]


async def test_the_token_routes_take_the_api_key(llama):
    async with tiny_server(llama, api_key="k") as (engine, url):
        async with httpx.AsyncClient(base_url=url) as http:
            refused = await http.post("/tokenize", json={"prompt": "a"})
            taken = await http.post("/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer k"})
    assert refused.status_code == 401 and taken.status_code == 200
