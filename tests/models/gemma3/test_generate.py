"""`mstar-jax generate` with the real Gemma 3 270M, through the engine: prompts wait for a slot, text streams
out as it comes.

The continuations are facts the model knows (counting, the days of the week), the same oracle
`test_real_model` uses; its agreement with llama.cpp is tested there.
"""

from __future__ import annotations

import io
import re

import pytest

from tests import extras

extras.skip_module_without("gemma")
pytestmark = pytest.mark.gemma

from mstar_jax import cli, native  # noqa: E402
from mstar_jax.memory import format_bytes  # noqa: E402
from mstar_jax.models.gemma3 import Gemma3Tokenizer, default_gguf_path, open_gguf, read_config  # noqa: E402
from mstar_jax.models.gemma3.generate import _Printer  # noqa: E402
from mstar_jax.models.gemma3.stream import cache_configs  # noqa: E402
from mstar_jax.resources.kv.bounded.config import SinkWindow  # noqa: E402


@pytest.fixture(scope="module")
def reader():
    return open_gguf(default_gguf_path())  # the CLI's own open reuses this parse


@pytest.mark.slow
def test_generate_streams_two_prompts_through_one_slot(reader, capsys):
    status = cli.main([
        "generate", "One, two, three, four,", "Monday, Tuesday, Wednesday,", "--max-new-tokens", "6",
        "--max-slots", "1", "--global-sink", "4", "--global-window", "60", "--chunk", "32",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0
    streamed = dict(re.findall(r"\[(\d)\] ([^\n\[]*)", out))
    assert set(streamed) == {"0", "1"}
    assert streamed["0"].split(",")[:2] == [" five", " six"]
    assert "Thursday" in streamed["1"]
    assert "2 stream(s), 1 at once; global cache SinkWindow(sink=4, window=60" in out
    assert "generated 12 tokens in" in out
    assert "(10, all streams)" in out  # tokens decoded: all but each stream's last
    assert "0 compiled while serving; 1 admissions waited for a slot" in out
    config = read_config(reader)
    local, global_ = cache_configs(config, global_retention=SinkWindow(4, 60))
    assert f"memory per stream: {format_bytes(local.slot_bytes + global_.slot_bytes)} of cache" in out


@pytest.mark.slow
def test_generate_with_the_greedy_screen_continues_the_days_of_the_week(capsys):
    if not native.available():
        pytest.skip("no C++ compiler to build mstar_jax.native")
    argv = ["generate", "Monday, Tuesday,", "--max-new-tokens", "6", "--global-window", "60", "--chunk", "16"]
    assert cli.main([*argv, "--greedy-screen"]) == 0
    text = capsys.readouterr().out.split("\n\n")[0]  # the streamed text, before the summary
    assert text.split(",")[:3] == [" Wednesday", " Thursday", " Friday"]


def test_printed_text_is_the_decoded_text_even_mid_character(reader):
    tokenizer = Gemma3Tokenizer.from_gguf(reader)
    texts = ["naïve café, 😀 ☃ 𝄞 and ünïcödé", "two lines:\nthe second one, 🎵 long enough " + "la " * 40]
    streams = [tokenizer.encode(text, add_bos=False) for text in texts]
    out = io.StringIO()
    printer = _Printer(tokenizer.decode, tagged=False, out=out)
    for token in streams[0]:
        printer(0, token)
    assert out.getvalue() == tokenizer.decode(streams[0]) == texts[0]
    # Several streams, interleaved: whole lines, each tagged; a stream's lines give back its text.
    out = io.StringIO()
    printer = _Printer(tokenizer.decode, tagged=True, out=out)
    for step in range(max(map(len, streams))):
        for index, ids in enumerate(streams):
            if step < len(ids):
                printer(index, ids[step])
    printer.finish()
    lines = out.getvalue().split("\n")
    assert lines[-1] == ""
    for index, text in enumerate(texts):
        mine = [line[len(f"[{index}] ") :] for line in lines[:-1] if line.startswith(f"[{index}] ")]
        assert max(map(len, mine)) < _Printer.LINE + 32  # a line waits for a newline or LINE characters
        assert "".join(mine) == text.replace("\n", "")
