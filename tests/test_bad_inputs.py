"""One table of bad inputs per layer, each refused with a typed error that leaves everything as it was.

The layers: YAML deployments (`parse_deployment`, `load_deployment`), the `mstar-jax` command line, the
frozen configs and specs, the `BoundedKVManager` (where an admission refusal is a typed `AdmitOutcome`
reason, not an exception) and the `Engine`. Every case names the exact exception (or reason) type and a
pattern over the message's key parts: the field, the value received and what is allowed. Every test
snapshots what the call could have changed (the input mapping, the files around it, the manager's host
bookkeeping and device bits, the engine's streams, slots, counters and voices) and compares it after.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import re
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from mstar_jax.cli import main
from mstar_jax.compile import ExecutableStore
from mstar_jax.deployment import (
    DEFAULT_CONFIG,
    DeploymentError,
    DeploymentTypeError,
    load_deployment,
    parse_deployment,
)
from mstar_jax.engine import batch
from mstar_jax.models.streaming_tts import Engine, TTSPrograms, TTSRequest, tts_buckets
from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from mstar_jax.models.streaming_tts.voices import Voice
from mstar_jax.registry import model_config
from mstar_jax.resources.kv.bounded.attention import attend, check_layer
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache
from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVSpec,
    BoundedKVStep,
    SinkWindow,
)
from mstar_jax.resources.kv.bounded.config import StreamPosition as Pos
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.spec import CombinedSplit, ResourceReqConfig, apply_yaml_overrides
from mstar_jax.resources.step import (
    AdmitFailedReason,
    AdmitRuntimeError,
    AllocationFailed,
    BucketKey,
    RequestOffloading,
    ResourceStep,
    Segment,
    StepContext,
    StepNotAdmittedError,
    UnknownRequestError,
)
from tests.engine.support import (
    BATCH_SIZES,
    CONFIG,
    TOKEN_COUNTS,
    engine_kwargs,
    make_engine,
    managers,
    request,
)


def _case(case_id: str, *values):
    return pytest.param(*values, id=case_id)


# -- YAML deployments ---------------------------------------------------------------------------------

_DEFAULT = yaml.safe_load(DEFAULT_CONFIG.read_text())


def _changed(changes: dict) -> dict:
    """The default deployment's mapping with each dotted key (or tuple of keys) set to its value."""
    mapping = copy.deepcopy(_DEFAULT)
    for key, value in changes.items():
        *parents, last = key.split(".") if isinstance(key, str) else key
        block = mapping
        for parent in parents:
            block = block.setdefault(parent, {})
        block[last] = value
    return mapping


# parse_deployment(mapping, source="deploy.yaml"): (changes to the default mapping, error, pattern).
PARSE_CASES = [
    _case(
        "model.config.dtype=list", {"model.config.dtype": ["float32"]}, DeploymentError,
        r"deploy\.yaml: model\.config: dtype=\['float32'\] must be one of \['bfloat16', 'float32'\]",
    ),
    _case(
        "model.config=false", {"model.config": False}, DeploymentError,
        r"deploy\.yaml: model\.config: must be a mapping of setting to value, got bool False",
    ),
    _case(
        "model.config=[]", {"model.config": []}, DeploymentError,
        r"deploy\.yaml: model\.config: must be a mapping of setting to value, got list \[\]",
    ),
    _case(
        "model.config-int-key", {"model.config": {1: 2}}, DeploymentError,
        r"deploy\.yaml: model\.config: model 'streaming_tts' has no setting\(s\) \[1\]; "
        r"it accepts \['text_vocab_size', .*'seed'\]",
    ),
    _case(
        "model.name=null", {"model.name": None}, DeploymentError,
        r"deploy\.yaml: model\.name: unknown model None; known models: \['gemma3', 'streaming_tts'\]",
    ),
    _case(
        "top-level-int-key", {(1,): "x"}, DeploymentError,
        r"deploy\.yaml: unknown key 1 in the top level; "
        r"allowed: \['model', 'resources', 'compile', 'engine', 'workload', 'mesh'\]",
    ),
    _case(
        "resources=[]", {"resources": []}, DeploymentError,
        r"deploy\.yaml: resources: resources=\[\] must be a mapping of resource key to settings",
    ),
    _case(
        "resources.talker_kv=false", {"resources.talker_kv": False}, DeploymentError,
        r"deploy\.yaml: resources\.talker_kv: resources\.talker_kv=False must be a mapping of settings",
    ),
    _case(
        "resources.talker_kv-int-key", {"resources.talker_kv": {1: 2}}, DeploymentTypeError,
        r"deploy\.yaml: resources\.talker_kv: resource 'talker_kv' got unknown YAML key\(s\) \[1\]; "
        r"it accepts \['max_slots'\]",
    ),
    _case(
        "resources.undeclared", {"resources.speaker_kv": {"max_slots": 2}}, DeploymentError,
        r"deploy\.yaml: resources\.speaker_kv: serving config overrides unknown resource\(s\) "
        r"\['speaker_kv'\]; this model declares \['flow_kv', 'talker_kv'\]",
    ),
    _case(
        "max_slots=2.5", {"resources.flow_kv.max_slots": 2.5}, DeploymentError,
        r"deploy\.yaml: resources\.flow_kv: max_slots=2\.5 must be an int >= 1",
    ),
    _case(
        "flow_chunk-past-buckets", {"model.config.flow_chunk": 32, "compile.token_counts": [1, 8, 16]},
        DeploymentError,
        r"deploy\.yaml: compile\.token_counts=\[1, 8, 16\] has no bucket of >= model\.config\.flow_chunk=32 "
        r"frames, so no flow chunk could run; add 32 to compile\.token_counts",
    ),
    _case(
        "batch_sizes-bool", {"compile.batch_sizes": [1, True]}, DeploymentError,
        r"deploy\.yaml: compile: batch_sizes\[1\]=True must be an int >= 1",
    ),
    _case(
        "token_counts-mapping", {"compile.token_counts": {"a": 1}}, DeploymentError,
        r"deploy\.yaml: compile: token_counts=\{'a': 1\} must be a list of ints >= 1, or null",
    ),
    _case(
        "compile_secs-string", {"compile.persistent_cache_min_compile_secs": "1e-3"}, DeploymentError,
        r"deploy\.yaml: compile: persistent_cache_min_compile_secs='1e-3' must be a number >= 0\.0 "
        r"\(YAML reads '1e-3' as a string: write it with a dot and a signed exponent, e\.g\. 1\.0e-3\)",
    ),
    _case(
        "snapshot_every=0", {"engine.snapshot_every": 0}, DeploymentError,
        r"deploy\.yaml: engine: snapshot_every=0 must be an int >= 1",
    ),
    _case(
        "offload_idle_after_s=inf", {"engine.offload_idle_after_s": float("inf")}, DeploymentError,
        r"deploy\.yaml: engine: offload_idle_after_s=inf must be a finite number >= 0\.0",
    ),
    _case(
        "workload.voices=0", {"workload.voices": 0}, DeploymentError,
        r"deploy\.yaml: workload: voices=0 must be an int in \[1, 2147483647\]",
    ),
    # Values past what the run can hold or sleep: once accepted here, they raised after compiling.
    _case(
        "arrival_rate_hz=1e-300", {"workload.arrival_rate_hz": 1e-300}, DeploymentError,
        r"deploy\.yaml: workload: arrival_rate_hz=1e-300 must be a finite number >= 0\.000277.*",
    ),
    _case(
        "hold_backoff_s=1e308", {"engine.hold_backoff_s": 1e308}, DeploymentError,
        r"deploy\.yaml: engine: hold_backoff_s=1e\+308 must be a finite number in \[0\.0, 3600\.0\]",
    ),
    _case(
        "max_frames=10**30", {"workload.max_frames": 10**30}, DeploymentError,
        r"deploy\.yaml: workload: max_frames=1000000000000000000000000000000 must be an int in "
        r"\[1, 2147483647\]",
    ),
    _case(
        "streams=10**12", {"workload.streams": 10**12}, DeploymentError,
        r"deploy\.yaml: workload: streams=1000000000000 must be an int in \[1, 10000000\]",
    ),
    _case(
        "flow_steps=10**30", {"model.config.flow_steps": 10**30}, DeploymentError,
        r"deploy\.yaml: model\.config: flow_steps=1000000000000000000000000000000 must be an int in "
        r"\[1, 2147483647\]",
    ),
    _case(
        "model-seed=2**63", {"model.config.seed": 2**63}, DeploymentError,
        r"deploy\.yaml: model\.config: seed=9223372036854775808 must be an int in \[0, 9223372036854775807\]",
    ),
    _case(
        "workload-a-text-models-setting", {"workload.max_new_tokens": 8}, DeploymentError,
        r"deploy\.yaml: workload: max_new_tokens=8 is not read by model 'streaming_tts'; its workload reads "
        r"\['streams', 'arrival_rate_hz', 'voices', .*'max_frames', 'seed'\]",
    ),
    _case(
        "workload-a-speech-models-setting",
        {"model": {"name": "gemma3"}, "resources": None, "workload": {"streams": 2, "max_frames": 9}},
        DeploymentError,
        r"deploy\.yaml: workload: max_frames=9 is not read by model 'gemma3'; its workload reads "
        r"\['streams', 'arrival_rate_hz', 'min_text_tokens', .*'max_new_tokens', 'seed'\]",
    ),
    _case(
        "compile-token-buckets-of-a-text-model",
        {
            "model": {"name": "gemma3"}, "resources": None, "workload": {"streams": 2},
            "compile": {"token_counts": [1, 128]},
        },
        DeploymentError,
        r"deploy\.yaml: compile: token_counts=\[1, 128\] is not read by model 'gemma3'; its compile reads "
        r"\['batch_sizes', 'min_batch', 'persistent_cache_dir', 'persistent_cache_min_compile_secs'\]",
    ),
    _case(
        "arrival_rate_hz=true", {"workload.arrival_rate_hz": True}, DeploymentError,
        r"deploy\.yaml: workload: arrival_rate_hz=True must be a number >= 0\.000277.*",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "error", "pattern"), PARSE_CASES)
