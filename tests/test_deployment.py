"""The deployment format: both example configs load, every refusal names file, section, key and value."""

import copy
import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from mstar_jax.deployment import (
    DEFAULT_CONFIG,
    CompileSettings,
    DeploymentError,
    DeploymentTypeError,
    load_deployment,
    parse_deployment,
)
from mstar_jax.memory import resource_costs
from mstar_jax.models.gemma3.deployment import Gemma3DeploymentConfig
from mstar_jax.models.streaming_tts import StreamingTTSConfig
from mstar_jax.registry import known_models, model_config, model_entry
from mstar_jax.resources.kv.bounded.config import SinkWindow
from mstar_jax.resources.spec import NodeResourceSpec

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TPU_CONFIG = CONFIGS / "tpu_streaming_tts.yaml"


def _default_mapping() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG.read_text())


def _with(mapping: dict, dotted: str, value) -> dict:
    """A deep copy of `mapping` with `value` at `dotted` (a.b.c); `_DELETE` removes the key."""
    out = copy.deepcopy(mapping)
    *parents, last = dotted.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()


# -- the example configs ----------------------------------------------------------------------------


def test_default_config_is_shipped_in_the_package():
    assert DEFAULT_CONFIG.is_file()
    assert DEFAULT_CONFIG.parent.parent.name == "mstar_jax"
    assert DEFAULT_CONFIG.samefile(CONFIGS / "streaming_tts.yaml")
    assert os.readlink(DEFAULT_CONFIG.parent) == "../configs"  # relative, so it survives a move


@pytest.mark.parametrize("path", [DEFAULT_CONFIG, TPU_CONFIG], ids=["default", "tpu"])
def test_example_configs_load_with_every_value_from_the_file(path):
    raw = yaml.safe_load(Path(path).read_text())
    deployment = load_deployment(path)
    assert deployment.source == os.fspath(path)
    assert deployment.model == raw["model"]["name"] == "streaming_tts"
    assert isinstance(deployment.model_config, StreamingTTSConfig)
    for key, value in raw["model"]["config"].items():
        assert getattr(deployment.model_config, key) == value, key
    for section in ("compile", "engine", "workload"):
        settings = getattr(deployment, section)
        for key, value in raw[section].items():
            expected = tuple(value) if isinstance(value, list) else value
            assert getattr(settings, key) == expected, f"{section}.{key}"
    assert [spec.resource_key for spec in deployment.specs] == ["talker_kv", "flow_kv"]
    for key, block in raw["resources"].items():
        assert deployment.spec(key).config.max_slots == block["max_slots"]


def test_default_config_is_cpu_sized_and_tpu_config_is_not():
    default, tpu = load_deployment(DEFAULT_CONFIG), load_deployment(TPU_CONFIG)
    assert sum(c.all_slots_bytes for c in default.costs()) < 1 << 20
    assert default.model_config.d_model <= 128
    assert default.model_config.talker_layers <= 2
    assert tpu.model_config.dtype == "bfloat16"
    assert (tpu.model_config.talker_layers, tpu.model_config.talker_heads) == (28, 16)
    assert (tpu.model_config.talker_kv_heads, tpu.model_config.talker_head_dim) == (8, 128)
    assert tpu.model_config.talker_window == 3000


def test_default_argument_and_string_source():
    assert load_deployment() == load_deployment(DEFAULT_CONFIG)
    deployment = parse_deployment({"model": {"name": "streaming_tts"}})
    assert deployment.source == "<string>"
    assert deployment.model_config == StreamingTTSConfig()
    assert deployment.compile == CompileSettings()
    assert deployment.batch_sizes == (1, 2, 4)  # derived: min_batch 1 .. engine.max_batch 4
    assert deployment.token_counts == (1, 2, 4, 8, 16)  # derived: min_tokens 1 .. max_tokens 16


def test_empty_sections_take_defaults():
    mapping = {"model": {"name": "streaming_tts", "config": None}, "compile": None, "resources": None}
    deployment = parse_deployment(mapping)
    assert deployment.specs == tuple(StreamingTTSConfig().resource_specs())


