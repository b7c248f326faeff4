"""benchmarks/kernel.py's own flags: bad values are refused before any work, naming the flag."""

from __future__ import annotations

import pytest

from benchmarks import kernel


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--calls", "0"], "--calls 0 must be >= 1"),
        (["--calls", "-3"], "--calls -3 must be >= 1"),
        (["--calls", "nan"], "argument --calls: invalid int value: 'nan'"),
        (["--calls", "2.5"], "argument --calls: invalid int value: '2.5'"),
    ],
)
def test_bad_calls_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        kernel._parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_sweep_is_refused_without_a_gpu():
    with pytest.raises(
        SystemExit, match="--sweep times compiled Triton kernels: it needs a GPU backend, not cpu"
    ):
        kernel.main(["--sweep", "--quick"])


def test_the_sweep_tries_each_split_on_the_default_tiles():
    blocks = kernel.sweep_blocks(query_rows=4, head_dim=128, max_retained=1024, kv_heads=1)
    assert len(blocks) == 4 * 2 * 3 + 4
    assert [b.split_keys for b in blocks[-4:]] == [None, 64, 256, 512]
    assert all(b.split_keys is None or b.split_keys % b.block_k == 0 for b in blocks)


def test_the_float32_sweep_tries_fma_tiles_and_each_split():
    # Gemma 3's decode geometry in float32: key blocks 16-64 × 4-16 warps × 1-2 stages at the default
    # split (128 keys), then the default tiles with each other split.
    blocks = kernel.sweep_blocks(query_rows=4, head_dim=256, max_retained=512, kv_heads=1, itemsize=4)
    tiles = {(b.block_k, b.num_warps, b.num_stages) for b in blocks[:-4]}
    assert tiles == {(k, w, s) for k in (16, 32, 64) for w in (4, 8, 16) for s in (1, 2)}
    assert {b.split_keys for b in blocks[:-4]} == {128}
    assert [b.split_keys for b in blocks[-4:]] == [None, 64, 256, 512]
    assert {(b.block_k, b.num_warps, b.num_stages) for b in blocks[-4:]} == {(32, 8, 1)}
