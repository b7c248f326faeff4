"""benchmarks/mesh.py runs on 8 simulated devices (rerunning itself with them) and prints every table whole.

Only the tables' structure and the figures counted from shapes are asserted, never a timing.
"""

import contextlib
import io
import re

import pytest

from benchmarks import mesh, mesh_engine

pytestmark = pytest.mark.slow

RATIO = r"\d+\.\d\d \(\d+\.\d\d–\d+\.\d\d\)"  # median (min–max)


def table(section: str) -> list[list[str]]:
    """The cells of the markdown table rows in `section`, header and separator left out."""
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


@pytest.fixture(scope="module")
def sections() -> dict[str, str]:
    """The quick run's output split at its `## ` headings, keyed by the heading's first word."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the relay of the child's output prints to sys.stdout
        mesh.main(["--quick", "--repeats", "2"])
    out = out.getvalue()
    parts = re.split(r"^## ", out, flags=re.M)[1:]
    return {part.split()[0].rstrip("."): part for part in parts}


def test_prints_four_sections_and_the_shared_cores_note(sections):
    assert list(sections) == ["1", "2", "3", "4", "Summary"]
    assert "share this host's" in sections["1"]
    assert "not scaling" in sections["1"]


def test_decode_table_has_every_mesh_and_the_one_device_baseline(sections):
    assert sections["1"].count("### Global batch") == 1  # --quick times the first batch only
    assert f"### Global batch {mesh.BATCHES[0]}" in sections["1"]
    rows = table(sections["1"])
    assert [row[0] for row in rows] == list(mesh.STEP_VARIANTS)
    batch = mesh.BATCHES[0]
    for row, shape in zip(rows, mesh.STEP_VARIANTS.values(), strict=True):
        data, model = shape or (1, 1)
        rows_per_device, heads = batch // data, mesh.KV_HEADS // model
        assert row[1] == f"{rows_per_device} x {heads}"
        # K and V of every retained float32 key (sink + window) per row and KV head: 256 KiB here.
        per_head = 2 * (mesh.SINK + mesh.WINDOW) * mesh.HEAD_DIM * 4
        assert row[2] == f"{rows_per_device * heads * per_head / 2**20:g} MiB"
        assert re.fullmatch(RATIO, row[5]), row
    assert rows[0][5] == "1.00 (1.00–1.00)"


def test_host_table_has_one_row_per_shard_count(sections):
    rows = table(sections["2"])
    assert [row[0] for row in rows] == ["1", "2", "4", "8"]
    assert rows[0][2] == "1.00 (1.00–1.00)"
    assert all(re.fullmatch(RATIO, row[2]) for row in rows)


def test_cache_bytes_measured_equal_counted_and_follow_the_shapes(sections):
    rows = table(sections["3"])
    kv, replicated = mesh.KV_HEADS, mesh.REPLICATED_KV_HEADS
    expected = [(d, m, kv) for d, m in mesh.MESHES] + [
        (d, m, replicated) for d, m in mesh.MESHES if m > replicated
    ]
    assert len(rows) == len(expected)
    slots = mesh.SLOTS
    for row, (data, model, heads) in zip(rows, expected, strict=True):
        stored = max(heads, model)
        assert row[:3] == [f"{data}x{model}", f"{heads} ({stored})", f"{slots // data} + 1"]
        assert row[3] == row[4]  # the addressable shards hold what the shapes count, on every device alike
        # A device holds its data shard's slots and padding slot, and stored / model of the heads.
        share = (slots // data + 1) * (stored // model) / ((slots + 1) * heads)
        assert row[5] == f"{share:.3f}"
        assert row[6] == f"{1 / (data * model):.3f}"


def test_engine_table_has_the_one_device_baseline_and_the_quick_mesh(sections):
    rows = table(sections["4"])
    data, model = mesh.ENGINE_MESHES[0]
    batch = mesh_engine.GLOBAL_BATCH
    assert [row[:2] for row in rows] == [["1 device", str(batch)], [f"{data}x{model}", str(batch // data)]]
    assert rows[0][3] == "1.00 (1.00–1.00)"
    assert re.fullmatch(RATIO, rows[1][3])
    assert f"{mesh_engine.REQUESTS} requests, {mesh_engine.frames()} frames" in sections["4"]


def test_summary_rows(sections):
    rows = table(sections["Summary"])
    assert len(rows) == 4  # one decode batch, host planning, cache bytes, the engine
    assert rows[0][0] == "`benchmarks/mesh.py`"
    assert len(rows[0][2].split(" / ")) == len(mesh.MESHES)
    assert rows[2][2] == " / ".join(table(sections["3"])[i][5] for i in range(len(mesh.MESHES)))
    assert rows[3][2] == table(sections["4"])[1][3]
