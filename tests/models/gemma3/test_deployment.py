"""A Gemma 3 deployment run by `mstar-jax run`: the model read from a GGUF file, served by the one engine.

A small random-weight Gemma 3 (the geometry of `test_model`) is written as a float32 GGUF file; a
deployment naming it serves a synthetic text workload through `mstar-jax run`. Every stream's tokens must
be `Gemma3Streams.greedy`'s on the same weights, the report must count what was served, and nothing may
compile after warm-up. Bad `model.config` values are refused naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from mstar_jax.cli import main
from mstar_jax.deployment import DeploymentError, parse_deployment
from mstar_jax.devices import DeviceMemory
from mstar_jax.memory import memory_budget
from tests import extras
from tests.models.gemma3.test_model import CONFIG, random_tensors

extras.skip_module_without("gemma")
pytestmark = pytest.mark.gemma
import gguf


def write_gguf(path, config=CONFIG, seed: int = 0, pieces=None, *, tensors=None, metadata=None) -> None:
    """`random_tensors(config)` (or `tensors`) as a float32 GGUF file with the config's metadata (each
    `gemma3.` key of `metadata` in its place: an int, a str or a list); its vocabulary `pieces` (default:
    `t0`, `t1`, ...)."""
    writer = gguf.GGUFWriter(path, "gemma3")
    uints = {
        "block_count": config.num_layers, "embedding_length": config.d_model,
        "feed_forward_length": config.ffn_dim, "attention.head_count": config.num_heads,
        "attention.head_count_kv": config.num_kv_heads, "attention.key_length": config.head_dim,
        "attention.value_length": config.head_dim, "attention.sliding_window": config.sliding_window,
        "context_length": config.context_length, **(metadata or {}),
    }  # fmt: skip
    for key, value in uints.items():
        add = {str: writer.add_string, list: writer.add_array}.get(type(value), writer.add_uint32)
        add(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", config.rms_eps)
    writer.add_float32("gemma3.rope.freq_base", config.rope_global_base)
    writer.add_token_list(pieces or [f"t{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_id)
    writer.add_eos_token_id(config.eos_id)
    writer.add_add_bos_token(config.add_bos)
    for name, tensor in (random_tensors(config, seed) if tensors is None else tensors).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / "tiny.gguf"
    write_gguf(path)
    return path


def mapping(model_file, **config) -> dict:
    return {
        "model": {
            "name": "gemma3",
            "config": {
                "gguf": str(model_file),
                "global_sink": 2,
                "global_window": 10,
                "chunk": 8,
                "max_slots": 2,
                **config,
            },
        },
        "engine": {"max_batch": 2, "pipelined": True},
        "workload": {
            "streams": 3,
            "arrival_rate_hz": None,
            "min_text_tokens": 1,
            "max_text_tokens": 20,
            "min_new_tokens": 4,
            "max_new_tokens": 12,
            "seed": 1,
        },
    }


def test_the_deployment_declares_both_caches_from_the_file(model_file):
    deployment = parse_deployment(mapping(model_file), "gemma.yaml")
    local, global_ = (spec.config for spec in deployment.specs)
    assert [spec.resource_key for spec in deployment.specs] == ["gemma3_local_kv", "gemma3_global_kv"]
    assert (local.num_layers, global_.num_layers) == (5, 1)  # CONFIG: one global layer in six
    assert local.max_slots == global_.max_slots == 2
    assert global_.retention.sink == 2
    budget = memory_budget(deployment, DeviceMemory(nbytes=2**30, source="test"))
    weights = sum(t.nbytes for t in random_tensors(CONFIG).values())
    assert budget.parts[0].nbytes == weights  # counted from the model's own parameters
    assert budget.parts[1].nbytes == 3 * local.slot_bytes  # two slots and the padding slot


def test_with_the_greedy_screen_the_budget_counts_its_codes_scales_and_slack(model_file):
    plain = parse_deployment(mapping(model_file), "gemma.yaml")
    screened = parse_deployment(mapping(model_file, greedy_screen=True), "gemma.yaml")
    memory = DeviceMemory(nbytes=2**30, source="test")
    extra = memory_budget(screened, memory).parts[0].nbytes - memory_budget(plain, memory).parts[0].nbytes
    # Two int8 codes a weight, a float32 step and two slacks a word.
    assert extra == CONFIG.vocab_size * (CONFIG.d_model * 2 + 3 * 4)


def test_on_a_mesh_the_budget_counts_one_devices_share_of_the_slots_and_heads(model_file):
    settings = mapping(model_file, max_slots=4)
    settings.update(mesh={"data": 2, "model": 2}, engine={"max_batch": 4, "pipelined": False})
    deployment = parse_deployment(settings, "gemma.yaml")
    budget = memory_budget(deployment, DeviceMemory(nbytes=2**30, source="test"))
    local, global_ = (spec.config for spec in deployment.specs)
    weights = sum(t.nbytes for t in random_tensors(CONFIG).values())
    assert budget.parts[0].nbytes == weights  # replicated on every device
    # Two of the four slots and the data shard's padding slot, one of the two KV heads.
    assert budget.parts[1].nbytes == 3 * local.slot_bytes // 2
    assert budget.parts[2].nbytes == 3 * global_.slot_bytes // 2
    assert (
        budget.parts[1].label
        == "gemma3_local_kv slots per device (2 + 1 padding of 2 pools, 1 of 2 KV heads)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("screen", [False, True], ids=["float32", "greedy screen"])
def test_mstar_jax_run_serves_the_workload_with_greedys_tokens(model_file, tmp_path, capsys, screen):
    from mstar_jax.models.gemma3 import load_gguf
    from mstar_jax.models.gemma3.model import Gemma3
    from mstar_jax.models.gemma3.run import build_text_engine, drive_text, text_workload
    from mstar_jax.models.gemma3.stream import Gemma3Streams

    path = tmp_path / "gemma.yaml"
    path.write_text(yaml.safe_dump(mapping(model_file, greedy_screen=screen)))
    assert main(["run", "--config", str(path), "--output", str(tmp_path / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert (tmp_path / "run" / "step_latency.png").stat().st_size > 0
    deployment = parse_deployment(mapping(model_file, greedy_screen=screen), str(path))
    arrivals = text_workload(deployment.workload, vocab_size=CONFIG.vocab_size)
    assert report["streams"]["done"] == report["streams"]["submitted"] == 3
    assert report["tokens_generated"] == sum(a.request.max_new_tokens for a in arrivals)
    assert report["compile"]["compilations_after_warmup"] == 0
    assert "time to first token" in out
    assert "3/3 done" in out
    # The same workload again, its streams' tokens against each prompt continued alone.
    engine = build_text_engine(deployment, progress=False)
    assert engine.served.streams.greedy_screen is screen
    drive_text(engine, arrivals, progress=False)
    config, tensors = load_gguf(model_file)
    alone = Gemma3Streams(
        config,
        Gemma3.from_tensors(config, tensors),
        global_retention=deployment.model_config.retention,
        chunk=8,
    )
    for arrival in arrivals:
        stream = engine.finished[arrival.request.request_id]
        assert stream.tokens == alone.greedy(arrival.request.prompt, arrival.request.max_new_tokens)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"gguf": "/nonexistent/tiny.gguf"}, r"gguf='/nonexistent/tiny\.gguf': no such file"),
        ({"gguf": "DIR"}, r"gguf='.*' is a directory; it must be a \.gguf file"),
        ({"gguf": 3}, r"gguf=3 must be the path of a \.gguf file, or null"),
        ({"global_window": 0}, r"global_window=0 must be an int in \[1, 2147483647\]"),
        ({"chunk": float("nan")}, r"chunk=nan must be an int in \[1, 2147483647\]"),
        ({"max_slots": True}, r"max_slots=True must be an int in \[1, 2147483647\]"),
        ({"dtype": "float16"}, r"dtype='float16' must be one of \['float32', 'bfloat16'\]"),
        ({"greedy_screen": "yes"}, r"greedy_screen='yes' must be a bool"),
        ({"greedy_screen": 1}, r"greedy_screen=1 must be a bool"),
        ({"greedy_screen": float("nan")}, r"greedy_screen=nan must be a bool"),
        (
            {"greedy_screen": True, "dtype": "bfloat16"},
            r"greedy_screen=true needs dtype float32, not 'bfloat16'",
        ),
        ({"windows": 3}, r"model 'gemma3' has no setting\(s\) \['windows'\]"),
    ],
)
def test_bad_model_config_is_refused_naming_the_file_and_field(model_file, config, match):
    if config.get("gguf") == "DIR":
        config = {"gguf": str(model_file.parent)}
    with pytest.raises(DeploymentError, match=r"gemma\.yaml: model\.config: " + match):
        parse_deployment(mapping(model_file, **config), "gemma.yaml")


def _tensors(drop=(), **shapes) -> dict:
    """The tiny model's tensors without those in `drop`, with zeros of `shapes[name]` (dots as `__`)."""
    tensors = {name: t for name, t in random_tensors(CONFIG, 0).items() if name not in drop}
    return {**tensors, **{n.replace("__", "."): np.zeros(shape, np.float32) for n, shape in shapes.items()}}


