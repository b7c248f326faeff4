"""`mstar-jax check` and `run`: the tables show the config's real numbers; a bad config, one that does
not fit the device, or a bad option exits 2 with a one-line message before anything is built."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mstar_jax import check_table, cli
from mstar_jax.cli import SUBCOMMANDS, Subcommand, format_bytes, main
from mstar_jax.deployment import DEFAULT_CONFIG, load_deployment
from mstar_jax.memory import host_memory
from mstar_jax.models.streaming_tts import config as tts_config
from mstar_jax.models.streaming_tts.memory import weight_bytes, workspace_bytes
from mstar_jax.resources.kv.bounded.config import store_capacity

TPU_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tpu_streaming_tts.yaml"


def _row(output: str, label: str) -> list[str]:
    """The cells of the table row labelled `label` (cells are separated by two or more spaces)."""
    for line in output.splitlines():
        if line.startswith(label + "  "):
            return re.split(r"\s{2,}", line[len(label) :].strip())
    raise AssertionError(f"no row {label!r} in:\n{output}")


@pytest.mark.parametrize("path", [str(DEFAULT_CONFIG), str(TPU_CONFIG)], ids=["default", "tpu"])
def test_check_prints_every_resource_with_the_configs_numbers(path, capsys):
    assert main(["check", path, "--device-memory", "95GiB"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    deployment = load_deployment(path)
    configs = [spec.config for spec in deployment.specs]
    assert out.startswith(f"deployment  {path}\n")
    assert _row(out, "resource") == ["talker_kv", "flow_kv"]
    assert _row(out, "nodes") == ["talker", "flow"]
    assert _row(out, "layers") == [f"{c.num_layers:,}" for c in configs]
    assert _row(out, "kv heads x head dim") == [f"{c.num_heads} x {c.head_dim}" for c in configs]
    assert _row(out, "rows per request") == ["1", "2"]
    assert _row(out, "dtype") == [deployment.model_config.dtype] * 2
    model = deployment.model_config
    voices = f"{model.min_voice_frames:,}..{model.max_voice_frames:,}"
    assert _row(out, "source length") == [voices, voices]
    for label, attribute in [
        ("sink capacity", "sink_capacity"),
        ("window capacity", "window_capacity"),
        ("slot tokens", "slot_tokens"),
        ("max retained", "max_retained"),
        ("max slots", "max_slots"),
    ]:
        assert _row(out, label) == [f"{getattr(c, attribute):,}" for c in configs], label
    per_slot = _row(out, "bytes per slot")
    all_slots = _row(out, "bytes for all slots")
    for config, slot_cell, all_cell in zip(configs, per_slot, all_slots, strict=True):
        assert slot_cell.endswith(f"({config.slot_bytes:,} B)")
        assert all_cell.endswith(f"({config.slot_bytes * config.max_slots:,} B)")
    total = sum(c.slot_bytes * c.max_slots for c in configs)
    assert _row(out, "total bytes for all slots") == [f"{format_bytes(total)} ({total:,} B)"]
    per_request = sum(c.slot_bytes for c in configs)
    assert _row(out, "total bytes per request (a slot in each)") == [
        f"{format_bytes(per_request)} ({per_request:,} B)"
    ]
    voices = deployment.workload.voices
    # A voice's source bank entry: layers x max voice frames (in tiles of 8) x rows x heads x (K,V) x dim
    # x itemsize.
    bank = sum(
        c.num_layers
        * store_capacity(c.max_source_len, c.head_dim)
        * c.rows_per_request
        * c.num_heads
        * 2
        * c.head_dim
        * c.dtype.itemsize
        for c in configs
    )
    assert _row(out, f"total bytes for {voices} voices (source bank)") == [
        f"{format_bytes(bank * voices)} ({bank * voices:,} B)"
    ]


def test_check_of_the_default_config_by_hand(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"deployment  {DEFAULT_CONFIG}\n")
    # talker: voice 8..24, sink = voice + 4, window 32; flow: sink = voice, window 16.
    assert _row(out, "retention at min source") == ["sink 12 + window 32", "sink 8 + window 16"]
    assert _row(out, "retention at max source") == ["sink 28 + window 32", "sink 24 + window 16"]
    # 2 layers x 36 tokens (in tiles of 8: 40) x 1 row x 2 heads x (K,V) x 16 x 4 B;
    # 2 x 16 x 2 rows x 4 heads x 2 x 16 x 4 B.
    assert _row(out, "bytes per slot") == ["20.0 KiB (20,480 B)", "32.0 KiB (32,768 B)"]
    assert _row(out, "total bytes per request (a slot in each)") == ["52.0 KiB (53,248 B)"]
    assert _row(out, "compile") == ["batch sizes [1, 2, 4], token counts [1, 8, 16], persistent cache off"]


def test_check_of_the_tpu_config_shows_human_units(capsys):
    assert main(["check", str(TPU_CONFIG), "--device-memory", "95GiB"]) == 0
    out = capsys.readouterr().out
    # 28 layers x 3004 tokens (in tiles of 8: 3008) x 8 KV heads x (K,V) x 128 x 2 B = 344,981,504 B;
    # 64 slots of it.
    assert _row(out, "bytes per slot")[0] == "329.0 MiB (344,981,504 B)"
    assert _row(out, "bytes for all slots")[0] == "20.6 GiB (22,078,816,256 B)"


def test_bad_config_exits_2_with_the_message_and_no_traceback(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name: streaming_tts\nengine:\n  max_batchh: 4\n")
    assert main(["check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"mstar-jax check: error: {path}: unknown key 'max_batchh' in 'engine'; "
        "allowed: ['max_batch', 'hold_backoff_s', 'offload_idle_after_s', 'snapshot_every', 'pipelined', "
        "'decode_steps']\n"
    )


def test_resource_type_error_and_missing_file_exit_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: streaming_tts}\nresources: {talker_kv: {window: 8}}\n")
    assert main(["check", str(path)]) == 2
    assert "resource 'talker_kv' got unknown YAML key(s) ['window']" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err.endswith("nope.yaml: no such file\n")


def test_command_line_entry_point_exits_2_without_a_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: streaming_tts, config: {dtype: float16}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "mstar_jax.cli", "check", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "dtype='float16' must be one of ['bfloat16', 'float32']" in result.stderr


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["check", "a.yaml", "b.yaml"])
    assert info.value.code == 2


def test_a_new_subcommand_plugs_in_through_the_dict(monkeypatch, capsys):
    def add_arguments(parser):
        parser.add_argument("--streams", type=int, default=1)

    def run(args):
        print(f"ran {args.streams}")
        return 0

    monkeypatch.setitem(SUBCOMMANDS, "run", Subcommand(help="run it", add_arguments=add_arguments, run=run))
    assert cli.main(["run", "--streams", "3"]) == 0
    assert capsys.readouterr().out == "ran 3\n"


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (3 * 2**19, "1.5 MiB"),
        (3 * 2**30, "3.0 GiB"),
        (2**50, "1.0 PiB"),
        (2**60, "1024.0 PiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# -- the device-memory budget -----------------------------------------------------------------------


def _budget_rows(output: str) -> dict[str, str]:
    """The budget table's rows, label -> bytes cell."""
    lines = output.split("device memory budget\n", 1)[1].splitlines()
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines)


