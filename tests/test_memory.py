"""The device-memory budget: each part equals what the engine allocates, the workspace bounds what XLA
reports, and a deployment that does not fit is refused with the numbers and the `max_slots` that fits."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest
import yaml

from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.deployment import DEFAULT_CONFIG, load_deployment, parse_deployment
from mstar_jax.memory import (
    DeviceMemory,
    DeviceMemoryError,
    device_memory,
    host_memory,
    memory_budget,
    num_sources,
    parse_size,
    serving_budget,
    tree_bytes,
)
from mstar_jax.models.streaming_tts import memory as tts_memory
from mstar_jax.models.streaming_tts import model as model_module
from mstar_jax.models.streaming_tts.config import StreamingTTSConfig
from mstar_jax.models.streaming_tts.memory import weight_bytes, weight_count, workspace_bytes
from mstar_jax.models.streaming_tts.model import StreamingTTSModel
from mstar_jax.resources.kv.bounded.cache import BoundedKVCache, BoundedKVPlan, SourceBank
from mstar_jax.resources.kv.bounded.config import BoundedKVConfig, BoundedKVSpec, SinkWindow
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.kv.bounded.sharding import stored_heads

GIB = 2**30
# Every dimension different, so a count that swaps two of them is caught.
ODD = StreamingTTSConfig(
    text_vocab_size=33, codec_vocab_size=17, d_model=24, talker_layers=3, talker_heads=6, talker_kv_heads=3,
    talker_head_dim=8, talker_ffn_dim=40, flow_d_model=20, flow_layers=3, flow_heads=5, flow_head_dim=4,
    mel_bins=7, dtype="bfloat16",
)  # fmt: skip


def _parts(budget) -> dict[str, int]:
    return {part.label: part.nbytes for part in budget.parts}


@pytest.mark.parametrize("config", [StreamingTTSConfig(), ODD], ids=["default", "odd"])
def test_weights_equal_the_models_parameters(config):
    model = StreamingTTSModel(config)
    leaves = jax.tree.leaves((model.talker_params, model.flow_params))
    assert weight_count(config) == sum(leaf.size for leaf in leaves)
    assert weight_bytes(config) == sum(leaf.nbytes for leaf in leaves)
    assert tts_memory.SAMPLES_PER_FRAME == model_module.SAMPLES_PER_FRAME


def test_default_weights_by_hand():
    # talker: embed (256 + 256 + 1) x 64 = 32,832; per block 2 x 64 (norms) + 64 x 64 (wq) + 2 x 64 x 32
    # (wk, wv) + 64 x 64 (wo) + 3 x 64 x 128 (gate, up, down) = 36,992, x 2 blocks = 73,984; norm 64;
    # head 64 x 256 = 16,384. Total 123,264.
    # flow: code embed 257 x 64 = 16,448; mel_in 17 x 64 = 1,088; time_in, index_in 2 x 33 x 64 = 4,224;
    # per block 2 x 64 + 4 x 64 x 64 + 2 x 4 x 64 x 64 = 49,280, x 2 = 98,560; norm 64; mel_out 65 x 16
    # = 1,040; vocoder 17 x 1920 = 32,640. Total 154,064.
    assert weight_count(StreamingTTSConfig()) == 123_264 + 154_064 == 277_328
    assert weight_bytes(StreamingTTSConfig()) == 277_328 * 4


def test_slots_and_source_banks_equal_what_the_caches_allocate():
    deployment = load_deployment()
    parts = _parts(memory_budget(deployment, DeviceMemory(nbytes=GIB, source="test")))
    sources = num_sources(deployment)
    assert sources == 8  # 3 voices, at least 8 entries
    for spec in deployment.specs:
        cache = BoundedKVCache.create(spec.config)  # max_slots + 1 (the padding slot)
        bank = SourceBank.create(spec.config, sources)
        bank_bytes = sum(x.nbytes for x in (*bank.k, *bank.v))
        assert cache.k[0].shape[0] == spec.config.max_slots + 1
        assert parts[f"{spec.resource_key} slots (4 + 1 padding)"] == cache.nbytes
        assert parts[f"{spec.resource_key} source bank (8 sources)"] == bank_bytes
    # talker: 5 slots x 20,480 B; flow: 5 x 32,768 B.
    assert parts["talker_kv slots (4 + 1 padding)"] == 102_400
    assert parts["flow_kv slots (4 + 1 padding)"] == 163_840


def test_on_a_mesh_each_cache_part_is_one_devices_share():
    """Data shards split the slots (each with its padding slot), model shards the KV heads, where a head
    replicated over several shards costs a whole head on each."""
    mapping = yaml.safe_load(DEFAULT_CONFIG.read_text())
    mapping["mesh"] = {"data": 2, "model": 4}
    mapping["engine"]["pipelined"] = False  # a mesh's engine runs synchronously
    deployment = parse_deployment(mapping)
    parts = _parts(memory_budget(deployment, DeviceMemory(nbytes=GIB, source="test")))
    for spec in deployment.specs:
        kv, devices = spec.config, 8
        stored = stored_heads(kv.num_heads, 4)
        cache = BoundedKVCache.abstract(kv, data_shards=2)  # [2 x (2 + 1), R, G, C, D] per layer
        whole = sum(x.size * x.dtype.itemsize for x in (*cache.k, *cache.v)) * stored // kv.num_heads
        label = (
            f"{spec.resource_key} slots per device (2 + 1 padding of 2 pools, 1 of {kv.num_heads} KV heads)"
        )
        assert parts[label] == whole // devices
        bank = SourceBank.abstract(kv, num_sources(deployment))
        bank_bytes = sum(x.size * x.dtype.itemsize for x in (*bank.k, *bank.v))
        label = f"{spec.resource_key} source bank (8 sources, 1 of {kv.num_heads} KV heads per device)"
        assert parts[label] == bank_bytes // kv.num_heads  # one head each, on every data shard
    # talker: 2 heads copied to 4 shards, so each device holds a whole head: 3 slots x 20,480 / 2 B.
    assert parts["talker_kv slots per device (2 + 1 padding of 2 pools, 1 of 2 KV heads)"] == 30_720


def test_num_sources_is_what_the_engine_gives_each_bank(monkeypatch):
    from mstar_jax.models.streaming_tts import build
    from mstar_jax.models.streaming_tts.serving import Engine

    seen = []

    class StopError(Exception):
        """Raised by the fake manager: the engine is not built any further."""

    def manager(spec, *, num_sources, **shards):
        seen.append(num_sources)
        raise StopError

    monkeypatch.setattr(build, "BoundedKVManager", manager)
    for voices in (3, 8, 13):
        deployment = parse_deployment({"model": {"name": "streaming_tts"}, "workload": {"voices": voices}})
        with pytest.raises(StopError):
            Engine.from_deployment(deployment, progress=False)
        assert seen.pop() == num_sources(deployment) == max(8, voices)


def _compiled_temp_bytes(deployment) -> dict[str, int]:
    """XLA's temporary bytes of the largest prefill and flow programs (a combined step holds fewer rows)."""
    config = deployment.model_config
    talker_kv, flow_kv = deployment.spec("talker_kv").config, deployment.spec("flow_kv").config
    model = StreamingTTSModel(config, talker_kv=talker_kv, flow_kv=flow_kv)
    n = num_sources(deployment)
    s = jax.ShapeDtypeStruct
    abstract = lambda tree: jax.tree.map(lambda x: s(x.shape, x.dtype), tree)  # noqa: E731
    talker = (
        abstract(model.talker_params),
        BoundedKVCache.abstract(talker_kv),
        SourceBank.abstract(talker_kv, n),
    )
    flow = (abstract(model.flow_params), BoundedKVCache.abstract(flow_kv), SourceBank.abstract(flow_kv, n))
    plan = lambda rows: BoundedKVPlan(s((rows, tbl.ROW_INTS), jnp.int32))  # noqa: E731
    i32, u32 = jnp.int32, jnp.uint32
    b, t, tf = deployment.engine.max_batch, max(deployment.token_counts), tts_memory._flow_tokens(deployment)
    programs = {
        "prefill": (model.talker_step, (*talker, plan(b), s((b, t), i32), s((b,), i32), s((b,), u32))),
        "flow": (model.flow_step, (*flow, plan(b), s((b, tf), i32), s((b,), u32))),
    }
    # The bf16 model relies on standard promotion (f32 softmax statistics meet bf16 values).
    with jax.numpy_dtype_promotion("standard"):
        return {
            name: jax.jit(fn, donate_argnums=1).lower(*args).compile().memory_analysis().temp_size_in_bytes
            for name, (fn, args) in programs.items()
        }


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_workspace_bounds_what_xla_allocates_for_the_largest_buckets(dtype):
    # Windows and a prefill chunk long enough that attention scores dominate, as in a real deployment.
    deployment = parse_deployment(
        {
            "model": {
                "name": "streaming_tts",
                "config": {
                    "dtype": dtype, "d_model": 96, "max_voice_frames": 200, "talker_window": 256,
                    "query_window": 257, "flow_window": 128, "max_slots": 8,
                },
            },
            "engine": {"max_batch": 8},
            "compile": {"token_counts": [1, 8, 64]},
        }
    )  # fmt: skip
    config = deployment.model_config
    estimate = workspace_bytes(
        config, deployment.spec("talker_kv").config, deployment.spec("flow_kv").config, 8, 64, 8
    )
    measured = _compiled_temp_bytes(deployment)
    assert max(measured.values()) <= estimate
    # An upper estimate, not a wild one: within 2x of the largest program.
    assert estimate <= 2 * max(measured.values())


