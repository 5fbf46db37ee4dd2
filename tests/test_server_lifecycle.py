"""`kiln serve` starting and stopping: a failed start exits, SIGTERM finishes or aborts open work."""

import signal
import threading

import pytest

openai = pytest.importorskip("openai")

from server_process import ServerProcess  # noqa: E402

MODEL = "smollm2"


def test_sigterm_finishes_short_streams_and_aborts_what_outlasts_the_timeout():
    server = ServerProcess("--shutdown-timeout", "3")
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