def test_check_prints_the_device_memory_budget_by_hand(capsys):
    assert main(["check", "--device-memory", "1GiB"]) == 0
    rows = _budget_rows(capsys.readouterr().out)
    deployment = load_deployment()
    workspace = workspace_bytes(
        deployment.model_config,
        deployment.spec("talker_kv").config,
        deployment.spec("flow_kv").config,
        4,
        16,
        8,
    )
    assert rows == {
        # 277,328 parameters x 4 B (tests/test_memory.py counts them by hand).
        "model weights (277,328 x float32)": "1.1 MiB (1,109,312 B)",
        # (4 slots + the padding slot) x 20,480 B and x 32,768 B.
        "talker_kv slots (4 + 1 padding)": "100.0 KiB (102,400 B)",
        "flow_kv slots (4 + 1 padding)": "160.0 KiB (163,840 B)",
        # 3 voices, but the engine allocates at least 8 sources: 8 x 12,288 B and 8 x 49,152 B.
        "talker_kv source bank (8 sources)": "96.0 KiB (98,304 B)",
        "flow_kv source bank (8 sources)": "384.0 KiB (393,216 B)",
        # 4 rows x 16 tokens, the largest bucket.
        "workspace (largest bucket: 4 x 16 tokens)": f"{format_bytes(workspace)} ({workspace:,} B)",
        "total": check_table._bytes_cell(1_867_072 + workspace),
        "device memory (--device-memory)": "1.0 GiB (1,073,741,824 B)",
        "headroom (fits)": check_table._bytes_cell(2**30 - 1_867_072 - workspace),
    }
    assert weight_bytes(deployment.model_config) + 102_400 + 163_840 + 98_304 + 393_216 == 1_867_072