def test_deployment_is_frozen_and_hashable():
    deployment = load_deployment()
    with pytest.raises(dataclasses.FrozenInstanceError):
        deployment.model = "other"  # type: ignore[misc]
    assert hash(deployment) == hash(load_deployment())


# -- the resources block ----------------------------------------------------------------------------


def test_resources_block_overrides_max_slots_of_one_resource_only():
    mapping = _with(_default_mapping(), "resources", {"talker_kv": {"max_slots": 7}})
    deployment = parse_deployment(mapping)
    model = deployment.model_config
    assert model.max_slots == 4
    talker, flow = deployment.spec("talker_kv"), deployment.spec("flow_kv")
    assert talker.config.max_slots == 7
    assert talker.config == dataclasses.replace(model.talker_kv_config, max_slots=7)
    assert flow.config == model.flow_kv_config
    assert flow.config.max_slots == 4
    assert resource_costs(talker).all_slots_bytes == 7 * talker.config.slot_bytes


def test_spec_lookup_names_the_declared_keys():
    with pytest.raises(KeyError, match=r"no resource 'x'; declared: \['talker_kv', 'flow_kv'\]"):
        load_deployment().spec("x")


# -- costs ------------------------------------------------------------------------------------------


def test_costs_of_the_default_config_by_hand():
    talker, flow = load_deployment().costs()
    # talker: voice 8..24 frames, sink = voice + 4, window 32, 2 layers, 1 row, 2 KV heads x 16, f32.
    assert (talker.key, talker.nodes, talker.dtype) == ("talker_kv", ("talker",), "float32")
    assert talker.retention_at_min == SinkWindow(8 + 4, 32)
    assert talker.retention_at_max == SinkWindow(24 + 4, 32)
    assert talker.sink_capacity == 4  # the sink past the voice: (s + 4) - s
    assert talker.window_capacity == 32
    assert talker.slot_tokens == 36
    assert talker.max_retained == 24 + 4 + 32  # 60, at the longest voice
    # layers * tokens (36, allocated in tiles of 8: 40) * rows * heads * (K,V) * dim * 4 B = 20,480
    assert talker.slot_bytes == 2 * 40 * 1 * 2 * 2 * 16 * 4
    assert talker.all_slots_bytes == 4 * 20_480
    assert talker.source_bytes == 2 * 24 * 1 * 2 * 2 * 16 * 4  # a 24-frame voice (3 tiles) = 12,288
    # flow: sink = the voice (nothing written in it), window 16, 2 layers, 2 rows (CFG), 4 heads x 16.
    assert (flow.key, flow.nodes, flow.rows_per_request) == ("flow_kv", ("flow",), 2)
    assert flow.retention_at_min == SinkWindow(8, 16)
    assert flow.retention_at_max == SinkWindow(24, 16)
    assert (flow.sink_capacity, flow.window_capacity, flow.slot_tokens) == (0, 16, 16)
    assert flow.max_retained == 24 + 16
    assert flow.slot_bytes == 2 * 16 * 2 * 4 * 2 * 16 * 4  # 32,768
    assert flow.all_slots_bytes == 4 * 32_768


def test_costs_of_the_tpu_config_by_hand():
    talker, flow = load_deployment(TPU_CONFIG).costs()
    # 28 layers x (4 + 3000 = 3004, allocated in tiles of 8: 3008) entries x 8 KV heads x (K,V) x 128 x 2 B
    assert talker.slot_tokens == 3004
    assert talker.slot_bytes == 28 * 3008 * 8 * 2 * 128 * 2 == 344_981_504
    assert talker.all_slots_bytes == 64 * 344_981_504
    assert talker.max_retained == 250 + 4 + 3000
    # 16 layers x 100 entries (in tiles of 8: 104) x 2 rows x 8 heads x (K,V) x 64 x 2 B
    assert flow.slot_bytes == 16 * 104 * 2 * 8 * 2 * 64 * 2 == 6_815_744
    assert flow.max_retained == 250 + 100


