"""The Pallas GPU kernel built for sm_90a (H100/H200) on this host, no GPU needed: no spills, fits in smem.

Each case lowers the public op with `implementation="pallas_gpu"` for CUDA from `jax.ShapeDtypeStruct`s,
has the CUDA plugin's Triton compile the kernel to PTX and `ptxas -v` assemble it
(`mstar_jax.compile.offline_gpu`), and holds the default block sizes to what ptxas reports: no register
spills, registers within the hardware's 255, shared memory under sm_90's 227 KiB per block. The cases
cover every padded head dim and both query-block regimes of `BlockSizes.default` per dtype (about a
second of Triton + ptxas each); the sweep behind the rule is summarised in its docstring. Whole two-layer
steps through `attend` (`mstar_jax.compile.accelerator_cases`) are lowered the same way, store kernel
included.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.sink_window_attention import sink_window_attention
from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.compile import accelerator_cases
from mstar_jax.compile.offline_gpu import PtxStats, gpu_toolchain_missing, triton_kernel_stats
from tests import extras

extras.skip_module_without("aot")
if reason := gpu_toolchain_missing():
    pytest.skip(reason, allow_module_level=True)
pytestmark = pytest.mark.aot

SM90_SHARED_MEMORY_BYTES = 227 * 1024  # usable per block on sm_90
MAX_REGISTERS = 255

# name: (T, H, G, K, query_window). Decode with 1, 4 and 8 query heads per KV head (8: one KV head) and
# prefill chunks; a small K shrinks the key block, T * H/G >= 64 takes the largest query block.
SHAPES = {
    "decode_g4": (1, 32, 8, 8192, None),
    "decode_one_kv_head_k32": (1, 8, 1, 32, None),
    "prefill16_one_kv_head": (16, 8, 1, 4096, None),
    "prefill64_g4_window": (64, 32, 8, 512, 16),
    "prefill128_g1_window": (128, 8, 8, 2048, 64),
}


def _case(dtype, head_dim: int, shape: str):
    return pytest.param(dtype, head_dim, shape, id=f"{jnp.dtype(dtype).name}-d{head_dim}-{shape}")


CASES = [
    _case(dtype, head_dim, shape)
    for dtype in (jnp.bfloat16, jnp.float32)
    for head_dim in (64, 128, 256)
    for shape in SHAPES
]
# Head dims that pad to 128 (the rule must look at the padded dim), and float16 (the 16-bit rule).
CASES += [
    _case(dtype, head_dim, shape)
    for dtype in (jnp.bfloat16, jnp.float32)
    for head_dim in (80, 96)
    for shape in ("decode_g4", "prefill128_g1_window")
]
CASES += [_case(jnp.float16, 128, "decode_g4"), _case(jnp.float16, 256, "prefill64_g4_window")]


def _specs(dtype, head_dim: int, shape: str) -> list[jax.ShapeDtypeStruct]:
    steps, heads, kv_heads, _, _ = SHAPES[shape]
    batch = 128 if steps == 1 else 4
    # Slot capacity C and source length L not multiples of 8 (nor of each other).
    slot_tokens, source_tokens = (3004, 1001) if head_dim % 128 else (1001, 3004)
    q = jax.ShapeDtypeStruct((batch, steps, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((batch, steps, kv_heads, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((batch + 1, 1, kv_heads, slot_tokens, head_dim), dtype)
    source = jax.ShapeDtypeStruct((3, 1, kv_heads, source_tokens, head_dim), dtype)
    table = jax.ShapeDtypeStruct((batch, tbl.ROW_INTS), jnp.int32)
    return [q, kv, kv, cache, cache, source, source, table]


def _lower(specs, *, implementation: str, max_retained: int, query_window: int | None) -> jax.stages.Lowered:
    fn = functools.partial(
        sink_window_attention,
        max_retained=max_retained,
        query_window=query_window,
        implementation=implementation,
    )
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "head_dim", "shape"), CASES)
def test_default_blocks_build_without_spills(dtype, head_dim, shape):
    _, _, _, max_retained, query_window = SHAPES[shape]
    lowered = _lower(
        _specs(dtype, head_dim, shape),
        implementation="pallas_gpu",
        max_retained=max_retained,
        query_window=query_window,
    )
    stats = triton_kernel_stats(lowered, compute_capability="9.0")
    assert len(stats) == 1, stats
    (kernel,) = stats
    assert isinstance(kernel, PtxStats)
    assert kernel.name == "sink_window_attention_gpu"
    assert kernel.arch == "sm_90a"
    # Both dtypes reach zero spills with `BlockSizes.default` (float32 by one stage and more warps).
    assert (kernel.spill_store_bytes, kernel.spill_load_bytes) == (0, 0), kernel
    assert kernel.registers <= MAX_REGISTERS, kernel
    assert kernel.shared_memory_bytes < SM90_SHARED_MEMORY_BYTES, kernel


def test_rejects_a_program_without_a_triton_kernel():
    specs = _specs(jnp.bfloat16, 64, "decode_g4")
    lowered = _lower(specs, implementation="xla", max_retained=64, query_window=None)
    with pytest.raises(ValueError, match=re.escape("no __gpu$xla.gpu.triton custom call")):
        triton_kernel_stats(lowered)


STEP_CASES = ["decode_d64", "decode_d128", "decode_d256_8k", "prefill_d64_t128", "prefill_d128_t16"]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", STEP_CASES)
def test_attend_step_lowers_both_kernels_in_place(name, dtype):
    # A two-layer step through `attend`, traced on this CPU host with implementation="auto" and lowered
    # for CUDA: it must carry the attention and store kernels, build them without spills, and alias the
    # donated cache (each layer's K and V) to the output.
    case = next(c for c in accelerator_cases.CASES if c.name == name)
    fn, specs = case.step(dtype)
    lowered = jax.jit(fn, donate_argnums=0).trace(*specs).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("tf.aliasing_output") == 2 * accelerator_cases.STEP_LAYERS
    stats = triton_kernel_stats(lowered)
    assert {s.name for s in stats} == {"sink_window_attention_gpu", "store_step_gpu"}
    for kernel in stats:
        assert (kernel.spill_store_bytes, kernel.spill_load_bytes) == (0, 0), kernel
        assert kernel.shared_memory_bytes < SM90_SHARED_MEMORY_BYTES, kernel


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", ["decode_d64", "decode_d128", "prefill_d128_t16", "prefill_d256_t64"])
def test_score_terms_build_without_spills(name, dtype):
    # The per-key gather of the rel_bias band and the sink-seeded softmax state, with the default blocks.
    case = next(c for c in accelerator_cases.CASES if c.name == name)
    fn, specs = case.attention(dtype, "pallas_gpu", ("rel_bias", "sink_logits"))
    (kernel,) = triton_kernel_stats(
        jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)), compute_capability="9.0"
    )
    assert kernel.name == "sink_window_attention_gpu"
    assert (kernel.spill_store_bytes, kernel.spill_load_bytes) == (0, 0), kernel
    assert kernel.registers <= MAX_REGISTERS, kernel
    assert kernel.shared_memory_bytes < SM90_SHARED_MEMORY_BYTES, kernel