def test_a_deployment_that_fits_has_no_fix():
    budget = memory_budget(load_deployment(), DeviceMemory(nbytes=GIB, source="test"))
    assert budget.fits
    assert budget.total == sum(_parts(budget).values())
    assert budget.max_fitting_slots is None
    budget.require_fit()


def _tpu_mapping(max_slots: int, max_batch: int) -> dict:
    import yaml

    from tests.test_deployment import TPU_CONFIG

    mapping = yaml.safe_load(TPU_CONFIG.read_text())
    mapping["resources"] = {"talker_kv": {"max_slots": max_slots}, "flow_kv": {"max_slots": max_slots}}
    mapping["engine"]["max_batch"] = max_batch
    mapping["compile"]["batch_sizes"] = None
    return mapping


def test_the_fix_is_the_most_slots_that_fit():
    device = DeviceMemory(nbytes=24 * GIB, source="--device-memory")
    budget = memory_budget(parse_deployment(_tpu_mapping(64, 64), source="tpu.yaml"), device)
    assert not budget.fits
    n = budget.max_fitting_slots
    assert n is not None
    assert 1 <= n < 64
    # n slots per cache (and a batch of n) fit; n + 1 do not.
    assert memory_budget(parse_deployment(_tpu_mapping(n, n)), device).fits
    assert not memory_budget(parse_deployment(_tpu_mapping(n + 1, n + 1)), device).fits
    with pytest.raises(DeviceMemoryError) as info:
        budget.require_fit()
    message = str(info.value)
    assert message.startswith(
        "tpu.yaml: the deployment needs model weights (1,780,627,920 x bfloat16) 3.3 GiB"
    )
    assert "talker_kv slots (64 + 1 padding) 20.9 GiB" in message
    assert "more than the device memory 24.0 GiB (--device-memory)" in message
    keys = "resources.talker_kv.max_slots and resources.flow_kv.max_slots"
    assert message.endswith(f"lower {keys} to {n} and engine.max_batch to {n}")


