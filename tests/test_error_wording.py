"""Errors that name the real problem: the field the client sent, the content type, the body's
encoding, an unsupported content part, a model path that does not exist."""

import pytest

from kiln.loader import load_source

MODEL = "smollm2"


def _error(response, status=400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_max_completion_tokens_is_named_as_sent(app_client):
    error = _error(app_client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}))
    assert error["param"] == "max_completion_tokens" and error["message"].startswith("max_completion_tokens must")


def test_a_body_that_is_not_declared_json_says_so(app_client):
    error = _error(app_client.post("/v1/completions", content=b'{"model": "smollm2", "prompt": "hi"}',
                               headers={"Content-Type": "text/plain"}))
    assert error["code"] == "invalid_content_type" and "application/json" in error["message"]


def test_bytes_that_are_not_utf8_are_invalid_json(app_client):
    error = _error(app_client.post("/v1/completions", content=b'{"model": "smollm2", "prompt": "\xff\xfe"}',
                               headers={"Content-Type": "application/json"}))
    assert error["code"] == "invalid_json" and "UTF-8" in error["message"]


def test_an_image_part_is_refused_as_unsupported(app_client):
    error = _error(app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}))
    assert error["param"] == "messages[0]" and "'image_url' are not supported" in error["message"]
    assert "Value error" not in error["message"]


def test_a_missing_model_file_is_not_found_not_unknown(tmp_path):
    with pytest.raises(ValueError, match="not found.*check the path"):
        load_source(str(tmp_path / "model.gguf"))
    with pytest.raises(ValueError, match="unknown model 'no-such-preset'"):
        load_source("no-such-preset")