@pytest.mark.parametrize(
    ("tensors", "metadata", "match"),
    [
        (_tensors(drop=["blk.1.attn_q.weight"]), None, r"tensor 'blk\.1\.attn_q\.weight' is missing"),
        (
            _tensors(output_norm__weight=(CONFIG.d_model + 1,)),
            None,
            rf"tensor 'output_norm\.weight' has shape \({CONFIG.d_model + 1},\); the config needs "
            rf"\({CONFIG.d_model},\)",
        ),
        (
            _tensors(blk__0__attn_k__weight=(3, 5)),
            None,
            r"tensors \('blk\.0\.attn_q\.weight', 'blk\.0\.attn_k\.weight', 'blk\.0\.attn_v\.weight'\) have "
            r"shapes \[.*\(3, 5\).*\]; the config needs .* between them",
        ),
        # Metadata the tensors contradict: more blocks (2**31 once hung `check` counting them), or none.
        (
            None,
            {"block_count": 2**31},
            rf"gemma3\.block_count=2147483648, but its tensors are of {CONFIG.num_layers} ",
        ),
        (None, {"block_count": 0}, r"gemma3\.block_count=0, but its tensors are of"),
        (
            None,
            {"block_count": "six"},
            r"metadata key 'gemma3\.block_count' is 'six' \(str\); it must be an int",
        ),
        (
            None,
            {"context_length": [8, 8]},
            r"metadata key 'gemma3\.context_length' is \[8, 8\] \(list\); it must",
        ),
    ],
    ids=["missing", "norm-shape", "qkv-shape", "blocks-2**31", "blocks-0", "blocks-str", "context-list"],
)
def test_check_refuses_a_file_whose_tensors_are_not_its_models(tmp_path, tensors, metadata, match):
    path = tmp_path / "bad.gguf"
    write_gguf(path, tensors=tensors, metadata=metadata)
    with pytest.raises(DeploymentError, match=r"gemma\.yaml: model\.config: .*" + match):
        parse_deployment(mapping(path), "gemma.yaml")