def test_when_no_slot_count_fits_the_largest_part_is_named():
    mapping = _tpu_mapping(64, 64)
    mapping["model"]["config"]["d_model"] = 65_536  # ~a trillion parameters
    mapping["model"]["config"]["talker_ffn_dim"] = 262_144
    budget = memory_budget(parse_deployment(mapping), DeviceMemory(nbytes=95 * GIB, source="test"))
    assert budget.max_fitting_slots is None
    assert budget.blocker.label.startswith("model weights")
    with pytest.raises(DeviceMemoryError, match=r"the largest part is model weights .*: a smaller model"):
        budget.require_fit()


# Two caches of different geometry and dtype, as a model without a deployment serves them.
_SERVED = {
    "a": BoundedKVConfig(
        num_layers=3, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=0,
        retention=SinkWindow(0, 7), max_slots=5, dtype=jnp.bfloat16,
    ),
    "b": BoundedKVConfig(
        num_layers=1, num_heads=1, head_dim=16, rows_per_request=2, max_source_len=6, min_source_len=1,
        retention=SinkWindow(2, 9), max_slots=5,
    ),
}  # fmt: skip


def _params():
    """A small Flax NNX model's parameters: allocated, and abstract (`nnx.eval_shape`)."""
    from flax import nnx

    make = lambda: nnx.Sequential(  # noqa: E731
        nnx.Linear(5, 7, rngs=nnx.Rngs(0)), nnx.Linear(7, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    )
    return nnx.state(make()), nnx.state(nnx.eval_shape(make))


def test_serving_budget_counts_the_models_own_parameters_and_what_the_caches_allocate():
    real, abstract = _params()
    leaves = jax.tree.leaves(real)
    assert tree_bytes(real) == tree_bytes(abstract) == sum(leaf.nbytes for leaf in leaves)
    assert tree_bytes(real) == (5 * 7 + 7) * 4 + (7 * 3 + 3) * 2
    budget = serving_budget(abstract, _SERVED, DeviceMemory(nbytes=GIB, source="test"), num_sources=3)
    assert budget.fits
    assert budget.max_fitting_slots is None
    parts = _parts(budget)
    assert parts[f"model weights ({sum(leaf.size for leaf in leaves):,} parameters)"] == tree_bytes(real)
    for key, config in _SERVED.items():
        manager = BoundedKVManager(BoundedKVSpec(key, {"node"}, config), num_sources=3)  # allocates them
        assert parts[f"{key} slots (5 + 1 padding)"] == manager.cache.nbytes
        assert parts[f"{key} source bank (3 sources)"] == sum(
            x.nbytes for x in (*manager.bank.k, *manager.bank.v)
        )
    assert budget.total == sum(parts.values())


def test_serving_budget_names_the_most_slots_that_fit_or_the_largest_part():
    _, params = _params()
    fitting = serving_budget(params, _SERVED, DeviceMemory(nbytes=GIB, source="test")).total
    device = DeviceMemory(nbytes=fitting - 1, source="test")
    budget = serving_budget(params, _SERVED, device)
    assert not budget.fits
    n = budget.max_fitting_slots
    assert n == 4
    fewer = {key: dataclasses.replace(config, max_slots=n) for key, config in _SERVED.items()}
    assert serving_budget(params, fewer, device).fits
    assert budget.slot_keys == ("a", "b")
    tiny = serving_budget(params, _SERVED, DeviceMemory(nbytes=100, source="test"))
    assert tiny.max_fitting_slots is None
    assert tiny.blocker.label.startswith("b slots (1 + 1 padding)")


def test_serving_budget_refuses_what_it_cannot_count():
    device = DeviceMemory(nbytes=GIB, source="test")
    with pytest.raises(TypeError, match=r"leaf \['w'\]='weights' of the tree has no shape and dtype"):
        serving_budget({"w": "weights"}, _SERVED, device)
    with pytest.raises(TypeError, match=r"caches\['a'\]=\{'max_slots': 2\} must be a BoundedKVConfig"):
        serving_budget({}, {"a": {"max_slots": 2}}, device)
    with pytest.raises(ValueError, match=r"caches=\{\} must name at least one cache"):
        serving_budget({}, {}, device)
    with pytest.raises(ValueError, match=r"num_sources=0 must be an int >= 1"):
        serving_budget({}, _SERVED, device, num_sources=0)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("1", 1),
        ("1073741824", 2**30),
        ("16GiB", 16 * 2**30),
        ("16 gib", 16 * 2**30),
        ("1.5TiB", 3 * 2**39),
        ("80GB", 80 * 10**9),
        ("512MiB", 2**29),
        ("2kB", 2000),
        ("3 B", 3),
    ],
)
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "16G", "GiB", "-1GiB", "1e9", "0", "0.1B", "16 GiB extra"])
def test_parse_size_refuses_naming_the_text_and_the_units(text):
    with pytest.raises(ValueError, match=f"size={text!r} must be"):
        parse_size(text)


def test_device_memory_on_cpu_is_host_ram():
    assert jax.devices()[0].platform == "cpu"
    device = device_memory()
    assert device == DeviceMemory(nbytes=host_memory(), source="host RAM")
    assert 0 < host_memory() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_device_memory_reads_an_accelerators_bytes_limit(monkeypatch):
    @dataclasses.dataclass
    class FakeDevice:
        platform: str = "gpu"
        device_kind: str = "NVIDIA H200"

        def memory_stats(self):
            return {"bytes_limit": 106_300_000_000, "bytes_in_use": 0}

    monkeypatch.setattr(jax, "devices", lambda: [FakeDevice()])
    assert device_memory() == DeviceMemory(nbytes=106_300_000_000, source="NVIDIA H200 bytes_limit")

    def busy():
        raise RuntimeError("TPU is already in use by process 42")

    monkeypatch.setattr(jax, "devices", busy)
    with pytest.raises(DeviceMemoryError, match=r"TPU is already in use .*give it with --device-memory"):
        device_memory()
