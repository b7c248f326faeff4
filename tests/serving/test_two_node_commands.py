"""The two-node model of `two_node_model.py` reaches `mstar-jax check`, `run` and `serve` the way a user's
model would: its deployment names `tests.serving.two_node_model:ENTRY`, and nothing in this package names
it. What `run` reports and what `serve` answers are each request's outputs served alone."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from mstar_jax.cli import main
from mstar_jax.deployment import load_deployment
from mstar_jax.engine import ServingEngine
from mstar_jax.settings import EngineSettings
from tests.serving.two_node_model import TwoNodeConfig, TwoNodeRequest, TwoNodeServing

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = """\
model:
  name: tests.serving.two_node_model:ENTRY
  config: {slots: 2, seed: 0}
engine: {max_batch: 2}
compile: {batch_sizes: [1, 2]}
workload:
  streams: 3
  arrival_rate_hz: null
  min_text_tokens: 2
  max_text_tokens: 6
  min_new_tokens: 7
  max_new_tokens: 7
  seed: 5
"""


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("two_node") / "two_node.yaml"
    path.write_text(DEPLOYMENT)
    return path


@pytest.fixture(scope="module")
def engine() -> ServingEngine:
    engine = ServingEngine(TwoNodeServing(TwoNodeConfig(slots=2)), settings=EngineSettings(max_batch=2))
    engine.warm_up()
    return engine


def alone(engine: ServingEngine, request: TwoNodeRequest) -> list[list[list[float]]]:
    """`request`'s outputs served alone, each chunk's floats as lists (as JSON carries them)."""
    return [output.values.tolist() for output in engine.stream(request)]


def test_check_counts_the_models_own_memory_through_its_entry(config, capsys):
    assert main(["check", str(config)]) == 0
    out = capsys.readouterr().out
    assert "bytes_kv" in out  # both caches' costs
    assert "chunks_kv" in out
    assert "model weights" in out


def test_run_serves_the_workload_and_reports_each_streams_outputs(config, engine, tmp_path, capsys):
    output = tmp_path / "run"
    assert main(["run", "--config", str(config), "--output", str(output), "--no-progress"]) == 0
    assert "streams 3/3 done" in capsys.readouterr().out
    report = json.loads((output / "report.json").read_text())
    assert (output / "step_latency.png").stat().st_size > 0
    assert report["streams"] == {"submitted": 3, "done": 3}
    # The workload the model draws, drawn again here: each request served alone gives what `run` reported.
    workload = load_deployment(config).workload
    rng = np.random.default_rng(workload.seed)
    sizes = rng.integers(workload.min_text_tokens, workload.max_text_tokens + 1, workload.streams)
    for i, n in enumerate(sizes):
        prompt = rng.integers(0, 256, n).astype(np.uint8).tobytes()
        want = alone(engine, TwoNodeRequest(f"alone-{i}", prompt, workload.max_new_tokens))
        assert report["outputs"][f"w{i}"] == want


@pytest.mark.serve
@pytest.mark.slow
def test_serve_answers_each_stream_with_its_outputs_alone_and_refuses_bad_fields(config, engine, tmp_path):
    import httpx

    from tests.server.support import serve_process

    log = tmp_path / "serve.log"
    with serve_process(config, log=log) as (server, url):
        with httpx.Client(base_url=url, timeout=60) as client:
            answer = client.post("/v1/streams", json={"prompt": "hello", "max_tokens": 9})
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"] == alone(engine, TwoNodeRequest("a", b"hello", 9))
            with client.stream(
                "POST", "/v1/streams", json={"prompt": "mstar", "max_tokens": 5, "stream": True}
            ) as sse:
                events = [json.loads(line[6:]) for line in sse.iter_lines() if line.startswith("data: ")]
            want = alone(engine, TwoNodeRequest("b", b"mstar", 5))
            assert events == [{"type": "output", "output": o} for o in want] + [
                {"type": "done", "outputs": len(want)}
            ]
            for body, field in (
                ({"max_tokens": 3}, "prompt"),  # missing
                ({"prompt": 3}, "prompt"),  # wrong type
                ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # out of range
                ({"prompt": "x", "max_tokens": 65}, "max_tokens"),
                ({"prompt": "x", "model": "other"}, "model"),
            ):
                refused = client.post("/v1/streams", json=body)
                assert refused.status_code == 400, (body, refused.text)
                assert field in refused.json()["error"]["message"], refused.text
            nan = client.post("/v1/streams", content=b'{"prompt": "x", "max_tokens": NaN}')
            assert nan.status_code == 400, nan.text
            assert client.get("/v1/models").json()["data"][0]["id"] == "tests.serving.two_node_model:ENTRY"
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log.read_text()