def test_costs_refuse_a_spec_without_slot_geometry():
    @dataclasses.dataclass(frozen=True)
    class OtherSpec(NodeResourceSpec):
        @property
        def resource_class(self):
            raise NotImplementedError

    with pytest.raises(TypeError, match="'other' is a OtherSpec"):
        resource_costs(OtherSpec(resource_key="other", nodes={"n"}))


# -- buckets ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("low", "high", "expected"),
    [
        (1, 4, (1, 2, 4)),
        (3, 12, (3, 4, 8, 12)),
        (4, 4, (4,)),
        (1, 1, (1,)),
        (2, 3, (2, 3)),
        (5, 64, (5, 8, 16, 32, 64)),
    ],
)
def test_derived_buckets(low, high, expected):
    assert CompileSettings(min_batch=low).resolved_batch_sizes(high) == expected
    assert CompileSettings(min_tokens=low, max_tokens=high).resolved_token_counts() == expected


def test_explicit_buckets_are_kept():
    settings = CompileSettings(batch_sizes=[2, 8], token_counts=(1, 5))
    assert settings.batch_sizes == (2, 8)
    assert settings.resolved_batch_sizes(8) == (2, 8)
    assert settings.resolved_token_counts() == (1, 5)


# -- the model registry -----------------------------------------------------------------------------


def test_model_registry():
    assert {name: model_entry(name).config for name in known_models()} == {
        "streaming_tts": StreamingTTSConfig,
        "gemma3": Gemma3DeploymentConfig,
    }
    assert model_config("streaming_tts", {"talker_window": 40, "query_window": 41}).talker_window == 40
    known = r"unknown model 'tts'; known models: \['gemma3', 'streaming_tts'\]"
    with pytest.raises(ValueError, match=known):
        model_config("tts", {})
    with pytest.raises(
        ValueError, match=r"model 'streaming_tts' has no setting\(s\) \['layers'\]; it accepts"
    ):
        model_config("streaming_tts", {"layers": 2})


# -- refusals ---------------------------------------------------------------------------------------

# (dotted key, value, exception type, fragments every message must contain)
UNKNOWN_KEYS = [
    ("modle", {"name": "streaming_tts"}, DeploymentError, ["unknown key 'modle'", "the top level"]),
    ("model.nmae", "x", DeploymentError, ["unknown key 'nmae'", "'model'", "allowed: ['name', 'config']"]),
    ("model.config.talker_layer", 2, DeploymentError, ["model.config", "['talker_layer']", "talker_layers"]),
    (
        "resources.kv",
        {"max_slots": 2},
        DeploymentError,
        ["resources.kv", "['kv']", "['flow_kv', 'talker_kv']"],
    ),
    (
        "resources.talker_kv.page_size",
        16,
        DeploymentTypeError,
        ["resources.talker_kv", "['page_size']", "max_slots"],
    ),
    ("resources.flow_kv.window", 16, DeploymentTypeError, ["resources.flow_kv", "'flow_kv'", "['window']"]),
    ("compile.batch_size", [1], DeploymentError, ["unknown key 'batch_size'", "'compile'", "batch_sizes"]),
    ("engine.max_batches", 4, DeploymentError, ["unknown key 'max_batches'", "'engine'", "max_batch"]),
    ("workload.stream", 4, DeploymentError, ["unknown key 'stream'", "'workload'", "streams"]),
]

