"""`mstar-jax check`: the table shows the config's real numbers; a bad config exits 2 with the message."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mstar_jax import cli
from mstar_jax.cli import SUBCOMMANDS, Subcommand, format_bytes, main
from mstar_jax.deployment import DEFAULT_CONFIG, load_deployment
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
    assert main(["check", path]) == 0
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
    assert main(["check", str(TPU_CONFIG)]) == 0
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
        "allowed: ['max_batch', 'hold_backoff_s', 'offload_idle_after_s']\n"
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