def test_check_budgets_for_this_hosts_ram_by_default(capsys):
    assert main(["check"]) == 0
    rows = _budget_rows(capsys.readouterr().out)
    assert rows["device memory (host RAM)"] == check_table._bytes_cell(host_memory())


def _write(tmp_path: Path, mapping: dict, name: str = "deploy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(mapping))
    return path


def _tpu(**config) -> dict:
    mapping = yaml.safe_load(TPU_CONFIG.read_text())
    mapping["model"]["config"].update(config)
    return mapping


def _forbid_building(monkeypatch):
    """Make `run` fail loudly if it gets as far as building the engine."""
    from mstar_jax.models.streaming_tts import run as run_module

    def run_deployment(*args, **kwargs):
        raise AssertionError("run_deployment was called")

    monkeypatch.setattr(run_module, "run_deployment", run_deployment)


# Sizes that cannot run anywhere; each passed `check` and crashed `run` with a traceback before.
IMPOSSIBLE = {
    # 140,000,000-entry talker window: 28 layers x 140,000,008 entries x 8 heads x (K,V) x 128 x 2 B
    # = 14.6 TiB per slot.
    "15-TiB-slots": (_tpu(talker_window=140_000_000), "one slot is 14.6 TiB (140,000,004 tokens)"),
    # 5,000,000 talker slots of 329 MiB: 1.6 PiB.
    "1.6-PiB-of-slots": (
        {**_tpu(), "resources": {"talker_kv": {"max_slots": 5_000_000}, "flow_kv": {"max_slots": 64}}},
        "talker_kv slots (5,000,000 + 1 padding) 1.5 PiB",
    ),
    # A talker of 400 layers of d_model 65,536 and ffn 262,144: its SwiGLUs alone are 400 x 3 x 65,536 x
    # 262,144 = 20.6 T parameters; 20.8 T in all, x 2 B.
    "36-TiB-model": (
        _tpu(d_model=65_536, talker_ffn_dim=262_144, talker_layers=400),
        "the largest part is model weights (20,787,234,236,880 x bfloat16) (37.8 TiB): a smaller model",
    ),
}


@pytest.mark.parametrize("name", list(IMPOSSIBLE))
def test_sizes_that_do_not_fit_are_refused_by_check_and_run_with_the_numbers(
    name, tmp_path, monkeypatch, capsys
):
    mapping, fragment = IMPOSSIBLE[name]
    path = _write(tmp_path, mapping)
    assert main(["check", str(path), "--device-memory", "95GiB"]) == 2
    out, err = capsys.readouterr()
    assert "over by (does NOT fit)" in _budget_rows(out)  # the table is printed, then refused
    assert err.count("\n") == 1  # one line
    assert err.startswith(f"mstar-jax check: error: {path}: the deployment needs model weights (")
    assert "more than the device memory 95.0 GiB (--device-memory)" in err
    assert fragment in err
    _forbid_building(monkeypatch)
    output = tmp_path / "out"
    assert main(["run", "--config", str(path), "--output", str(output), "--device-memory", "95GiB"]) == 2
    out, run_err = capsys.readouterr()
    assert out == ""
    assert run_err == err.replace("mstar-jax check:", "mstar-jax run:", 1)
    assert not output.exists()


def test_too_many_slots_are_refused_with_the_slots_that_fit(tmp_path, capsys):
    path = _write(tmp_path, IMPOSSIBLE["1.6-PiB-of-slots"][0])
    assert main(["check", str(path), "--device-memory", "95GiB"]) == 2
    err = capsys.readouterr().err
    fitting = int(re.search(r"lower resources\.talker_kv\.max_slots to (\d+)$", err.strip())[1])
    # Only talker_kv is lowered: flow_kv's 64 slots are fewer. max_batch stays at 64 <= the slots that fit.
    assert "flow_kv.max_slots to" not in err
    assert "engine.max_batch" not in err
    mapping = IMPOSSIBLE["1.6-PiB-of-slots"][0]
    mapping = {**mapping, "resources": {"talker_kv": {"max_slots": fitting}, "flow_kv": {"max_slots": 64}}}
    assert main(["check", str(_write(tmp_path, mapping, "fixed.yaml")), "--device-memory", "95GiB"]) == 0
    mapping["resources"]["talker_kv"]["max_slots"] = fitting + 1
    assert main(["check", str(_write(tmp_path, mapping, "over.yaml")), "--device-memory", "95GiB"]) == 2


def test_a_huge_voice_range_is_refused_without_tabulating_it(tmp_path, monkeypatch, capsys):
    calls = []
    retention = tts_config._voice_sink_retention

    def counted(source_len, **kwargs):
        calls.append(source_len)
        return retention(source_len, **kwargs)

    monkeypatch.setattr(tts_config, "_voice_sink_retention", counted)
    mapping = yaml.safe_load(DEFAULT_CONFIG.read_text())
    mapping["model"]["config"]["max_voice_frames"] = 100_000_000
    path = _write(tmp_path, mapping)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert calls == []  # refused before the retention is evaluated at any length
    assert err == (
        f"mstar-jax check: error: {path}: model.config: max_source_len=100000000 and min_source_len=8 span "
        "99,999,993 source lengths, but a callable retention is tabulated at each and at most "
        "MAX_TABULATED_SOURCE_LENGTHS=65,536 are allowed; narrow the source range, or give one SinkWindow "
        "for every length (it needs no table)\n"
    )


def test_long_voices_are_refused_by_the_budget_naming_the_source_bank(tmp_path, monkeypatch, capsys):
    calls = []
    retention = tts_config._voice_sink_retention
    monkeypatch.setattr(
        tts_config, "_voice_sink_retention", lambda s, **kw: calls.append(s) or retention(s, **kw)
    )
    mapping = yaml.safe_load(DEFAULT_CONFIG.read_text())
    mapping["model"]["config"]["max_voice_frames"] = 20_000
    path = _write(tmp_path, mapping)
    assert main(["check", str(path), "--device-memory", "256MiB"]) == 2
    err = capsys.readouterr().err
    # Each config is tabulated once per build, 19,993 lengths: talker and flow, built by the model's
    # resource_specs and again by each resource's max_slots.
    assert len(calls) == 4 * 19_993
    # Talker source: 2 layers x 20,096 entries (in tiles of 128) x 1 row x 2 heads x (K,V) x 16 x 4 B;
    # flow: x 2 rows x 4 heads. 8 sources each.
    assert "talker_kv source bank (8 sources) 78.5 MiB + flow_kv source bank (8 sources) 314.0 MiB" in err
    assert "more than the device memory 256.0 MiB (--device-memory)" in err
    assert err.strip().endswith(
        "the largest part is flow_kv source bank (8 sources) (314.0 MiB): each source holds "
        "max_source_len=20,000 entries: lower model.config.max_voice_frames"
    )


@pytest.mark.parametrize("size", ["16G", "lots", "0"])
def test_a_bad_device_memory_size_is_a_usage_error(size, capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", "--device-memory", size])
    assert info.value.code == 2
    assert f"size={size!r} must be" in capsys.readouterr().err


def test_a_multi_line_error_is_printed_on_one_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("model: {name: streaming_tts\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"mstar-jax check: error: {path}: invalid YAML: while parsing a flow mapping in ")


# -- run --output -----------------------------------------------------------------------------------


def test_run_refuses_an_output_that_is_a_file_before_running(tmp_path, monkeypatch, capsys):
    _forbid_building(monkeypatch)
    file = tmp_path / "results.txt"
    file.write_text("keep me\n")
    allowed = "it must be a directory (existing or not yet) that can be written"
    assert main(["run", "--output", str(file)]) == 2
    assert capsys.readouterr().err == (
        f"mstar-jax run: error: --output={str(file)!r} is an existing file, not a directory; {allowed}\n"
    )
    assert main(["run", "--output", str(file / "sub")]) == 2
    assert capsys.readouterr().err == (
        f"mstar-jax run: error: --output={str(file / 'sub')!r} is under {str(file)!r}, a file; {allowed}\n"
    )
    assert file.read_text() == "keep me\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any directory")
def test_run_refuses_an_unwritable_output_before_running(tmp_path, monkeypatch, capsys):
    _forbid_building(monkeypatch)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(["run", "--output", str(locked / "runs")]) == 2
    assert f"{str(locked)!r} is not writable" in capsys.readouterr().err


# -- output to a closed pipe ------------------------------------------------------------------------


def test_check_into_a_closed_pipe_exits_quietly():
    # `head -1` may read the whole report before it exits, so close the reading end before any output:
    # the broken pipe then happens every time.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mstar_jax.cli", "check"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err.decode()
    assert "BrokenPipeError" not in err.decode()
    assert proc.returncode == 1
    result = subprocess.run(
        f"{sys.executable} -m mstar_jax.cli check | head -1",
        shell=True,
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert result.stdout == f"deployment  {DEFAULT_CONFIG}\n"
    assert "Traceback" not in result.stderr


def test_a_mesh_larger_than_this_host_is_refused_before_anything_runs(tmp_path, capsys):
    path = tmp_path / "mesh.yaml"
    synchronous = DEFAULT_CONFIG.read_text().replace(
        "pipelined: true", "pipelined: false"
    )  # a mesh's engine is
    path.write_text(synchronous + "\nmesh:\n  data: 2\n  model: 2\n")
    assert main(["check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"mstar-jax check: error: {path}: mesh: mesh data=2 x model=2 needs 4 devices; 1 cpu device(s) are "
        "present (on a CPU host, XLA_FLAGS=--xla_force_host_platform_device_count=4 simulates 4 devices)\n"
    )


# -- run in a multi-process job ---------------------------------------------------------------------


@pytest.fixture
def joined(monkeypatch):
    """What `run` would join (`distributed.initialize` recorded, not called), with no MSTAR_* set."""
    from mstar_jax import distributed

    for name in (
        "MSTAR_COORDINATOR_ADDRESS",
        "MSTAR_NUM_PROCESSES",
        "MSTAR_PROCESS_ID",
        "MSTAR_LOCAL_DEVICE_IDS",
    ):
        monkeypatch.delenv(name, raising=False)
    settings = []
    monkeypatch.setattr(distributed, "initialize", settings.append)
    _forbid_building(monkeypatch)
    return settings


def test_run_joins_the_job_its_flags_describe_overriding_the_environment(joined, monkeypatch, tmp_path):
    from mstar_jax.distributed import DistributedSettings

    flags = ["--coordinator-address", "10.0.0.1:1234", "--num-processes", "4", "--process-id", "3"]
    with pytest.raises(AssertionError, match="run_deployment was called"):  # joined, then built
        main(["run", "--output", str(tmp_path), *flags])
    monkeypatch.setenv("MSTAR_COORDINATOR_ADDRESS", "10.0.0.9:99")
    monkeypatch.setenv("MSTAR_NUM_PROCESSES", "4")
    monkeypatch.setenv("MSTAR_PROCESS_ID", "1")
    with pytest.raises(AssertionError, match="run_deployment was called"):
        main(["run", "--output", str(tmp_path), "--process-id", "2"])
    assert joined == [
        DistributedSettings(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3),
        DistributedSettings(coordinator_address="10.0.0.9:99", num_processes=4, process_id=2),
    ]
    for name in ("MSTAR_PROCESS_ID", "MSTAR_NUM_PROCESSES", "MSTAR_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name)
    with pytest.raises(AssertionError, match="run_deployment was called"):
        main(["run", "--output", str(tmp_path)])  # one process: nothing to join
    assert len(joined) == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-processes", "2"], r"missing 2 required keyword-only arguments: 'coordinator_address' and "
         r"'process_id': a multi-process run needs --coordinator-address, --num-processes and --process-id"),
        (["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"],
         r"process_id=2 must be < num_processes=2"),
        (["--coordinator-address", "nohost", "--num-processes", "2", "--process-id", "0"],
         r"coordinator_address='nohost' must be 'host:port'"),
    ],
)  # fmt: skip
def test_run_refuses_an_incomplete_or_bad_job_before_joining(joined, tmp_path, capsys, flags, message):
    assert main(["run", "--output", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(r"mstar-jax run: error: .*" + message, err), err
    assert joined == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dense", "--global-sink", "2"], "--global-sink 2 does not go with --dense"),
        (["--greedy-screen", "--dtype", "bfloat16"], "--greedy-screen needs --dtype float32, not bfloat16"),
        (
            ["--prompt-file", "/nonexistent/prompt.txt"],
            "--prompt-file '/nonexistent/prompt.txt' cannot be read",
        ),
    ],
)
def test_generate_refuses_bad_options_before_loading_the_model(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mstar-jax generate: error: ")
    assert message in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--dense", "--global-window", "8"], ["--max-new-tokens", "0"], ["--global-sink", "-1"],
        ["--greedy-screen=yes"],
    ],
)  # fmt: skip
def test_generate_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    assert "usage: mstar-jax generate" in capsys.readouterr().err


def test_generate_offers_and_takes_only_implementations_that_run(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--implementation", "pallas"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    # Python 3.12 quotes the choices, 3.13 does not.
    choices = r"\(choose from '?auto'?, '?xla'?\)"
    last = err.splitlines()[-1]
    assert re.fullmatch(
        r"mstar-jax generate: error: argument --implementation: invalid choice: 'pallas' " + choices, last
    ), last
    with pytest.raises(SystemExit):
        main(["generate", "-h"])
    assert "--implementation {auto,xla}" in capsys.readouterr().out


def test_generate_refuses_the_greedy_screen_without_a_compiler_before_loading(monkeypatch, tmp_path, capsys):
    from mstar_jax import native

    native._library.cache_clear()  # forget a build made by an earlier test: this one has no compiler
    monkeypatch.setenv("MSTAR_JAX_NATIVE_DIR", str(tmp_path / "native"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    try:
        assert main(["generate", "--greedy-screen"]) == 2
    finally:
        native._library.cache_clear()
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"mstar-jax generate: error: --greedy-screen cannot run here: no C++ compiler "
        f"'{tmp_path / 'no-such-compiler'}' on PATH (set $CXX)"
    )


@pytest.mark.gemma
def test_generate_names_a_gguf_file_it_cannot_read(capsys):
    assert main(["generate", "--gguf", "/nonexistent/model.gguf"]) == 2
    assert (
        "--gguf '/nonexistent/model.gguf' cannot be read: No such file or directory"
        in capsys.readouterr().err
    )


def test_generate_charges_each_step_the_time_no_step_before_it_took():
    """`generate`'s rates: a pipelined step, dispatched before the one before it was read, is charged only
    from that read-back on; a step after an idle gap from its own start."""
    from mstar_jax.engine.records import StepRecord
    from mstar_jax.models.gemma3.generate import charged_seconds

    def record(started: float, done: float) -> StepRecord:
        return StepRecord("walk", None, 1, started, done - started, (0,), 0)

    steps = [record(0.0, 1.0), record(0.5, 1.5), record(1.2, 3.0), record(5.0, 5.5)]
    assert charged_seconds(steps) == pytest.approx([1.0, 0.5, 1.5, 0.5])
    assert sum(charged_seconds(steps)) == pytest.approx(3.5)  # the time some step was running