BAD_VALUES = [
    ("model.name", "tts", ["model.name: unknown model 'tts'", "['gemma3', 'streaming_tts']"]),
    ("model.name", _DELETE, ["model: missing 'name'"]),
    ("model", "streaming_tts", ["model: must be a mapping", "str 'streaming_tts'"]),
    ("model.config", [1], ["model.config: must be a mapping"]),
    ("model.config.talker_layers", "2", ["model.config", "talker_layers='2' must be an int in [1, "]),
    ("model.config.talker_layers", True, ["talker_layers=True must be an int in [1, 2147483647]"]),
    ("model.config.d_model", 64.0, ["d_model=64.0 must be an int in [1, 2147483647]"]),
    ("model.config.talker_sink_extra", -1, ["talker_sink_extra=-1 must be an int in [0, 2147483647]"]),
    ("model.config.dtype", "float16", ["dtype='float16' must be one of ['bfloat16', 'float32']"]),
    ("model.config.talker_kv_heads", 3, ["talker_heads=4 must be a multiple of talker_kv_heads=3"]),
    ("model.config.min_voice_frames", 30, ["min_voice_frames=30 must be <= max_voice_frames=24"]),
    ("model.config.query_window", 34, ["query_window=34 must be <= talker_window + 1 = 33"]),
    ("model.config.seed", -1, ["seed=-1 must be an int in [0, 9223372036854775807]"]),
    ("resources", [1], ["resources:", "must be a mapping"]),
    ("resources.talker_kv", 4, ["resources.talker_kv", "must be a mapping"]),
    ("resources.talker_kv.max_slots", 0, ["resources.talker_kv", "max_slots=0 must be an int >= 1"]),
    ("kv_cache", {"max_slots": 4}, ["kv_cache: this top-level block is no longer read", "resources:"]),
    ("compile", [1, 2], ["compile: must be a mapping", "list [1, 2]"]),
    ("compile.batch_sizes", [4, 2], ["compile:", "batch_sizes=[4, 2] must be strictly increasing"]),
    ("compile.batch_sizes", [], ["batch_sizes=[] must list at least one bucket"]),
    ("compile.batch_sizes", "1,2", ["batch_sizes='1,2' must be a list of ints"]),
    ("compile.token_counts", [1, "a"], ["token_counts[1]='a' must be an int >= 1"]),
    ("compile.token_counts", [0, 1], ["token_counts[0]=0 must be an int >= 1"]),
    ("compile.min_tokens", 32, ["min_tokens=32 must be <= max_tokens=16"]),
    ("compile.persistent_cache_dir", "", ["persistent_cache_dir='' must be a non-empty str or null"]),
    ("compile.persistent_cache_dir", 5, ["persistent_cache_dir=5 must be a non-empty str"]),
    ("compile.persistent_cache_min_compile_secs", -1.0, ["persistent_cache_min_compile_secs=-1.0", ">= 0.0"]),
    ("engine", "fast", ["engine: must be a mapping"]),
    ("engine.max_batch", 0, ["engine:", "max_batch=0 must be an int >= 1"]),
    (
        "engine.hold_backoff_s",
        "1e-3",
        ["hold_backoff_s='1e-3' must be a number in [0.0, 3600.0]", "write it with a dot"],
    ),
    ("engine.hold_backoff_s", "soon", ["hold_backoff_s='soon' must be a number in [0.0, 3600.0]"]),
    ("engine.hold_backoff_s", float("nan"), ["hold_backoff_s=nan must be a finite number"]),
    ("engine.offload_idle_after_s", -2, ["offload_idle_after_s=-2 must be a finite number >= 0.0"]),
    ("workload.arrival_rate_hz", 0, ["workload:", "arrival_rate_hz=0 must be a finite number >= 0.000277"]),
    ("workload.streams", 0, ["streams=0 must be an int in [1, 10000000]"]),
    ("workload.min_frames", 161, ["min_frames=161 must be <= max_frames=160"]),
    ("workload.max_text_tokens", 4, ["min_text_tokens=8 must be <= max_text_tokens=4"]),
    ("workload.seed", None, ["seed=None must be an int >= 0"]),
]


@pytest.mark.parametrize(
    ("key", "value", "error", "fragments"), UNKNOWN_KEYS, ids=[c[0] for c in UNKNOWN_KEYS]
)
def test_unknown_keys_in_every_section_are_refused(key, value, error, fragments):
    with pytest.raises(error) as info:
        parse_deployment(_with(_default_mapping(), key, value), source="deploy.yaml")
    assert str(info.value).startswith("deploy.yaml: ")
    for fragment in fragments:
        assert fragment in str(info.value)


def test_resource_key_errors_are_type_errors():
    mapping = _with(_default_mapping(), "resources.talker_kv.page_size", 16)
    with pytest.raises(TypeError, match="resource 'talker_kv' got unknown YAML key"):
        parse_deployment(mapping)


