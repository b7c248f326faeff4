"""The attention kernel and whole attention steps compiled by libtpu for v4, v5e, v5p and v6e, without a TPU.

The real TPU compiler runs on this host behind compile-only devices (`mstar_jax.compile.offline_tpu`), so
what only the device compiler sees is checked here: Mosaic layouts and scoped VMEM, and the copies XLA's
layout assignment would insert around the kernel. Numerics are the interpret-mode suite's (`test_tpu.py`).

Each check asserts that the program compiles, holds no copy, transpose or memory-space move of a buffer a
quarter of a cache layer or larger, and needs temporaries under 2% of one layer.

The checks run against the libtpu this process loads; where that is 0.0.50 or later the store is pinned to
HBM, and the small layers it then keeps in HBM are checked too. CI loads jax's pin (0.0.42) here and runs
the checks the pin changes against 0.0.52 in a child process (`tests/compile/test_offline_tpu.py`).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.sink_window_attention import store_tpu
from kernels_pallas.sink_window_attention import table as tbl
from kernels_pallas.sink_window_attention.tpu_compiler import libtpu_version, pins_aliased_operands
from mstar_jax.compile import accelerator_cases, offline_tpu

MISSING = offline_tpu.tpu_toolchain_missing()
pytestmark = [
    pytest.mark.aot,
    pytest.mark.skipif(MISSING is not None, reason=f"no offline TPU compiler: {MISSING}"),
]
LIBTPU = libtpu_version()
PINNED = pins_aliased_operands()

GENERATIONS = tuple(offline_tpu.GENERATIONS)
CASES = {case.name: case for case in accelerator_cases.CASES}
MAX_TEMP_FRACTION = 0.02
_ATTENTION_CALL = re.compile(r"%sink_window_attention_tpu[\w.]* = .* custom-call\(")


def _check_compiled(compiled, case: accelerator_cases.AttentionCase, dtype) -> str:
    layer = case.layer_bytes(dtype)
    assert offline_tpu.large_copies(compiled, layer // 4) == []
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= MAX_TEMP_FRACTION * layer, f"temporaries {temp:,} B against a {layer:,} B layer"
    return compiled.as_text()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("generation", GENERATIONS)
def test_attention_kernel_compiles_without_copying_the_cache(generation, name, dtype):
    case = CASES[name]
    fn, specs = case.attention(dtype, "pallas_tpu")
    text = _check_compiled(offline_tpu.compile_for_tpu(fn, *specs, generation=generation), case, dtype)
    assert len(_ATTENTION_CALL.findall(text)) == 1


STEP_CASES = [
    ("decode_d128", jnp.float32),
    ("decode_d128", jnp.bfloat16),
    ("decode_d64", jnp.bfloat16),
    ("decode_d64_short_voice", jnp.float32),
    ("decode_d256_8k", jnp.bfloat16),
    ("prefill_d64_t128", jnp.bfloat16),
    ("prefill_d128_t16", jnp.float32),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "dtype"), STEP_CASES, ids=[f"{n}-{jnp.dtype(d).name}" for n, d in STEP_CASES]
)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_attend_step_runs_the_kernel_in_place(generation, name, dtype):
    # implementation="auto" traced on this CPU host: the TPU lowering must pick the Pallas kernels.
    case = CASES[name]
    fn, specs = case.step(dtype)
    compiled = offline_tpu.compile_for_tpu(fn, *specs, generation=generation, donate_argnums=0)
    text = _check_compiled(compiled, case, dtype)
    assert len(_ATTENTION_CALL.findall(text)) == accelerator_cases.STEP_LAYERS
    # Every layer's K and V are updated in place: the donated cache is aliased to the output whole.
    cache_bytes = accelerator_cases.STEP_LAYERS * case.layer_bytes(dtype)
    assert compiled.memory_analysis().alias_size_in_bytes >= cache_bytes


@pytest.mark.xfail(
    not PINNED,
    strict=True,
    reason=f"known gap of libtpu before 0.0.50 (here {LIBTPU}): on a layer that fits VMEM (here 31 MiB per "
    "K or V), XLA's memory-space assignment moves it through VMEM around the aliased store kernel; pinning "
    "the store's operands to HBM (pltpu.with_memory_space_constraint) trips this libtpu's alias verifier, "
    "so the store is not pinned",
)
def test_small_layer_step_keeps_the_cache_in_hbm():
    case = CASES["decode_mqa"]
    fn, specs = case.step(jnp.bfloat16)
    compiled = offline_tpu.compile_for_tpu(fn, *specs, generation="v5e", donate_argnums=0)
    assert offline_tpu.large_copies(compiled, case.layer_bytes(jnp.bfloat16) // 8) == []


# Layers small enough that XLA's memory-space assignment stages them in VMEM on v4, v5e and v6e unless the
# store is pinned, one per store path: direct (f32, D = 128) and tiled (bf16) in decode_mqa, tiled at
# D = 256 in prefill_d256_t64, lanes (D = 64) in the short voice with 32 slots.
SMALL_LAYERS = {
    "decode_mqa": CASES["decode_mqa"],
    "prefill_d256_t64": CASES["prefill_d256_t64"],
    "decode_d64_short_voice_s32": dataclasses.replace(
        CASES["decode_d64_short_voice"], name="decode_d64_short_voice_s32", slots=32
    ),
}


@pytest.mark.skipif(
    not PINNED,
    reason=f"libtpu {LIBTPU} rejects the store's HBM pin (the known gap above); "
    "tests/compile/test_offline_tpu.py runs this against a newer libtpu",
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", list(SMALL_LAYERS))
def test_pinned_small_layer_steps_keep_the_cache_in_hbm(name, dtype):
    case = SMALL_LAYERS[name]
    fn, specs = case.step(dtype)
    layer = case.layer_bytes(dtype)
    for generation in GENERATIONS:
        compiled = offline_tpu.compile_for_tpu(fn, *specs, generation=generation, donate_argnums=0)
        # No temporaries bound: v5p's fixed ~1.5 MB pass 2% of these small layers.
        assert offline_tpu.large_copies(compiled, layer // 8) == [], generation
        assert len(_ATTENTION_CALL.findall(compiled.as_text())) == accelerator_cases.STEP_LAYERS
        alias = compiled.memory_analysis().alias_size_in_bytes
        assert alias >= accelerator_cases.STEP_LAYERS * layer, (generation, alias)


def test_the_store_pin_compiles_exactly_where_the_libtpu_version_says():
    # The version rule (`tpu_compiler`) held against the compiler itself: the store of a donated layer,
    # pinned. libtpu before 0.0.50 rejects it when the pinned operand is the program's parameter.
    cache = jax.ShapeDtypeStruct((17, 2, 2, 48, 128), jnp.float32)
    step = jax.ShapeDtypeStruct((16, 8, 2, 128), jnp.float32)
    specs = (cache, cache, step, step, jax.ShapeDtypeStruct((8, tbl.ROW_INTS), jnp.int32))
    fn = functools.partial(store_tpu.store_step_tpu, reverse=True, pin_to_hbm=True)

    def compile_pinned():
        return offline_tpu.compile_for_tpu(fn, *specs, generation="v5e", donate_argnums=(0, 1))

    if not PINNED:
        with pytest.raises(jax.errors.JaxRuntimeError, match="Different aliasing shapes"):
            compile_pinned()
        return
    compiled = compile_pinned()
    layer = int(np.prod(cache.shape)) * 4
    assert offline_tpu.large_copies(compiled, layer // 8) == []
    assert compiled.memory_analysis().alias_size_in_bytes >= 2 * layer


TERM_CASES = ["decode_d64", "decode_d64_short_voice", "prefill_d128_t16", "prefill_d256_t64"]
# The bias is laid out for the kernel's key walk before the call (`tpu_terms`), a gather whose output and
# index are about the bias's size each, in the kernel's fold [N, G, T * H/G, W], which TPU tiles in
# (8, 128): decode with 2 query heads per KV head pads its 2 rows to 8.
MAX_TERM_TEMP_FACTOR = 4


def _tiled_bias_bytes(case: accelerator_cases.AttentionCase, width: int) -> int:
    rows = -(-case.steps * (case.heads // case.kv_heads) // 8) * 8
    return 4 * case.batch * case.kv_heads * rows * -(-width // 128) * 128


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "generations"),
    [(jnp.bfloat16, GENERATIONS), (jnp.float32, ("v6e",))],
    ids=["bf16", "f32"],
)
@pytest.mark.parametrize("name", TERM_CASES)
def test_attention_kernel_with_score_terms_compiles(name, dtype, generations):
    case = CASES[name]
    fn, specs = case.attention(dtype, "pallas_tpu", ("rel_bias", "sink_logits"))
    layer, bias_bytes = case.layer_bytes(dtype), _tiled_bias_bytes(case, specs[8].shape[3])
    for generation in generations:
        compiled = offline_tpu.compile_for_tpu(fn, *specs, generation=generation)
        assert offline_tpu.large_copies(compiled, layer // 4) == []
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp <= MAX_TEMP_FRACTION * layer + MAX_TERM_TEMP_FACTOR * bias_bytes, (generation, temp)
        assert len(_ATTENTION_CALL.findall(compiled.as_text())) == 1