def test_caches_of_one_node_tuned_to_other_slot_counts_are_refused_at_parse(model_file):
    """A Gemma stream holds a slot of both caches: this was refused only when the engine was built."""
    config = mapping(model_file)
    config["resources"] = {"gemma3_local_kv": {"max_slots": 2}, "gemma3_global_kv": {"max_slots": 4}}
    with pytest.raises(
        DeploymentError,
        match=r"gemma\.yaml: resources: \{'gemma3_local_kv': 2, 'gemma3_global_kv': 4\} must give the caches "
        r"of node 'gemma3' the same max_slots",
    ):
        parse_deployment(config, "gemma.yaml")


def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path, model_file):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(DeploymentError, match=r"gemma\.yaml: .*bad\.gguf"):
        parse_deployment(mapping(model_file, gguf=str(bad)), "gemma.yaml")


def test_a_file_rewritten_after_its_check_is_checked_again(tmp_path):
    """The checked geometry is cached per version of the file, never past a change to it."""
    path = tmp_path / "model.gguf"
    write_gguf(path)
    parse_deployment(mapping(path), "gemma.yaml")
    tensors = random_tensors(CONFIG)
    del tensors["blk.0.ffn_down.weight"]
    write_gguf(path, tensors=tensors)
    with pytest.raises(DeploymentError, match=r"tensor 'blk\.0\.ffn_down\.weight' is missing"):
        parse_deployment(mapping(path), "gemma.yaml")


def test_one_deployment_builds_its_abstract_model_once(tmp_path, monkeypatch):
    """The specs, the memory budget and the file's check share one `nnx.eval_shape` of the model (about a
    second each for the 270M geometry); a geometry no other test uses makes the count this test's own."""
    from flax import nnx

    calls = []
    eval_shape = nnx.eval_shape
    monkeypatch.setattr(nnx, "eval_shape", lambda *a, **k: calls.append(1) or eval_shape(*a, **k))
    config = dataclasses.replace(CONFIG, ffn_dim=CONFIG.ffn_dim + 8)
    path = tmp_path / "model.gguf"
    write_gguf(path, config=config)
    deployment = parse_deployment(mapping(path), "gemma.yaml")
    budget = memory_budget(deployment, DeviceMemory(nbytes=2**30, source="test"))
    assert budget.parts[0].nbytes == sum(t.nbytes for t in random_tensors(config).values())
    assert len(calls) == 1


def test_a_model_file_other_than_the_declared_geometry_is_refused_before_its_weights_load(
    model_file, tmp_path, monkeypatch, capsys
):
    # `gguf: null` declares Gemma 3 270M without reading the extra's file; building reads the file and
    # must refuse one of another geometry (here the tiny model's) before loading a tensor.
    from mstar_jax.models import gemma3
    from mstar_jax.models.gemma3 import gguf as gguf_module

    monkeypatch.setattr(gguf_module, "default_gguf_path", lambda: model_file)
    monkeypatch.setattr(gemma3, "load_gguf", lambda *a, **k: pytest.fail("the weights were loaded"))
    settings = mapping(model_file)
    del settings["model"]["config"]["gguf"]
    path = tmp_path / "gemma.yaml"
    path.write_text(yaml.safe_dump(settings))
    assert main(["run", "--config", str(path), "--output", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"mstar-jax run: error: {path}: model.config.gguf: {model_file} has vocab_size=64, where the "
        "deployment declares 262144"
    )