@pytest.mark.parametrize(
    ("key", "value", "fragments"),
    BAD_VALUES,
    ids=[f"{c[0]}=<deleted>" if c[1] is _DELETE else f"{c[0]}={c[1]!r}" for c in BAD_VALUES],
)
def test_bad_values_are_refused_naming_field_value_and_allowed(key, value, fragments):
    with pytest.raises(DeploymentError) as info:
        parse_deployment(_with(_default_mapping(), key, value), source="deploy.yaml")
    assert str(info.value).startswith("deploy.yaml: ")
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("changes", "fragments"),
    [
        (
            {"engine.max_batch": 8, "compile.batch_sizes": [1, 2, 4]},
            ["engine.max_batch=8", "[1, 2, 4]", "add 8"],
        ),
        ({"engine.max_batch": 8}, ["engine.max_batch=8 exceeds resources.talker_kv.max_slots=4"]),
        ({"resources.flow_kv.max_slots": 2}, ["engine.max_batch=4 exceeds resources.flow_kv.max_slots=2"]),
        ({"compile.min_batch": 8}, ["compile.min_batch=8 must be <= engine.max_batch=4"]),
        ({"compile.batch_sizes": [1, 4], "compile.min_batch": 2}, ["min_batch=2 has no effect", "[1, 4]"]),
        ({"compile.token_counts": [1, 8], "compile.max_tokens": 32}, ["max_tokens=32 has no effect"]),
        ({"compile.token_counts": [1, 4]}, ["[1, 4] has no bucket of >= model.config.flow_chunk=8", "add 8"]),
    ],
)
def test_contradicting_settings_are_refused(changes, fragments):
    mapping = _default_mapping()
    for key, value in changes.items():
        mapping = _with(mapping, key, value)
    with pytest.raises(DeploymentError) as info:
        parse_deployment(mapping, source="deploy.yaml")
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("changes", "section", "wrong"),
    [
        # An unknown model is model.name's fault, not model.config's.
        ({"model.name": "tts"}, "model.name: unknown model 'tts'", "model.config"),
        ({"model.name": ["tts"]}, "model.name: unknown model ['tts']", "model.config"),
        # The legacy block is at the top level; 'resources' is where it should go, not where it is.
        ({"kv_cache": {"max_slots": 4}}, "kv_cache: this top-level block", "deploy.yaml: resources:"),
        # With derived token buckets the key to change is max_tokens, which the file set.
        (
            {"compile.token_counts": None, "compile.max_tokens": 4},
            "compile.max_tokens=4 (token counts [1, 2, 4]) has no bucket of >= model.config.flow_chunk=8 "
            "frames, so no flow chunk could run; raise compile.max_tokens to 8",
            "compile.token_counts=",
        ),
    ],
    ids=["unknown-model", "non-string-model", "kv_cache", "derived-token-counts"],
)
def test_messages_name_the_section_at_fault(changes, section, wrong):
    mapping = _default_mapping()
    for key, value in changes.items():
        mapping = _with(mapping, key, value)
    with pytest.raises(DeploymentError) as info:
        parse_deployment(mapping, source="deploy.yaml")
    assert str(info.value).startswith(f"deploy.yaml: {section}")
    assert wrong not in str(info.value)


def test_legacy_kv_cache_hint_is_yaml_that_loads():
    mapping = _with(_default_mapping(), "kv_cache", {"max_slots": 6, "page_size": 16})
    del mapping["resources"]
    with pytest.raises(DeploymentError) as info:
        parse_deployment(mapping, source="deploy.yaml")
    message = str(info.value)
    assert "\n" not in message
    snippet = message.split("e.g. ", 1)[1]
    assert snippet == "resources: {talker_kv: {max_slots: 6}, flow_kv: {max_slots: 6}}"
    # The block's settings a cache accepts move under each cache; page_size is no setting of any.
    del mapping["kv_cache"]
    deployment = parse_deployment({**mapping, **yaml.safe_load(snippet)})
    assert [spec.config.max_slots for spec in deployment.specs] == [6, 6]
    # A block without a setting a cache accepts suggests each cache's declared max_slots.
    with pytest.raises(DeploymentError, match=r"e\.g\. resources: \{talker_kv: \{max_slots: 4\}, flow_kv"):
        parse_deployment({**mapping, "kv_cache": "big"})


