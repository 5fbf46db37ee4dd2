"""`kiln serve` starting and stopping: a failed start exits, SIGTERM finishes or aborts open work."""

import signal
import threading

import pytest

openai = pytest.importorskip("openai")

from server_process import ServerProcess  # noqa: E402

MODEL = "smollm2"


def test_sigterm_finishes_short_streams_and_aborts_what_outlasts_the_timeout():
    # The short stream needs ~2-3 s of the CPU after the signal, the long one ~100 s.
    server = ServerProcess("--shutdown-timeout", "10")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        short = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
        long = client.completions.create(model=MODEL, prompt="The stock market", max_tokens=1000, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
        first_short, first_long = next(short), next(long)
        results = {}

        def read_long():
            try:
                results["long"] = first_long.choices[0].text + "".join(c.choices[0].text for c in long)
            except openai.APIError as e:
                results["long_error"] = e

        reader = threading.Thread(target=read_long)
        reader.start()
        exit_code = server.stop()  # SIGTERM, waits for the process to exit
        short_chunks = [first_short, *short]
        reader.join(timeout=30)
    finally:
        server.stop()
    # uvicorn shuts down, then re-raises the signal it caught, as a process ended by it should.
    assert exit_code in (0, -signal.SIGTERM), server.log_text()
    assert short_chunks[-1].choices[0].finish_reason == "length"
    assert "long" not in results and "shut down" in str(results["long_error"])
    log = server.log_text()
    assert "stopping: 2 request(s) running" in log and "aborting 1 request(s)" in log
    assert "Application shutdown complete" in log


def test_start_up_failure_exits_with_an_error():
    server = ServerProcess("--model", "no-such-model")
    try:
        with pytest.raises(RuntimeError, match="exited with 1"):
            server.wait_ready(timeout_s=120)
    finally:
        server.stop()
    assert "unknown model 'no-such-model'" in server.log_text()


def test_bad_engine_argument_fails_before_the_port_opens():
    server = ServerProcess("--custom-ops", "+rms_norm")
    try:
        with pytest.raises(RuntimeError, match="exited with 2"):
            server.wait_ready(timeout_s=120)
    finally:
        server.stop()
    assert server.port_open_s is None and "exactly one base" in server.log_text()


def test_sigterm_during_a_long_prefill_ends_every_request_within_the_deadline():
    """A 6k-token prompt beside a stream, SIGTERM mid-prefill with a 2 s timeout: steps are
    bounded in time on the CPU, so the deadline holds. The stream ends with an error event and
    [DONE], the long request gets a JSON error, and the process exits soon after the deadline
    (before, the same run lived minutes past the signal and cut the stream mid-chunk)."""
    import http.client
    import json
    import time

    server = ServerProcess("--shutdown-timeout", "2", "--max-num-batched-tokens", "8192")
    results = {}

    def post(name, body, stream):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if stream:
            results[name] = [line.decode().strip() for line in response if line.strip()]
        else:
            results[name] = (response.status, response.read())
        conn.close()

    try:
        server.wait_ready()
        streamer = threading.Thread(target=post, args=("stream", {
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}, True))
        streamer.start()
        long = threading.Thread(target=post, args=("long", {
            "model": MODEL, "prompt": "the cat sat on the mat " * 1000, "max_tokens": 4}, False))
        long.start()
        time.sleep(1.5)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
        exit_s = time.monotonic() - signalled
        streamer.join(30)
        long.join(30)
    finally:
        server.stop()
    log = server.log_text()
    assert exit_s < 2 + 8, f"exited {exit_s:.1f} s after SIGTERM\n{log}"
    events = results["stream"]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "aborted", events[-3:]
    status, body = results["long"]
    assert status == 503 and json.loads(body)["error"]["code"] == "aborted", (status, body)


def test_a_client_that_never_reads_does_not_stall_the_others():
    """One stream whose client reads nothing (its socket buffers fill, the server's send for it
    waits), beside a normal request: the normal one finishes as if alone."""
    import http.client
    import json
    import socket
    import time

    server = ServerProcess()
    try:
        server.wait_ready()
        body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        stalled.connect(("127.0.0.1", server.port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(2.0)  # it streams into buffers nobody empties
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
            headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        took = time.perf_counter() - start
        conn.close()
        status, health = server.get("/health")
        stalled.close()
    finally:
        server.stop()
    assert response.status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
    assert status == 200 and took < 30, took
