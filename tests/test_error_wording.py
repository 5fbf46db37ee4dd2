"""Errors that name the real problem: the field the client sent, the content type, the body's
encoding, an unsupported content part, a model path that does not exist."""

import time

import pytest
from fastapi.testclient import TestClient

from kiln.config import EngineConfig
from kiln.loader import load_source
from kiln.server.app import build_app

MODEL = "smollm2"


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(EngineConfig(device="cpu", max_model_len=48, num_kv_blocks=64),
                              served_model_name=MODEL)) as client:
        for _ in range(3000):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        yield client


def _error(response, status=400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_max_completion_tokens_is_named_as_sent(client):
    error = _error(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}))
    assert error["param"] == "max_completion_tokens" and error["message"].startswith("max_completion_tokens must")


def test_a_body_that_is_not_declared_json_says_so(client):
    error = _error(client.post("/v1/completions", content=b'{"model": "smollm2", "prompt": "hi"}',
                               headers={"Content-Type": "text/plain"}))
    assert error["code"] == "invalid_content_type" and "application/json" in error["message"]


def test_bytes_that_are_not_utf8_are_invalid_json(client):
    error = _error(client.post("/v1/completions", content=b'{"model": "smollm2", "prompt": "\xff\xfe"}',
                               headers={"Content-Type": "application/json"}))
    assert error["code"] == "invalid_json" and "UTF-8" in error["message"]


def test_an_image_part_is_refused_as_unsupported(client):
    error = _error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}))
    assert error["param"] == "messages[0]" and "'image_url' are not supported" in error["message"]
    assert "Value error" not in error["message"]


def test_a_missing_model_file_is_not_found_not_unknown(tmp_path):
    with pytest.raises(ValueError, match="not found.*check the path"):
        load_source(str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="unknown model 'no-such-preset'"):
        load_source("no-such-preset")
