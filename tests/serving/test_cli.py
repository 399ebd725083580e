"""``tercet serve`` as a user runs it: what it says while starting, when it is ready, and
when it cannot start (one line naming the cause, a non-zero exit, no traceback)."""

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import trio

from ..conftest import child_pids, free_tcp_port

pytestmark = pytest.mark.slow  # starts `tercet serve` itself


async def run_serve(*args, timeout=120):
    """Run ``tercet serve ARGS`` to its end: (exit code, what it wrote)."""
    with trio.fail_after(timeout):
        done = await trio.run_process([sys.executable, "-m", "serving.cli", "serve", *args],
                                      capture_stdout=True, capture_stderr=True, check=False)
    return done.returncode, (done.stdout + done.stderr).decode()


async def test_a_missing_model_is_one_line_and_exit_2():
    code, out = await run_serve("--model", "/no/such/model", "--port", str(free_tcp_port()))
    assert code == 2, out
    assert out.strip().count("\n") == 0 and "model.path: /no/such/model does not exist" in out, out


async def test_a_broken_model_is_one_line_and_exit_1_and_debug_shows_the_traceback(tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    code, out = await run_serve("--model", str(model), "--port", str(free_tcp_port()), "--log-level", "warning")
    assert code == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tercet: could not start: ") and str(model) in lines[0], out
    assert "Traceback" not in out
    code, out = await run_serve("--model", str(model), "--port", str(free_tcp_port()), "--log-level", "debug")
    assert code == 1 and "Traceback" in out and "tercet: could not start: " in out


async def test_it_says_what_it_loads_and_when_it_is_ready_then_stops_on_sigterm():
    """... and a SIGTERM with requests in flight ends each cleanly — a stream with an error event
    and [DONE], a whole answer with a 503, never a cut connection or a hang — and every process exits."""
    port = free_tcp_port()
    server = await trio.lowlevel.open_process(
        [sys.executable, "-m", "serving.cli", "serve", "--model", "tiny", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = b""
    try:
        with trio.fail_after(120):
            while b"ready on" not in log:
                part = await server.stderr.receive_some()
                assert part, log.decode()
                log += part
        results = {}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            assert (await client.get("/health")).status_code == 200
            pids = (await client.get("/server_info")).json()["pids"]
            assert set(pids) == {"scheduler", "detokenizer"}
            # the actors' processes and, once each is ready, its spare (supervision.standby)
            with trio.fail_after(30):
                while len(children := child_pids(server.pid)) < 4:
                    await trio.sleep(0.05)
            assert set(pids.values()) < children
            flowing = trio.Semaphore(0)

            async def long_request(i, stream):
                body = {"input_ids": [5 + i, 6], "stream": stream,
                        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
                async with client.stream("POST", "/generate", json=body) as r:
                    text = ""
                    async for piece in r.aiter_text():  # to the end
                        if not text and stream:
                            flowing.release()
                        text += piece
                results[i] = (stream, r.status_code, text)

            with trio.fail_after(60):  # never a hang
                async with trio.open_nursery() as nursery:
                    for i, stream in enumerate((True, True, False)):
                        nursery.start_soon(long_request, i, stream)
                    for _ in range(2):
                        await flowing.acquire()
                    while (await client.get("/server_info")).json()["running"] < 3:
                        await trio.sleep(0.01)  # the whole one runs too
                    server.send_signal(signal.SIGTERM)
                    while part := await server.stderr.receive_some():
                        log += part
                    assert await server.wait() == 0
        for stream, status, text in results.values():
            if stream:
                assert status == 200 and text.endswith("data: [DONE]\n\n"), text[-300:]
                assert json.loads(text.split("\n\n")[-3].removeprefix("data: "))["error"]["message"] == \
                    "the server is shutting down"
            else:
                assert status == 503 and json.loads(text)["error"]["message"] == "the server is shutting down"
        assert len(results) == 3
        for pid in children:  # no orphans: the spares ended with the server
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()
    text = log.decode()
    loading, ready = text.index("loading tiny"), text.index(f"ready on http://127.0.0.1:{port}")
    assert loading < ready
    assert "{runtime_dir}" not in text and "Running on" not in text and "Traceback" not in text, text
    assert "scheduler ipc:///" in text and "(pid " in text, text
