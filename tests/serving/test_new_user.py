"""The edges a new user hits first (issue 32): a model tercet cannot serve names its cause in one line,
from ``tercet serve`` and from the offline Engine, and the synchronous Engine takes generate's options."""

import json
import sys

import pytest
import trio

from actors.process import ProcessStartFailed
from models.errors import ModelLoadError
from serving.runtime.engine import Engine

from ..conftest import free_tcp_port

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def bert(tmp_path):
    """A model directory of a family tercet does not serve."""
    model = tmp_path / "bert"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    return model


@pytest.mark.slow  # starts `tercet serve`, whose scheduler runs in a child process
async def test_serve_ends_with_one_line_naming_the_cause_of_a_child_that_failed_to_start(bert):
    with trio.fail_after(120):
        done = await trio.run_process(
            [sys.executable, "-m", "serving.cli", "serve", "--model", str(bert), "--port", str(free_tcp_port()),
             "--log-level", "warning"], capture_stdout=True, capture_stderr=True, check=False)
    out = (done.stdout + done.stderr).decode()
    assert done.returncode == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1].startswith(f"tercet: could not start: {bert}: unsupported architecture 'bert' (supported: "), out
    assert "llama" in lines[-1] and "Traceback" not in out, out
    assert "did not report ready (exit status" not in out, out


def test_the_engine_raises_the_cause_itself(bert):
    with pytest.raises(ModelLoadError, match="unsupported architecture 'bert'"):
        Engine(str(bert))


@pytest.mark.slow  # a scheduler process
def test_the_engine_raises_the_cause_a_child_process_sent_up(bert):
    with pytest.raises(ProcessStartFailed, match=r"unsupported architecture 'bert' \(supported: ") as failed:
        Engine(str(bert), processes=True)
    assert failed.value.kind == "ModelLoadError"


def test_the_sync_engine_passes_generate_options_on():
    with Engine("tiny") as engine:
        [out] = engine.generate(["hello"], GREEDY, return_logprob=True)
    assert len(out["output_ids"]) == 4 and len(out["logprobs"]) == 4
    assert all(isinstance(lp, float) and lp <= 0.0 for lp in out["logprobs"])
