"""The request-body limit: over it a 413 JSON error (declared length or counted chunks), under it
the request as usual."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from kiln.server.body_limit import BodyLimit
from kiln.server.errors import install_error_handlers


class Body(BaseModel):
    prompt: str


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=1000)

    @app.post("/echo")
    async def echo(body: Body) -> dict:
        return {"length": len(body.prompt)}

    return TestClient(app)


def test_a_body_under_the_limit_passes(client):
    response = client.post("/echo", json={"prompt": "x" * 900})
    assert response.status_code == 200 and response.json() == {"length": 900}


def test_a_declared_length_over_the_limit_is_refused_unread(client):
    response = client.post("/echo", json={"prompt": "x" * 2000})
    error = response.json()["error"]
    assert response.status_code == 413 and error["code"] == "request_too_large"
    assert "1000 bytes" in error["message"] and "--max-request-bytes" in error["message"]


def test_a_chunked_body_is_counted_and_refused_past_the_limit(client):
    def chunks():
        for _ in range(10):
            yield b'{"prompt": "' + b"x" * 300 + b'"}'

    response = client.post("/echo", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert client.post("/echo", json={"prompt": "still serving"}).status_code == 200