def test_a_bad_deployment_mapping_is_refused_and_left_as_it_was(
    changes, error, pattern, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    mapping = _changed(changes)
    before = copy.deepcopy(mapping)
    with pytest.raises(DeploymentError) as info:
        parse_deployment(mapping, source="deploy.yaml")
    assert type(info.value) is error
    assert re.fullmatch(pattern, str(info.value)), str(info.value)
    assert mapping == before
    assert _files(tmp_path) == {}


def _files(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a directory)."""
    return {
        str(path.relative_to(root)): None if path.is_dir() else path.read_bytes()
        for path in sorted(root.rglob("*"))
    }


# load_deployment(path): (the file's name, its bytes or text or None for none, error, pattern); `{path}` in a
# pattern is the path.
LOAD_CASES = [
    _case(
        "not-utf-8", "bad.yaml", b"\xff\xfe model", DeploymentError,
        r"{path}: cannot read it: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte",
    ),
    _case(
        "a-list", "bad.yaml", "- model\n- engine\n", DeploymentError,
        r"{path}: a deployment must be a mapping of sections, got list \['model', 'engine'\]",
    ),
    _case(
        "a-tab", "bad.yaml", "model:\n\tname: streaming_tts\n", DeploymentError,
        r"(?s){path}: invalid YAML: .*found character '\\t' that cannot start any token.*line 2, column 1",
    ),
    _case(
        "nested-duplicate", "bad.yaml",
        "model: {name: streaming_tts}\nresources:\n  talker_kv: {max_slots: 2, max_slots: 4}\n",
        DeploymentError, r"(?s){path}: invalid YAML: .*found duplicate key 'max_slots'.*line 3, column 29",
    ),
    _case(
        "a-directory", "conf", None, DeploymentError,
        r"{path}: cannot read it: \[Errno 21\] Is a directory.*",
    ),
    _case(
        "nul-in-path", "bad\x00.yaml", None, DeploymentError, r"{path}: cannot read it: embedded null byte",
    ),
    _case("empty-path", "", None, DeploymentError, r"path='' is empty; it must name a deployment YAML file"),
    _case("not-a-path", 5, None, TypeError, r"path=5 must be a str, an os\.PathLike or a Traversable"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "error", "pattern"), LOAD_CASES)
def test_a_bad_deployment_file_is_refused_and_nothing_is_written(
    name, content, error, pattern, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    if isinstance(content, bytes):
        (tmp_path / name).write_bytes(content)
    elif isinstance(content, str):
        (tmp_path / name).write_text(content)
    elif name == "conf":
        (tmp_path / name).mkdir()
    path = name if not isinstance(name, str) or not name else str(tmp_path / name)
    before = _files(tmp_path)
    with pytest.raises(error) as info:
        load_deployment(path)
    assert type(info.value) is error
    expected = pattern.replace("{path}", re.escape(str(path)))
    assert re.fullmatch(expected, str(info.value)), str(info.value)
    assert _files(tmp_path) == before


# -- the command line ---------------------------------------------------------------------------------

_FILES = {
    "not-utf-8.yaml": b"\xff\xfe model",
    "scalar.yaml": "hello\n",
    "int-key.yaml": "model: {name: streaming_tts}\nresources: {flow_kv: {1: 2}}\n",
    "dup.yaml": "model: {name: streaming_tts}\nengine:\n  max_batch: 2\n  max_batch: 4\n",
    "max-batch-8.yaml": "model: {name: streaming_tts}\nengine: {max_batch: 8}\n",
    "cache-a-file.yaml": "model: {name: streaming_tts}\ncompile: {persistent_cache_dir: scalar.yaml}\n",
    "cache-in-file.yaml": "model: {name: streaming_tts}\ncompile: {persistent_cache_dir: scalar.yaml/c}\n",
    "not-utf-8.txt": b"\xff\xfe a prompt",
    "cache-too-long.yaml": "model: {name: streaming_tts}\ncompile: {persistent_cache_dir: new/"
    + "c" * 300
    + "}\n",
    "gemma.yaml": "model: {name: gemma3}\n",
    "cache-in-proc.yaml": "model: {name: streaming_tts}\ncompile: {persistent_cache_dir: /proc/mstar-c}\n",
}
_NO_FIT = (
    r".*streaming_tts\.yaml: the deployment needs model weights \(.*\) [\d.]+ MiB \+ .* = [\d.]+ MiB, "
    r"more than the device memory "
    r"1\.0 KiB \(--device-memory\); it does not fit even with one slot per cache, where the largest part "
    r"is model weights .*"
)
CHECK, RUN, TOP = r"mstar-jax check: error: ", r"mstar-jax run: error: ", r"mstar-jax: error: "
GENERATE, SERVE = r"mstar-jax generate: error: ", r"mstar-jax serve: error: "
_A_DIRECTORY = r"it must be a directory \(existing or not yet\) that can be written"

# main(argv), in a directory holding `_FILES` and `conf/`: (argv, whether argparse refuses it as usage, the
# pattern of stderr's last line).
CLI_CASES = [
    _case(
        "check-not-utf-8", ["check", "not-utf-8.yaml"], False,
        CHECK + r"not-utf-8\.yaml: cannot read it: 'utf-8' codec can't decode byte 0xff in position 0: .*",
    ),
    _case(
        "check-a-scalar", ["check", "scalar.yaml"], False,
        CHECK + r"scalar\.yaml: a deployment must be a mapping of sections, got str 'hello'",
    ),
    _case(
        "check-a-directory", ["check", "conf"], False,
        CHECK + r"conf: cannot read it: \[Errno 21\] Is a directory.*",
    ),
    _case(
        "check-empty-path", ["check", ""], False,
        CHECK + r"path='' is empty; it must name a deployment YAML file",
    ),
    _case(
        "check-resource-int-key", ["check", "int-key.yaml"], False,
        CHECK + r"int-key\.yaml: resources\.flow_kv: resource 'flow_kv' got unknown YAML key\(s\) \[1\]; "
        r"it accepts \['max_slots'\]",
    ),
    _case(
        "check-duplicate-key", ["check", "dup.yaml"], False,
        CHECK + r"dup\.yaml: invalid YAML: while constructing a mapping .* found duplicate key 'max_batch' "
        r".*line 4.*",
    ),
    _case("check-does-not-fit", ["check", "--device-memory", "1KiB"], False, CHECK + _NO_FIT),
    _case(
        "check-zero-memory", ["check", "--device-memory", "0"], True,
        CHECK + r"argument --device-memory: size='0' must be at least 1 byte",
    ),
    _case(
        "check-negative-memory", ["check", "--device-memory=-5GiB"], True,
        CHECK + r"argument --device-memory: size='-5GiB' must be a number of at most 40 digits with an "
        r"optional unit \(B, KiB, .*\), e\.g\. 16GiB",
    ),
    _case(
        "unknown-command", ["listen"], True,
        TOP + r"argument COMMAND: invalid choice: 'listen' "
        r"\(choose from 'check', 'run', 'serve', 'generate'\)",
    ),
    _case("unknown-option", ["check", "--bogus"], True, TOP + r"unrecognized arguments: --bogus"),
    _case(
        "run-output-without-value", ["run", "--output"], True,
        RUN + r"argument --output: expected one argument",
    ),
    _case(
        "run-empty-output", ["run", "--output", ""], False,
        RUN + r"--output='' must be a non-empty path; " + _A_DIRECTORY,
    ),
    _case(
        "run-output-a-device", ["run", "--output", "/dev/null"], False,
        RUN + r"--output='/dev/null' is an existing file, not a directory; it must be a directory .*",
    ),
    _case(
        "run-missing-config", ["run", "--config", "nope.yaml", "--output", "out"], False,
        RUN + r"nope\.yaml: no such file",
    ),
    _case("run-does-not-fit", ["run", "--output", "out", "--device-memory", "1KiB"], False, RUN + _NO_FIT),
    _case(
        "run-contradiction", ["run", "--config", "max-batch-8.yaml", "--output", "out"], False,
        RUN + r"max-batch-8\.yaml: engine\.max_batch=8 exceeds resources\.talker_kv\.max_slots=4: every "
        r"request in a batch holds a slot, so such a batch never forms; raise max_slots or lower "
        r"engine\.max_batch",
    ),
    _case(
        "run-cache-dir-a-file", ["run", "--config", "cache-a-file.yaml", "--output", "out"], False,
        RUN + r"cache-a-file\.yaml: compile\.persistent_cache_dir='scalar\.yaml' is an existing file, not a "
        r"directory; " + _A_DIRECTORY,
    ),
    _case(
        "run-cache-dir-under-a-file", ["run", "--config", "cache-in-file.yaml", "--output", "out"], False,
        RUN + r"cache-in-file\.yaml: compile\.persistent_cache_dir='scalar\.yaml/c' is under "
        r"'scalar\.yaml', a file; " + _A_DIRECTORY,
    ),
    _case(
        "check-cache-dir-a-file", ["check", "cache-a-file.yaml"], False,
        CHECK + r"cache-a-file\.yaml: compile\.persistent_cache_dir='scalar\.yaml' is an existing file, not "
        r"a directory; " + _A_DIRECTORY,
    ),
    _case(
        "check-memory-of-50-digits", ["check", "--device-memory", "9" * 50], True,
        CHECK + r"argument --device-memory: size='9{50}' must be a number of at most 40 digits .*",
    ),
    _case(
        "run-output-cannot-be-created", ["run", "--output", "/proc/mstar-jax-out/run"], False,
        RUN + r"--output='/proc/mstar-jax-out/run' (cannot be created or written: .*|: '/proc' is not "
        r"writable); " + _A_DIRECTORY,
    ),
    _case(  # as root, refused only once the output folders are made: they are removed again
        "run-cache-dir-cannot-be-created", ["run", "--config", "cache-in-proc.yaml", "--output", "out/run"],
        False,
        RUN + r"cache-in-proc\.yaml: compile\.persistent_cache_dir='/proc/mstar-c' (cannot be created or "
        r"written: .*|: '/proc' is not writable); " + _A_DIRECTORY,
    ),
    _case(  # refused only once its parent is made: the parent is removed again
        "run-cache-dir-name-too-long", ["run", "--config", "cache-too-long.yaml", "--output", "out"], False,
        RUN + r"cache-too-long\.yaml: compile\.persistent_cache_dir='new/c{300}' cannot be created or "
        r"written: File name too long; " + _A_DIRECTORY,
    ),
    _case(
        "run-output-name-too-long", ["run", "--output", "new/" + "o" * 300], False,
        RUN + r"--output='new/o{300}' cannot be created or written: File name too long; " + _A_DIRECTORY,
    ),
    _case(
        "serve-voices-of-a-text-model", ["serve", "--port", "0", "--config", "gemma.yaml", "--voices", "3"],
        False, SERVE + r"--voices=3 is not read by model 'gemma3', which has no voices; leave it out",
    ),
    _case(
        "serve-voices-do-not-fit",
        ["serve", "--port", "0", "--voices", "100000000", "--device-memory", "1GiB"], False,
        SERVE + r".*streaming_tts\.yaml: the deployment needs .* talker_kv source bank "
        r"\(100000000 sources\) .* more than the device memory 1\.0 GiB \(--device-memory\).*",
    ),
    _case(
        "serve-memory-nan", ["serve", "--port", "0", "--device-memory", "nan"], True,
        SERVE + r"argument --device-memory: size='nan' must be a number of at most 40 digits .*",
    ),
    _case(
        "serve-memory-zero", ["serve", "--port", "0", "--device-memory", "0"], True,
        SERVE + r"argument --device-memory: size='0' must be at least 1 byte",
    ),
    _case(
        "generate-empty-gguf", ["generate", "--gguf", ""], True,
        GENERATE + r"argument --gguf: '' must be a non-empty path",
    ),
    _case(
        "generate-empty-store", ["generate", "--executable-store", ""], True,
        GENERATE + r"argument --executable-store: '' must be a non-empty path",
    ),
    _case(
        "generate-prompt-not-utf-8", ["generate", "--prompt-file", "not-utf-8.txt"], False,
        GENERATE + r"--prompt-file 'not-utf-8\.txt' is not UTF-8 text \(invalid start byte at byte 0\)",
    ),
    _case(
        "generate-chunk-past-int32", ["generate", "--chunk", "9" * 30], True,
        GENERATE + r"argument --chunk: '9{30}' must be an int in \[1, 2147483647\]",
    ),
    _case(
        "generate-store-a-file", ["generate", "--executable-store", "scalar.yaml"], False,
        GENERATE + r"--executable-store='scalar\.yaml' is an existing file, not a directory; " + _A_DIRECTORY,
    ),
    _case(
        "generate-store-under-a-file", ["generate", "--executable-store", "scalar.yaml/store"], False,
        GENERATE + r"--executable-store='scalar\.yaml/store' is under 'scalar\.yaml', a file; "
        + _A_DIRECTORY,
    ),
]  # fmt: skip


def _forbid_serving(monkeypatch) -> None:
    """`run` and `serve` fail at once where they would build an engine (a missed refusal must not start
    a server that runs until the test's timeout)."""
    from mstar_jax.models.gemma3 import run as text_module
    from mstar_jax.models.streaming_tts import Engine
    from mstar_jax.models.streaming_tts import run as run_module

    def built(*args, **kwargs):
        raise AssertionError("an engine was built: the refusal came after building")

    monkeypatch.setattr(run_module, "run_deployment", built)
    monkeypatch.setattr(text_module, "build_text_engine", built)
    monkeypatch.setattr(Engine, "from_deployment", built)


@pytest.mark.parametrize(("argv", "usage", "pattern"), CLI_CASES)
def test_a_bad_command_line_exits_2_with_one_line_and_writes_nothing(
    argv, usage, pattern, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    _forbid_serving(monkeypatch)
    for name, content in _FILES.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (tmp_path / "conf").mkdir()
    before = _files(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = ("usage", exit_.code)
    assert status == (("usage", 2) if usage else 2)
    lines = err.getvalue().splitlines()
    assert lines
    assert err.getvalue().endswith("\n")
    if usage:
        assert lines[0].startswith("usage: mstar-jax")  # argparse: its usage, then one error line
    else:
        assert len(lines) == 1, lines
    assert "Traceback" not in err.getvalue()
    assert re.fullmatch(pattern, lines[-1]), lines[-1]
    if argv[0] == "run":
        assert out.getvalue() == ""
    assert _files(tmp_path) == before  # no output directory, no report


# -- configs and specs --------------------------------------------------------------------------------

BASE = {
    "num_layers": 2, "num_heads": 1, "head_dim": 4, "rows_per_request": 1, "max_source_len": 4,
    "min_source_len": 1, "retention": SinkWindow(2, 3), "max_slots": 2,
}  # fmt: skip
CFG = BoundedKVConfig(**BASE)
SPEC = BoundedKVSpec("kv", {"node"}, CFG)


def _config(**changes) -> BoundedKVConfig:
    return BoundedKVConfig(**{**BASE, **changes})


ONE_LAYER = _config(num_layers=1, min_source_len=0)


def _attend(layer, *, jit: bool = False):
    """`attend(..., layer)` on a one-layer cache, in a planned one-token step of a fresh request."""
    manager = BoundedKVManager(BoundedKVSpec("kv", {"node"}, ONE_LAYER), num_sources=1)
    manager.ingest_request("a")
    step = BoundedKVStep((Segment("a", "main", 1),), {"a": Pos(0, 0)})
    assert manager.admit(step).ok
    plan = manager.plan(step)
    q = jnp.ones((1, 1, ONE_LAYER.num_heads, ONE_LAYER.head_dim))
    kv = jnp.ones((1, 1, ONE_LAYER.num_heads, ONE_LAYER.head_dim))
    fn = lambda cache, bank, plan, q, k, v: attend(  # noqa: E731
        cache, bank, plan, layer, q, k, v, config=ONE_LAYER, implementation="xla"
    )
    return (jax.jit(fn) if jit else fn)(manager.take_cache(), manager.bank, plan, q, kv, kv)


_THIS_FILE = Path(__file__).resolve()  # an existing file: a store there, or under it, cannot be made


# call(*inputs) with the inputs it may not change: (call, inputs, error, pattern).
CONFIG_CASES = [
    _case("head_dim=0", _config, {"head_dim": 0}, ValueError, r"head_dim=0 must be an int >= 1"),
    _case(
        "num_layers=np.int8(-1)", _config, {"num_layers": np.int8(-1)}, ValueError,
        r"num_layers=np\.int8\(-1\) must be an int >= 1",
    ),
    _case(
        "retention=list", _config, {"retention": [1, 2]}, ValueError,
        r"retention=\[1, 2\] must be a SinkWindow or a callable source_len -> SinkWindow",
    ),
    _case(
        "retention-takes-no-length", _config, {"retention": lambda: SinkWindow(1, 1)}, ValueError,
        r"retention\(1\) raised TypeError\(.*\); it must return a SinkWindow for every source length in "
        r"\[min_source_len=1, max_source_len=4\]",
    ),
    _case(
        "window_includes_step=str", _config, {"retention": SinkWindow(2, 3, "yes")}, ValueError,
        r"retention\(1\)\.window_includes_step='yes' must be a bool",
    ),
    _case(
        "dtype=list", _config, {"dtype": [1]}, ValueError,
        r"dtype=\[1\] is not a dtype; use one of float32, bfloat16, float16",
    ),
    _case(
        "dtype=int8", _config, {"dtype": "int8"}, ValueError,
        r"dtype='int8' must be a floating dtype the cache stores \(float32, bfloat16, float16\), not int8",
    ),
    _case(
        "dtype=float64", _config, {"dtype": np.float64}, ValueError,
        r"dtype=<class 'numpy\.float64'> must be a floating dtype the cache stores \(float32, bfloat16, "
        r"float16\), not float64",
    ),
    _case(
        "sink+window-past-int32", _config, {"retention": SinkWindow(2**31 - 4, 4)}, ValueError,
        r"retention\(1\) keeps sink=2147483644 \+ window=4 = 2147483648 entries; the sum must be <= "
        r"2147483647 \(positions are int32\)",
    ),
    _case(
        "reverse_step_order=None", _config, {"reverse_step_order": None}, ValueError,
        r"reverse_step_order=None must be a bool",
    ),
    _case(
        "replace-max_slots=0", lambda c: dataclasses.replace(c, max_slots=0), [CFG], ValueError,
        r"max_slots=0 must be an int >= 1",
    ),
    _case(
        "retention_for-float", lambda c: c.retention_for(2.0), [CFG], ValueError,
        r"source_len=2\.0 must be an int",
    ),
    _case(
        "retention_for-past-max", lambda c: c.retention_for(9), [CFG], ValueError,
        r"source_len=9 is outside \[min_source_len=1, max_source_len=4\]",
    ),
    _case(
        "spec-nodes-unhashable", lambda nodes: BoundedKVSpec("kv", nodes, CFG), [[["a"]]], TypeError,
        r"nodes=\[\['a'\]\] must be an iterable of node names, each a str",
    ),
    _case(
        "spec-config-dict", lambda config: BoundedKVSpec("kv", {"node"}, config), [{"num_layers": 1}],
        TypeError, r"config=\{'num_layers': 1\} must be a BoundedKVConfig",
    ),
    _case(
        "spec-yaml-unknown-key", lambda spec: spec.apply_yaml_overrides(window=3), [SPEC], TypeError,
        r"resource 'kv' got unknown YAML key\(s\) \['window'\]; it accepts \['max_slots'\]",
    ),
    _case(
        "overrides-int-key", apply_yaml_overrides, [[SPEC], {"resources": {"kv": {1: 2}}}], TypeError,
        r"resource 'kv' got unknown YAML key\(s\) \[1\]; it accepts \['max_slots'\]",
    ),
    _case(
        "overrides-resources=false", apply_yaml_overrides, [[SPEC], {"resources": False}], ValueError,
        r"resources=False must be a mapping of resource key to settings",
    ),
    _case(
        "overrides-two-specs-one-key", apply_yaml_overrides, [[SPEC, SPEC], {}], ValueError,
        r"resource specs are inconsistent:\n  two resources declared under the key 'kv'",
    ),
    _case(
        "combined-split-walks=None", lambda walks: CombinedSplit("mixed", walks), [None], TypeError,
        r"prefill_walks=None must be a sequence of walk names \(not a str\)",
    ),
    _case(
        "bucket-bs=0", lambda: BucketKey("decode", 0, 1), [], ValueError,
        r"BucketKey\.bs=0 must be an int >= 1",
    ),
    _case(
        "step-position-int", lambda p: BoundedKVStep((Segment("a", "main", 1),), p), [{"a": 5}], TypeError,
        r"positions\['a'\]=5 must be a StreamPosition\(source_len, written\[, source\]\)",
    ),
    _case(
        "step-position-4-fields", lambda p: BoundedKVStep((Segment("a", "main", 1),), p),
        [{"a": (3, 0, 0, 1)}], TypeError,
        r"positions\['a'\]=\(3, 0, 0, 1\) must be a StreamPosition\(source_len, written\[, source\]\)",
    ),
    _case(
        "step-step_tokens-int", lambda: BoundedKVStep((Segment("a", "main", 1),), {}, 3), [], TypeError,
        r"step_tokens=3 must be a mapping of request id to value",
    ),
    _case(
        "step-segments-str", lambda: BoundedKVStep("abc"), [], TypeError,
        r"segments='abc' must be a sequence of Segment\(request_id, label, span\)",
    ),
    _case(
        "step-segment-plain-tuple", lambda segs: BoundedKVStep(segs), [[("a", "main", 1)]], TypeError,
        r"segments\[0\]=\('a', 'main', 1\) must be a Segment\(request_id, label, span\)",
    ),
    _case(
        "tts-dtype=list", lambda: StreamingTTSConfig(dtype=["float32"]), [], ValueError,
        r"dtype=\['float32'\] must be one of \['bfloat16', 'float32'\]",
    ),
    _case(
        "tts-kv-heads-not-dividing", lambda: StreamingTTSConfig(talker_heads=4, talker_kv_heads=3), [],
        ValueError,
        r"talker_heads=4 must be a multiple of talker_kv_heads=3 \(grouped-query attention .*\)",
    ),
    _case(
        "tts-query_window-past-window", lambda: StreamingTTSConfig(query_window=40), [], ValueError,
        r"query_window=40 must be <= talker_window \+ 1 = 33: .*",
    ),
    _case(
        "model_config-unknown-setting", lambda s: model_config("streaming_tts", s), [{"talker_layer": 2}],
        ValueError,
        r"model 'streaming_tts' has no setting\(s\) \['talker_layer'\]; it accepts \[.*'talker_layers'.*\]",
    ),
    _case(
        "model_config-unknown-model", lambda: model_config("tts"), [], ValueError,
        r"unknown model 'tts'; known models: \['gemma3', 'streaming_tts'\]",
    ),
    _case(
        "store-a-file", ExecutableStore, [_THIS_FILE], ValueError,
        rf"directory={re.escape(repr(str(_THIS_FILE)))} is an existing file, not a directory; "
        + _A_DIRECTORY,
    ),
    _case(
        "store-under-a-file", ExecutableStore, [_THIS_FILE / "store"], ValueError,
        rf"directory={re.escape(repr(str(_THIS_FILE / 'store')))} is under "
        rf"{re.escape(repr(str(_THIS_FILE)))}, a file; " + _A_DIRECTORY,
    ),
    _case(
        "store-empty-path", ExecutableStore, [""], ValueError,
        r"directory='' must be a non-empty path; " + _A_DIRECTORY,
    ),
    _case(
        "attend-layer-past-the-cache", _attend, [3], ValueError,
        r"layer=3 is outside \[0, num_layers=1\): the cache holds 1 layer\(s\), numbered from 0",
    ),
    _case(
        "attend-layer-negative", _attend, [np.int64(-1)], ValueError,
        r"layer=-1 is outside \[0, num_layers=1\): .*",
    ),
    _case(
        "attend-layer-past-the-cache-in-jit", lambda layer: _attend(layer, jit=True), [1], ValueError,
        r"layer=1 is outside \[0, num_layers=1\): .*",
    ),
    _case(
        "attend-layer-bool", _attend, [False], TypeError,
        r"layer=False must be an int in \[0, num_layers=1\), got bool",
    ),
    _case(
        "attend-layer-float", _attend, [0.0], TypeError,
        r"layer=0\.0 must be an int in \[0, num_layers=1\), got float",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("call", "inputs", "error", "pattern"), CONFIG_CASES)
def test_a_bad_config_is_refused_and_its_inputs_are_unchanged(call, inputs, error, pattern):
    before = copy.deepcopy(inputs)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    assert type(info.value) is error
    assert re.fullmatch(pattern, str(info.value)), str(info.value)
    assert inputs == before
    assert _config() == CFG
    assert BoundedKVSpec("kv", {"node"}, _config()) == SPEC
    assert _THIS_FILE.is_file()  # nothing was made under it


@pytest.mark.parametrize("layer", [0, np.int64(0)], ids=["int", "np.int64"])
def test_attend_takes_every_int_layer_of_the_cache(layer):
    out, cache = _attend(layer)
    eager, _ = _attend(0, jit=True)
    np.testing.assert_array_equal(out, eager)
    assert len(cache.k) == 1


def test_a_traced_layer_is_left_to_the_indexing():
    """Only concrete ints are checked: a layer traced inside `jit` or `scan` passes `check_layer`."""
    seen = []

    def fn(layer):
        check_layer(layer, ONE_LAYER)  # 3 is past the cache, but traced: not known here
        seen.append(type(layer).__name__)
        return layer

    assert jax.jit(fn)(3) == 3
    assert len(seen) == 1
    assert "Tracer" in seen[0]


# -- the manager --------------------------------------------------------------------------------------

# Sources 0 (3 tokens) and 1 (4 tokens) in a bank of 3; two slots, the sink 2 and the window 3.
# Requests: "live" wrote 1 token in slot 0 reading source 0; "away" wrote 1 reading source 1, then went to
# host memory; "new" was ingested and holds nothing. One slot is free.
L, R, G, D = CFG.num_layers, CFG.rows_per_request, CFG.num_heads, CFG.head_dim


def _source(length: int, seed: int = 0, dtype=np.float32) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).standard_normal((L, R, G, length, D)).astype(dtype))


def _poisoned(layers: list[np.ndarray], value: float, layer: int = 1) -> list[np.ndarray]:
    """`layers` with entry [0, 0, 1, 2] of `layer` set to `value`."""
    layers = [x.copy() for x in layers]
    layers[layer][0, 0, 1, 2] = value
    return layers


def _step(*entries, tokens=None) -> tuple[BoundedKVStep, StepContext]:
    """A step of (request id, position, span) entries and its context."""
    step = BoundedKVStep(
        tuple(Segment(rid, "main", span) for rid, _, span in entries),
        {rid: pos for rid, pos, _ in entries if pos is not None},
        tokens or {},
    )
    return step, StepContext([rid for rid, _, _ in entries], "decode", 0, capture=False)


def _commit(manager: BoundedKVManager, rid: str, pos: Pos, span: int = 1) -> None:
    step, ctx = _step((rid, pos, span))
    assert manager.admit(step, ctx).ok
    manager.commit(step, ctx)


def _manager() -> BoundedKVManager:
    manager = BoundedKVManager(SPEC, num_sources=3)
    manager.register_source(0, _source(3, 0), _source(3, 1))
    manager.register_source(1, _source(4, 2), _source(4, 3))
    for rid in ("live", "away", "new"):
        manager.ingest_request(rid)
    _commit(manager, "live", Pos(3, 0, 0))
    _commit(manager, "away", Pos(4, 0, 1))
    rng = np.random.default_rng(4)  # entries a refused call must not move
    manager.cache = jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), BoundedKVCache.abstract(CFG)
    )
    assert manager.offload("away") > 0
    return manager


def _manager_state(manager: BoundedKVManager) -> tuple:
    """Every piece of host bookkeeping a refused call must leave as it was, and the device bits."""
    requests = {
        rid: (r.slot, r.written, r.source, r.source_len, r.policy, r.admitted, r.host_copy is not None)
        for rid, r in manager._requests.items()
    }
    readers = {index: n for index, n in manager._readers.items() if n}
    host = (
        manager._slots.snapshot(),
        requests,
        readers,
        dict(manager._source_lengths),
        list(manager._claims),
    )
    device = [
        np.asarray(x).view(np.uint8) for x in jax.tree.leaves(jax.device_get((manager.cache, manager.bank)))
    ]
    return host, device


def _assert_same_state(before: tuple, after: tuple) -> None:
    assert after[0] == before[0]
    assert len(after[1]) == len(before[1])
    for old, new in zip(before[1], after[1], strict=True):
        np.testing.assert_array_equal(new, old)  # every bit


def _admit_live(manager: BoundedKVManager) -> None:
    """A pending admission: "live"'s second step, admitted and not yet committed."""
    assert manager.admit(*_step(("live", Pos(3, 1, 0), 1))).ok


def _fill(manager: BoundedKVManager) -> None:
    manager.ingest_request("other")
    _commit(manager, "other", Pos(3, 0, 0))


@dataclasses.dataclass(frozen=True)
class _Priority(ResourceReqConfig):
    """A per-request setting the resource checks at ingest."""

    priority: int

    def validate(self, spec=None) -> None:
        if self.priority < 0:
            raise ValueError(f"priority={self.priority} must be >= 0 for resource {spec.resource_key!r}")


def _admit(*entries, tokens=None):
    return lambda m: m.admit(*_step(*entries, tokens=tokens))


def _plan(*entries):
    return lambda m: m.plan(*_step(*entries))


def _commit_call(*entries):
    return lambda m: m.commit(*_step(*entries))


# (setup before the snapshot, call(manager), the exception or refusal reason type, pattern).
MANAGER_CASES = [
    _case(
        "register-index-past-bank", None, lambda m: m.register_source(3, _source(2), _source(2)), ValueError,
        r"source index=3 must be an int in \[0, 3\)",
    ),
    _case(
        "register-index-str", None, lambda m: m.register_source("2", _source(2), _source(2)), ValueError,
        r"source index='2' must be an int in \[0, 3\)",
    ),
    _case(
        "register-k-None", None, lambda m: m.register_source(2, None, _source(2)), ValueError,
        r"source k must be a non-empty sequence of per-layer arrays of one shape "
        r"\[rows, kv_heads, length, head_dim\], got NoneType",
    ),
    _case(
        "register-no-layers", None, lambda m: m.register_source(2, [], []), ValueError,
        r"source k must be a non-empty sequence of per-layer arrays .*, got layer shapes \[\]",
    ),
    _case(
        "register-ragged-layers", None,
        lambda m: m.register_source(2, _source(2), [_source(2)[0], _source(3)[1]]), ValueError,
        r"source v must be .*, got layer shapes \[\(1, 1, 2, 4\), \(1, 1, 3, 4\)\]",
    ),
    _case(
        "register-complex", None,
        lambda m: m.register_source(2, _source(2, dtype=np.complex64), _source(2)), ValueError,
        r"source k has dtype complex64; it must hold real numbers \(float or int\)",
    ),
    _case(
        "register-too-long", None, lambda m: m.register_source(2, _source(5), _source(5)), ValueError,
        r"source length 5 is outside \[min_source_len=1, max_source_len=4\]",
    ),
    _case(
        "register-nan-k", None, lambda m: m.register_source(2, _poisoned(_source(2), np.nan), _source(2)),
        ValueError,
        r"source 2 k is not finite: 1 NaN and 0 infinite of its 16 entries, the first k\[1\]\[0, 0, 1, 2\] "
        r"= np\.float32\(nan\) \(\[layer\]\[row, kv_head, position, dim\]\); every request reading source 2 "
        r"would attend to it, so register finite keys and values",
    ),
    _case(
        "register-inf-v-jax", None,
        lambda m: m.register_source(2, _source(2), [jnp.asarray(x) for x in _poisoned(_source(2), -np.inf)]),
        ValueError, r"source 2 v is not finite: 0 NaN and 1 infinite of its 16 entries, the first "
        r"v\[1\]\[0, 0, 1, 2\] = np\.float32\(-inf\) .*",
    ),
    _case(
        "register-nan-and-inf-k", None,
        lambda m: m.register_source(2, _poisoned(_poisoned(_source(2), np.inf, 0), np.nan), _source(2)),
        ValueError, r"source 2 k is not finite: 1 NaN and 1 infinite of its 16 entries, the first "
        r"k\[0\]\[0, 0, 1, 2\] = np\.float32\(inf\) .*",
    ),
    _case(
        "register-overflowing-v", None,
        lambda m: m.register_source(2, _source(2), _poisoned(_source(2, dtype=np.float64), 1e300)),
        ValueError, r"source 2 v overflows float32: 0 NaN and 1 infinite of its 16 entries, the first "
        r"v\[1\]\[0, 0, 1, 2\] = np\.float64\(1e\+300\) .*",
    ),
    _case(
        "register-over-a-read-source", None, lambda m: m.register_source(0, _source(2), _source(2)),
        ValueError, r"source 0 is read by 1 live request\(s\); remove them before replacing it",
    ),
    _case(
        "remove-unregistered", None, lambda m: m.remove_source(2), ValueError,
        r"source 2 is not registered; registered: \[0, 1\]",
    ),
    _case(
        "remove-unhashable", None, lambda m: m.remove_source([0]), ValueError,
        r"source index=\[0\] must be an int in \[0, 3\)",
    ),
    _case(
        "remove-read-by-offloaded", None, lambda m: m.remove_source(1), ValueError,
        r"source 1 is read by 1 live request\(s\); cannot remove it",
    ),
    _case(
        "ingest-config-dict", None, lambda m: m.ingest_request("x", {"max_slots": 1}), TypeError,
        r"req_config=\{'max_slots': 1\} must be a ResourceReqConfig or None",
    ),
    _case(
        "ingest-config-refused", None, lambda m: m.ingest_request("x", _Priority(-1)), ValueError,
        r"priority=-1 must be >= 0 for resource 'kv'",
    ),
    _case(
        "ingest-id-None", None, lambda m: m.ingest_request(None), TypeError, r"request_id=None must be a str",
    ),
    _case(
        "admit-never-ingested", None, _admit(("new", Pos(3, 0, 0), 1), ("ghost", Pos(3, 0, 0), 1)),
        AdmitRuntimeError, r"bounded KV: request 'ghost' was never ingested \(call ingest_request first\)",
    ),
    _case(
        "admit-offloaded", None, _admit(("away", Pos(4, 1, 1), 1)), RequestOffloading,
        r"bounded KV: 'away' is offloaded to host memory",
    ),
    _case(
        "admit-full", _fill, _admit(("new", Pos(3, 0, 0), 1)), AllocationFailed,
        r"bounded KV is full: 2 slots, 0 free, 1 needed",
    ),
    _case(
        "admit-source_len-str", None, _admit(("new", Pos("3", 0, 0), 1)), AdmitRuntimeError,
        r"'new' declares source_len='3'; it must be an int >= 0",
    ),
    _case(
        "admit-written-ahead", None, _admit(("live", Pos(3, 5, 0), 1)), AdmitRuntimeError,
        r"'live' declares 5 written tokens; 1 were committed \(positions must continue from the last "
        r"committed step\)",
    ),
    _case(
        "admit-a-plain-step", None,
        lambda m: m.admit(ResourceStep((Segment("new", "main", 1),)), StepContext(["new"], "d", 0, False)),
        TypeError, r"the bounded KV cache takes a BoundedKVStep, got ResourceStep",
    ),
    _case(
        "plan-without-admit", None, _plan(("new", Pos(3, 0, 0), 1)), StepNotAdmittedError,
        r"bounded KV plan: 'new' holds no slot or declares no position; plan only a step admit accepted",
    ),
    _case(
        "plan-never-ingested", None, _plan(("ghost", Pos(3, 0, 0), 1)), UnknownRequestError,
        r"bounded KV plan: request 'ghost' was never ingested \(or was removed\)",
    ),
    _case(
        "commit-without-admit", None, _commit_call(("live", Pos(3, 1, 0), 1)), StepNotAdmittedError,
        r"bounded KV commit: 'live' declares \(source=0, source_len=3, written=1, span=1\), but admit "
        r"accepted no step \(or it was committed or aborted since\); commit only the step admit accepted",
    ),
    _case(
        "commit-another-span", _admit_live, _commit_call(("live", Pos(3, 1, 0), 0)), StepNotAdmittedError,
        r"bounded KV commit: 'live' declares \(.*span=0\), but admit accepted "
        r"\(source=0, source_len=3, written=1, span=1\) .*",
    ),
    _case(
        "commit-never-ingested", None, _commit_call(("ghost", Pos(3, 0, 0), 1)), UnknownRequestError,
        r"bounded KV commit: request 'ghost' was never ingested \(or was removed\)",
    ),
    _case(
        "admit-unregistered-source", None, _admit(("new", Pos(2, 0, 2), 1)), AdmitRuntimeError,
        r"'new' reads source 2, which is not registered; registered: \[0, 1\]",
    ),
    _case(
        "admit-changed-source", None, _admit(("live", Pos(4, 1, 1), 1)), AdmitRuntimeError,
        r"'live' declares source 1 of length 4, but its stream started on source 0 of length 3",
    ),
    _case(
        "num_sources=0", None, lambda m: BoundedKVManager(SPEC, num_sources=0), ValueError,
        r"num_sources=0 must be an int >= 1",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("setup", "call", "expected", "pattern"), MANAGER_CASES)
def test_a_bad_manager_call_is_refused_and_changes_nothing(setup, call, expected, pattern):
    manager = _manager()
    if setup is not None:
        setup(manager)
    before = _manager_state(manager)
    if issubclass(expected, AdmitFailedReason):
        outcome = call(manager)
        assert not outcome.ok
        assert outcome.ready is (expected is not AdmitRuntimeError)  # terminal, or retry after evicting
        assert type(outcome.reason) is expected
        message = outcome.reason.message
    else:
        with pytest.raises(expected) as info:
            call(manager)
        assert type(info.value) is expected
        message = str(info.value)
    assert re.fullmatch(pattern, message), message
    _assert_same_state(before, _manager_state(manager))


# -- GGUF files and `mstar-jax generate` --------------------------------------------------------------

# Gemma 3 270M's geometry with an 8-token vocabulary: its caches are the real model's, its weights small.
_GEMMA_METADATA = {
    "block_count": 18, "embedding_length": 640, "feed_forward_length": 2048, "attention.head_count": 4,
    "attention.head_count_kv": 1, "attention.key_length": 256, "attention.value_length": 256,
    "attention.sliding_window": 512, "context_length": 32768,
}  # fmt: skip


def _write_gemma_gguf(path: Path) -> bytes:
    """A GGUF file with Gemma 3 metadata and small float32 tensors, one per block named in the metadata
    (not the model's: enough for the checks before the tensors' own); returns its bytes."""
    import gguf  # the gemma extra: every test calling this carries its marker

    writer = gguf.GGUFWriter(path, "gemma3")
    for key, value in _GEMMA_METADATA.items():
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 1e6)
    writer.add_token_list([f"t{i}" for i in range(8)])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_tensor("token_embd.weight", np.ones((8, 16), np.float32))
    writer.add_tensor("output_norm.weight", np.ones((16,), np.float32))
    for block in range(_GEMMA_METADATA["block_count"]):
        writer.add_tensor(f"blk.{block}.attn_norm.weight", np.ones((16,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _at_tensor(data: bytes, name: str) -> int:
    """Where `name`'s entry of the tensor table goes on after its name: u32 n_dims, u64 dims, u32 type,
    u64 offset."""
    return data.index(name.encode()) + len(name)


def _packed(fmt: str, where, value):
    def corrupt(data: bytes) -> bytes:
        out = bytearray(data)
        struct.pack_into(fmt, out, where(data), value)
        return bytes(out)

    return corrupt


_TABLE = r"is truncated or corrupt: its metadata or tensor table does not parse \({error}: .*\); download or "
_TABLE += r"convert it again"

# What is done to a valid file's bytes, and the pattern of the error (`{path}`, `{size}` filled in).
GGUF_CASES = [
    _case("empty", lambda data: b"", r"GGUF file '{path}' is empty \(0 bytes\)"),
    _case(
        "garbage", lambda data: b"\x00\x01garbage" * 64,
        r"GGUF file '{path}' is not a GGUF file: it starts with b'\\x00\\x01ga', a GGUF file with b'GGUF'",
    ),
    _case(
        "truncated-in-the-header", lambda data: data[:10],
        r"GGUF file '{path}' \({size} bytes\) " + _TABLE.format(error="ValueError"),
    ),
    _case(
        "truncated-in-the-metadata", lambda data: data[:200],
        r"GGUF file '{path}' \({size} bytes\) " + _TABLE.format(error="IndexError"),
    ),
    _case(
        "truncated-in-the-tensor-data", lambda data: data[:-20],
        r"GGUF file '{path}' \({size} bytes\) " + _TABLE.format(error="ValueError"),
    ),
    _case(
        "tensor-table-counts-more-tensors", _packed("<Q", lambda data: 8, 10**6),
        r"GGUF file '{path}' \({size} bytes\) " + _TABLE.format(error="(ValueError|IndexError)"),
    ),
    _case(
        "tensor-table-unknown-type", _packed("<I", lambda d: _at_tensor(d, "token_embd.weight") + 4 + 16, 99),
        r"GGUF file '{path}' \({size} bytes\) " + _TABLE.format(error="ValueError"),
    ),
    _case(
        "tensor-table-offset-past-the-end",
        _packed("<Q", lambda d: _at_tensor(d, "token_embd.weight") + 4 + 16 + 4, 10**12),
        r"GGUF file '{path}' \({size} bytes\) " + _TABLE.format(error="ValueError"),
    ),
    _case(
        "tensor-table-more-dims", _packed("<I", lambda d: _at_tensor(d, "output_norm.weight"), 9),
        r"GGUF file '{path}' \({size} bytes\) " + _TABLE.format(error="(ValueError|IndexError)"),
    ),
]  # fmt: skip


def _forbid_loading(monkeypatch) -> None:
    """Make reading the tensors fail the test: a refusal must come before the weights are loaded."""
    from mstar_jax.models import gemma3

    def load_gguf(*args, **kwargs):
        raise AssertionError("load_gguf was called: the model was loaded before the refusal")

    monkeypatch.setattr(gemma3, "load_gguf", load_gguf)


def _generate(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["generate", *argv])
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines  # one line, no traceback
    return status, lines[0]


@pytest.mark.gemma
@pytest.mark.parametrize(("corrupt", "pattern"), GGUF_CASES)
def test_a_corrupt_gguf_file_is_refused_naming_it(corrupt, pattern, tmp_path, monkeypatch):
    from mstar_jax.models.gemma3 import GGUFError, load_gguf, open_gguf, read_config

    path = tmp_path / "model.gguf"
    path.write_bytes(corrupt(_write_gemma_gguf(tmp_path / "valid.gguf")))
    expected = pattern.format(path=re.escape(os.path.realpath(path)), size=f"{path.stat().st_size:,}")
    before = _files(tmp_path)
    for call in (open_gguf, read_config, load_gguf):
        with pytest.raises(GGUFError) as info:
            call(path)
        assert isinstance(info.value, ValueError)
        assert re.fullmatch(expected, str(info.value)), str(info.value)
    _forbid_loading(monkeypatch)
    status, line = _generate(["--gguf", str(path)])
    assert status == 2
    assert re.fullmatch(GENERATE + "--gguf: " + expected, line), line
    assert _files(tmp_path) == before


def _budget(gguf: Path, slots: int, device_bytes: int):
    """`generate`'s budget for `slots`, counted as the command counts it."""
    from flax import nnx

    from mstar_jax.memory import DeviceMemory, serving_budget
    from mstar_jax.models.gemma3 import read_config
    from mstar_jax.models.gemma3.model import Gemma3
    from mstar_jax.models.gemma3.stream import cache_configs

    config = read_config(gguf)
    caches = cache_configs(config, global_retention=SinkWindow(4, 1020), max_slots=slots)
    params = nnx.state(nnx.eval_shape(lambda: Gemma3(config, rngs=nnx.Rngs(0))))
    device = DeviceMemory(nbytes=device_bytes, source="--device-memory")
    return serving_budget(params, dict(zip(("local", "global"), caches, strict=True)), device)


@pytest.mark.gemma
def test_generate_refuses_more_slots_than_fit_naming_the_most_that_do(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    _write_gemma_gguf(gguf)
    _forbid_loading(monkeypatch)
    status, line = _generate(["--gguf", str(gguf), "--max-slots", "100000", "--device-memory", "2GiB"])
    assert status == 2
    fits = _budget(gguf, 100000, 2**31).max_fitting_slots
    assert fits is not None
    assert _budget(gguf, fits, 2**31).fits
    assert not _budget(gguf, fits + 1, 2**31).fits
    assert re.fullmatch(
        GENERATE + r"--max-slots 100000 needs model weights \([\d,]+ parameters\) [\d.]+ MiB \+ "
        r"gemma3_local_kv slots \(100,000 \+ 1 padding\) [\d.]+ TiB \+ gemma3_global_kv slots \(100,000 \+ 1 "
        r"padding\) [\d.]+ GiB \+ gemma3_local_kv source bank \(1 sources\) [\d.]+ KiB \+ gemma3_global_kv "
        r"source bank \(1 sources\) [\d.]+ KiB = [\d.]+ TiB \([\d,]+ B\), more than the 2\.0 GiB "
        rf"\(2,147,483,648 B\) available \(--device-memory\); --max-slots {fits} is the most that fits",
        line,
    ), line
    status, line = _generate(["--gguf", str(gguf), "--max-slots", "2", "--device-memory", "100MiB"])
    assert status == 2
    assert re.fullmatch(
        GENERATE + r"--max-slots 2 needs .* more than the 100\.0 MiB \(104,857,600 B\) available "
        r"\(--device-memory\); not even --max-slots 1 fits, where the largest part is model weights "
        r"\([\d,]+ parameters\) \([\d.]+ MiB\): try --dtype bfloat16, a smaller --global-window, or a "
        r"device with more memory",
        line,
    ), line
    # What fits goes on to check the tensors (this file's are not the model's), still before loading.
    status, line = _generate(["--gguf", str(gguf), "--max-slots", str(fits), "--device-memory", "2GiB"])
    assert status == 2
    assert re.fullmatch(GENERATE + r"--gguf: tensor '[\w.]+' has shape \([\d, ]+\); the config .*", line)


@pytest.mark.gemma
def test_generate_checks_the_devices_own_memory(tmp_path, monkeypatch):
    """The issue's case: no --device-memory, so the device's memory (the host's RAM on a CPU)."""
    from mstar_jax.memory import device_memory

    gguf = tmp_path / "model.gguf"
    _write_gemma_gguf(gguf)
    device = device_memory()
    if _budget(gguf, 100000, device.nbytes).fits:
        pytest.skip(f"100,000 Gemma 3 slots fit this device's {device.nbytes:,} B")
    _forbid_loading(monkeypatch)
    status, line = _generate(["--gguf", str(gguf), "--max-slots", "100000"])
    assert status == 2
    assert re.fullmatch(
        GENERATE + rf"--max-slots 100000 needs .* = .*, more than the .* \({device.nbytes:,} B\) available "
        rf"\({re.escape(device.source)}\); --max-slots \d+ is the most that fits",
        line,
    ), line


@pytest.mark.gemma
def test_generate_refuses_a_global_sink_and_window_past_int32_together(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    _write_gemma_gguf(gguf)
    _forbid_loading(monkeypatch)
    status, line = _generate(["--gguf", str(gguf), "--global-sink", str(2**31 - 1), "--global-window", "1"])
    assert status == 2
    assert line == (
        "mstar-jax generate: error: --global-sink 2147483647 --global-window 1: the global layers' cache "
        "cannot keep them: retention(0) keeps sink=2147483647 + window=1 = 2147483648 entries; the sum "
        "must be <= 2147483647 (positions are int32)"
    )


# -- the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """The tiny engine of tests/engine with its two voices (index 0, 4 frames; 1, 6) and one queued request
    ("live", voice 0); every case shares it, since every case must leave it as it was."""
    model = StreamingTTSModel(CONFIG)
    talker, flow = managers()
    buckets = tts_buckets(batch_sizes=BATCH_SIZES, token_counts=TOKEN_COUNTS, flow_chunk=CONFIG.flow_chunk)
    programs = (
        model,
        TTSPrograms.capture(model, buckets, talker=talker, flow=flow, progress=False, max_workers=2),
    )
    engine, voices = make_engine(programs)
    engine.submit(request("live", voices[0], 4))
    return programs, engine, voices


def _engine_state(engine: Engine) -> tuple:
    host = (
        {rid: (s.phase, s.paused, s.request, s.hold_until) for rid, s in engine.streams.items()},
        sorted(engine.finished), engine.stats, dict(engine.voices.voices),
        engine.compilations, len(engine.records), engine.steps_run,
        _manager_state(engine.talker)[0], _manager_state(engine.flow)[0],
    )  # fmt: skip
    return host, _manager_state(engine.talker)[1] + _manager_state(engine.flow)[1]


def _new_engine(programs, **changes) -> Engine:
    model, captured = programs
    talker, flow = managers()
    kwargs = {"talker": talker, "flow": flow, "programs": captured, **changes}
    return Engine(kwargs.pop("model", model), **engine_kwargs(**kwargs))


V0 = Voice(0, 4)

# call(programs, engine) and what it raises: (call, error, pattern).
ENGINE_CASES = [
    _case(
        "submit-a-str", lambda p, e: e.submit("say hello"), TypeError,
        r"request='say hello' must be a TTSRequest",
    ),
    _case(
        "submit-on_output-int", lambda p, e: e.submit(request("cb", V0, 4), on_output=3), TypeError,
        r"on_output=3 must be callable or None",
    ),
    _case(
        "submit-live-id", lambda p, e: e.submit(request("live", V0, 4)), ValueError,
        r"request_id='live' is already live or reserved; use a unique id",
    ),
    _case(
        "submit-reserved-id", lambda p, e: e.submit(request(batch.PAD + "x", V0, 4)), ValueError,
        r"request_id='\\x00padx' is already live or reserved; use a unique id",
    ),
    _case(
        "submit-negative-token", lambda p, e: e.submit(TTSRequest("neg", [-1, 2], V0, 4)), ValueError,
        r"request 'neg': text tokens \[-1\] are outside \[0, text_vocab_size=16\)",
    ),
    _case(
        "submit-frames-past-int32", lambda p, e: e.submit(TTSRequest("big", [1, 2], V0, 2**31)), ValueError,
        r"request 'big': frames=2147483648 must be an int in \[1, 2147483647\]",
    ),
    _case(
        "submit-voice-wrong-frames", lambda p, e: e.submit(request("w", Voice(1, 4), 4)), ValueError,
        r"request 'w': voice=Voice\(index=1, frames=4\) is not registered; registered \(index, frames\): "
        r"\[\(0, 4\), \(1, 6\)\]",
    ),
    _case(
        "pause-unknown", lambda p, e: e.pause("nobody"), UnknownRequestError,
        r"request_id='nobody' is not a live request; live: \['live'\]",
    ),
    _case(
        "resume-unknown", lambda p, e: e.resume("nobody"), UnknownRequestError,
        r"request_id='nobody' is not a live request; live: \['live'\]",
    ),
    _case(
        "offload-unknown", lambda p, e: e.offload("nobody"), UnknownRequestError,
        r"request_id='nobody' is not a live request; live: \['live'\]",
    ),
    _case(
        "cancel-unknown", lambda p, e: e.cancel("nobody"), UnknownRequestError,
        r"request_id='nobody' is not a live request; live: \['live'\]",
    ),
    _case(
        "add_voice-index-past-bank", lambda p, e: e.add_voice(8, frames=4, seed=0), ValueError,
        r"voice index=8 must be an int in \[0, 8\)",
    ),
    _case(
        "add_voice-frames-too-many", lambda p, e: e.add_voice(2, frames=7, seed=0), ValueError,
        r"voice frames=7 must be in \[min_voice_frames=3, max_voice_frames=6\], an int",
    ),
    _case(
        "add_voice-frames-float", lambda p, e: e.add_voice(2, frames=4.5, seed=0), ValueError,
        r"voice frames=4\.5 must be in \[min_voice_frames=3, max_voice_frames=6\], an int",
    ),
    _case(
        "add_voice-seed-negative", lambda p, e: e.add_voice(2, frames=4, seed=-1), ValueError,
        r"voice seed=-1 must be an int >= 0",
    ),
    _case(
        "add_voice-in-use", lambda p, e: e.add_voice(0, frames=5, seed=3), ValueError,
        r"voice 0 is named by live request\(s\) \['live'\]; replace it once they finish",
    ),
    _case(
        "engine-max_batch-past-bucket", lambda p, e: _new_engine(p, max_batch=3), ValueError,
        r"max_batch=3 must be an int in \[1, 2\] \(the largest bucket\)",
    ),
    _case(
        "engine-max_batch-bool", lambda p, e: _new_engine(p, max_batch=True), ValueError,
        r"max_batch=True must be an int >= 1",
    ),
    _case(
        "engine-snapshot_every=0", lambda p, e: _new_engine(p, snapshot_every=0), ValueError,
        r"snapshot_every=0 must be an int >= 1",
    ),
    _case(
        "engine-settings-dict", lambda p, e: _new_engine(p, settings={"max_batch": 2}), TypeError,
        r"settings=\{'max_batch': 2\} must be an EngineSettings \(mstar_jax\.settings\)",
    ),
    _case(
        "engine-hold_backoff_s-nan", lambda p, e: _new_engine(p, hold_backoff_s=float("nan")), ValueError,
        r"hold_backoff_s=nan must be a finite number in \[0\.0, 3600\.0\]",
    ),
    _case(
        "engine-pipelined-int", lambda p, e: _new_engine(p, pipelined=1), ValueError,
        r"pipelined=1 must be a bool",
    ),
    _case(
        "engine-history-0", lambda p, e: _new_engine(p, history=0), ValueError,
        r"history=0 must be None or an int >= 1",
    ),
    _case(
        "engine-hold_backoff_s-negative", lambda p, e: _new_engine(p, hold_backoff_s=-1.0), ValueError,
        r"hold_backoff_s=-1\.0 must be .*",
    ),
    _case(
        "engine-offload_idle_after_s-negative", lambda p, e: _new_engine(p, offload_idle_after_s=-1.0),
        ValueError, r"offload_idle_after_s=-1\.0 must be .*",
    ),
    _case(
        "engine-clock-str", lambda p, e: _new_engine(p, clock="now"), TypeError,
        r"clock='now' must be callable.*",
    ),
    _case(
        "engine-talker-None", lambda p, e: _new_engine(p, talker=None), TypeError,
        r"talker=None must be a BoundedKVManager.*",
    ),
    _case(
        "request-empty-id", lambda p, e: TTSRequest("", [1], V0, 4), ValueError,
        r"request_id='' must be a non-empty str",
    ),
    _case(
        "request-no-text", lambda p, e: TTSRequest("r", [], V0, 4), ValueError,
        r"request 'r': text is empty; it needs at least one token",
    ),
    _case(
        "request-seed-2**32", lambda p, e: TTSRequest("r", [1], V0, 4, 2**32), ValueError,
        r"request 'r': seed=4294967296 must be an int in \[0, 2\*\*32\)",
    ),
    _case(
        "request-voice-tuple", lambda p, e: TTSRequest("r", [1], (0, 4), 4), TypeError,
        r"request 'r': voice=\(0, 4\) must be a Voice \(VoiceBank\.add\)",
    ),
    _case(
        "request-text-2d", lambda p, e: TTSRequest("r", [[1, 2], [3, 4]], V0, 4), ValueError,
        r"request 'r': text=.* must be .*",
    ),
    _case(
        "voice-negative-index", lambda p, e: Voice(-1, 4), ValueError, r"Voice index=-1 must be an int >= 0",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "pattern"), ENGINE_CASES)
def test_a_bad_engine_call_is_refused_and_changes_nothing(served, call, error, pattern):
    programs, engine, _ = served
    before = _engine_state(engine)
    with pytest.raises(error) as info:
        call(programs, engine)
    assert type(info.value) is error
    assert re.fullmatch(pattern, str(info.value)), str(info.value)
    _assert_same_state(before, _engine_state(engine))
    assert engine.talker.free_slots == engine.flow.free_slots == CONFIG.max_slots  # "live" was never admitted


def test_a_request_before_the_host_started_is_refused_as_not_retryable(served):
    from mstar_jax.server.errors import HostNotStartedError, ServerShuttingDownError
    from mstar_jax.server.host import EngineHost  # imports no FastAPI

    programs, _, _ = served
    engine = _new_engine(programs)
    host = EngineHost(engine)
    with pytest.raises(HostNotStartedError) as info:
        host.submit(request("early", V0, 4))  # no event loop either: refused before one is looked for
    assert str(info.value) == (
        "EngineHost.submit() was called before EngineHost.start(): call start() first (an app from "
        "create_app starts its host when it starts up)"
    )
    assert isinstance(info.value, RuntimeError)
    assert not isinstance(info.value, ServerShuttingDownError)
    assert info.value.retryable is False
    assert (host.alive, host.waiting, host.live) == (False, 0, 0)
    assert engine.idle
    assert engine.talker.free_slots == CONFIG.max_slots


def test_the_table_covers_every_layer():
    counts = {
        "yaml": len(PARSE_CASES) + len(LOAD_CASES),
        "cli": len(CLI_CASES),
        "config": len(CONFIG_CASES),
        "manager": len(MANAGER_CASES),
        "engine": len(ENGINE_CASES),
    }
    assert min(counts.values()) >= 10, counts
    assert sum(counts.values()) >= 60, counts