def test_a_cache_the_model_cannot_build_is_a_model_config_error():
    mapping = _with(_default_mapping(), "model.config.max_voice_frames", 100_000_000)
    with pytest.raises(DeploymentError) as info:
        parse_deployment(mapping, source="deploy.yaml")
    assert str(info.value).startswith(
        "deploy.yaml: model.config: max_source_len=100000000 and min_source_len=8"
    )


def test_a_compile_setting_the_model_never_reads_is_refused_before_the_section_is_parsed(monkeypatch):
    # The generic part: a model config names its unread compile settings (`UNREAD_COMPILE`, default none).
    mapping = _with(_default_mapping(), "compile.min_batch", "two")  # not even an int: never parsed
    with pytest.raises(DeploymentError, match=r"compile: min_batch='two' must be an int >= 1"):
        parse_deployment(mapping, source="deploy.yaml")
    monkeypatch.setattr(StreamingTTSConfig, "UNREAD_COMPILE", ("min_batch",), raising=False)
    with pytest.raises(DeploymentError) as info:
        parse_deployment(mapping, source="deploy.yaml")
    assert str(info.value) == (
        "deploy.yaml: compile: min_batch='two' is not read by model 'streaming_tts'; its compile reads "
        "['batch_sizes', 'token_counts', 'min_tokens', 'max_tokens', 'persistent_cache_dir', "
        "'persistent_cache_min_compile_secs']"
    )


def test_gemma3_refuses_token_buckets_it_never_compiles():
    mapping = {"model": {"name": "gemma3"}, "engine": {"max_batch": 2}}
    assert parse_deployment(_with(mapping, "compile.batch_sizes", [1, 2])).batch_sizes == (1, 2)
    for key, value in (("token_counts", [1, 128]), ("min_tokens", 2), ("max_tokens", 64)):
        with pytest.raises(DeploymentError) as info:
            parse_deployment(_with(mapping, f"compile.{key}", value), source="deploy.yaml")
        assert str(info.value) == (
            f"deploy.yaml: compile: {key}={value} is not read by model 'gemma3'; its compile reads "
            "['batch_sizes', 'min_batch', 'persistent_cache_dir', 'persistent_cache_min_compile_secs']"
        )


def test_a_yaml_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path):
    # Ten levels of nine aliases: 9**10 ints, shown by `brief` without writing them all.
    levels = ["&a0 [0, 0, 0, 0, 0, 0, 0, 0, 0]"]
    for i in range(1, 10):
        levels.append(f"&a{i} [{levels[-1]}" + f", *a{i - 1}" * 8 + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text(f"model: {{name: streaming_tts}}\ncompile:\n  token_counts: {levels[-1]}\n")
    with pytest.raises(DeploymentError) as info:
        load_deployment(path)
    assert str(info.value) == (
        f"{path}: compile: token_counts[0]=[[[[[[[[[0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0... "
        "must be an int >= 1"
    )


def test_missing_model_and_non_mapping_document():
    with pytest.raises(DeploymentError, match=r"^<string>: missing the 'model:' section"):
        parse_deployment({"engine": {"max_batch": 2}})
    with pytest.raises(DeploymentError, match="must be a mapping of sections, got list"):
        parse_deployment([1, 2])


def test_file_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(DeploymentError, match=f"^{re.escape(str(missing))}: no such file$"):
        load_deployment(missing)
    with pytest.raises(DeploymentError, match=f"^{re.escape(str(tmp_path))}: cannot read it"):
        load_deployment(tmp_path)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(DeploymentError, match=r"empty\.yaml: the file is empty"):
        load_deployment(empty)
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {name: streaming_tts\n")
    with pytest.raises(DeploymentError, match=r"(?s)broken.yaml: invalid YAML: .*broken.yaml\", line 2"):
        load_deployment(broken)


def test_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model:\n  name: streaming_tts\nengine:\n  max_batch: 2\n  max_batch: 4\n")
    with pytest.raises(
        DeploymentError, match=r"(?s)dup.yaml: invalid YAML: .*duplicate key 'max_batch'.*line 5"
    ):
        load_deployment(str(path))


def test_yaml_merge_keys_still_work(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(
        "base: &small {max_batch: 2, hold_backoff_s: 0.01}\n"
        "model: {name: streaming_tts}\n"
        "engine:\n  <<: *small\n  max_batch: 3\n"
    )
    # The anchor's carrier 'base' is an unknown top-level key, refused like any other.
    with pytest.raises(DeploymentError, match="unknown key 'base'"):
        load_deployment(path)
    path.write_text(
        "model: {name: streaming_tts}\nengine:\n  <<: {max_batch: 2, hold_backoff_s: 0.01}\n  max_batch: 3\n"
    )
    engine = load_deployment(path).engine
    assert (engine.max_batch, engine.hold_backoff_s) == (3, 0.01)


# -- the mesh ---------------------------------------------------------------------------------------


class _Device:
    def __init__(self, platform: str):
        self.platform = platform


def _on_a_mesh(block: dict) -> dict:
    """The default deployment on the mesh `block`, its engine synchronous (a mesh engine is)."""
    return _with(_with(_default_mapping(), "mesh", block), "engine.pipelined", False)


def test_a_pipelined_engine_on_a_mesh_parses_and_a_bad_flag_is_refused():
    """A deployment on a mesh pipelines (in one process or across them: `test_multiprocess_engine.py`)."""
    assert parse_deployment(_default_mapping()).engine.pipelined
    on_a_mesh = parse_deployment(_with(_default_mapping(), "mesh", {"data": 2, "model": 2}), source="d.yaml")
    assert on_a_mesh.engine.pipelined
    assert (on_a_mesh.mesh.data, on_a_mesh.mesh.model) == (2, 2)
    with pytest.raises(DeploymentError, match=r"pipelined='yes' must be a bool"):
        parse_deployment(_with(_default_mapping(), "engine.pipelined", "yes"), source="d.yaml")


def test_the_mesh_defaults_to_one_device_and_reads_its_block():
    assert (
        parse_deployment(_default_mapping()).mesh.data,
        parse_deployment(_default_mapping()).mesh.model,
    ) == (1, 1)
    deployment = parse_deployment(_on_a_mesh({"data": 2, "model": 2}))
    assert (deployment.mesh.data, deployment.mesh.model, deployment.mesh.devices) == (2, 2, 4)
    deployment.check_devices([_Device("cpu")] * 4)
    deployment.check_devices([_Device("cpu")] * 8)  # a smaller mesh takes the first devices


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"data": 0}, r"mesh: data=0 must be an int >= 1"),
        ({"model": 1.5}, r"mesh: model=1.5 must be an int >= 1"),
        ({"pipeline": 2}, r"unknown key 'pipeline' in 'mesh'"),
        ({"data": 3}, r"resources.talker_kv.max_slots=4 must split evenly over mesh.data=3 slot pools"),
        ({"model": 3}, r"mesh.model=3 must divide talker_kv's 2 KV heads, or be a multiple of them"),
    ],
)
def test_a_mesh_the_caches_cannot_split_over_is_refused(block, message):
    with pytest.raises(DeploymentError, match=message):
        parse_deployment(_on_a_mesh(block), source="d.yaml")


def test_a_mesh_larger_than_the_devices_present_is_refused_with_the_fix():
    deployment = parse_deployment(_on_a_mesh({"data": 4, "model": 2}), source="d.yaml")
    with pytest.raises(
        DeploymentError,
        match=r"d.yaml: mesh: mesh data=4 x model=2 needs 8 devices; 1 cpu device\(s\) are present \(on a "
        r"CPU host, XLA_FLAGS=--xla_force_host_platform_device_count=8 simulates 8 devices\)",
    ):
        deployment.check_devices([_Device("cpu")])
    with pytest.raises(DeploymentError, match=r"needs 8 devices; 4 tpu device\(s\) are present$"):
        deployment.check_devices([_Device("tpu")] * 4)
