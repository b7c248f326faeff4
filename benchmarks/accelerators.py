"""What the real TPU and GPU compilers make of the attention kernels, on a host with neither chip.

Run from the repository root with the `aot` extra installed (libtpu, the CUDA plugin, ptxas):

    python -m benchmarks.accelerators            # every case of mstar_jax.compile.accelerator_cases
    python -m benchmarks.accelerators --quick    # the first three cases, bf16 only
    python -m benchmarks.accelerators --score-terms   # with rel_bias and sink_logits: temp ÷ the bias

TPU, per generation and case, for the public op with the Pallas TPU kernel (libtpu on compile-only devices):
compiled or why not; the VMEM the call asks for (`vmem_limit_bytes`, the tiled estimate plus headroom);
temporaries ÷ one cache layer's bytes; bytes accessed (`cost_analysis`) ÷ the retained bytes the step
must read; and a roofline step time, bytes accessed ÷ the chip's HBM bandwidth. The roofline is an
estimate from counted bytes, not a measurement: no TPU ran.

GPU (sm_90a), per case, for the Pallas Triton kernel: registers per thread, spill stores and loads, shared
memory and warps, from `ptxas -v` on the PTX the plugin's Triton pipeline builds.

Nothing here is timed, so nothing is compared across machines; figures of different generations are
different chips' compilers on the same program.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

# Offline compilation needs no device: keep jax on the CPU even where a GPU plugin would claim one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from kernels_pallas.sink_window_attention import tpu_blocks
from mstar_jax.compile import accelerator_cases, offline_gpu, offline_tpu


@dataclasses.dataclass(frozen=True)
class TpuRow:
    generation: str
    case: str
    dtype: str
    compiled: str
    vmem_mib: float
    temp_per_layer: float
    accessed_per_retained: float
    roofline_us: float
    temp_per_bias: float = float("nan")  # with --score-terms: temporaries ÷ rel_bias's bytes


def _vmem_request(case: accelerator_cases.AttentionCase, dtype, terms: tuple[str, ...] = ()) -> int:
    """The `vmem_limit_bytes` the kernel asks for with its default tiles (the wrapper's own choice)."""
    _, specs = case.attention(dtype, "pallas_tpu")
    source, slot = specs[5].shape, specs[3].shape  # as allocated: at least a sublane tile, never empty
    tiles = tpu_blocks.choose_tiles(
        max_retained=case.config(dtype).max_retained, steps=case.steps, group=case.heads // case.kv_heads,
        kv_heads=case.kv_heads, head_dim=case.head_dim, itemsize=jnp.dtype(dtype).itemsize,
        source_len=source[3], slot_len=slot[3],
        transposed=(tpu_blocks.tokens_in_lanes(source), tpu_blocks.tokens_in_lanes(slot)),
        rel_bias="rel_bias" in terms, sink_logits="sink_logits" in terms,
    )  # fmt: skip
    return tiles.vmem_limit_bytes


def tpu_rows(cases, dtypes, terms: tuple[str, ...] = ()) -> list[TpuRow]:
    rows = []
    for generation, chip in offline_tpu.GENERATIONS.items():
        for case in cases:
            for dtype in dtypes:
                name = jnp.dtype(dtype).name
                fn, specs = case.attention(dtype, "pallas_tpu", terms)
                vmem = _vmem_request(case, dtype, terms) / 2**20
                try:
                    compiled = offline_tpu.compile_for_tpu(fn, *specs, generation=generation)
                except Exception as e:  # report the compiler's refusal in the table
                    reason = str(e).splitlines()[0][:60]
                    rows.append(
                        TpuRow(generation, case.name, name, f"no: {reason}", vmem, *[float("nan")] * 3)
                    )
                    continue
                copies = offline_tpu.large_copies(compiled, case.layer_bytes(dtype) // 4)
                temp_bytes = compiled.memory_analysis().temp_size_in_bytes
                temp = temp_bytes / case.layer_bytes(dtype)
                accessed = float(compiled.cost_analysis()["bytes accessed"])
                compiled_cell = "yes" if not copies else f"yes, {len(copies)} copies"
                ratio, roofline = accessed / case.retained_bytes(dtype), 1e6 * accessed / chip.hbm_bytes_per_s
                bias = case.score_term_specs(dtype, terms).get("rel_bias")
                per_bias = temp_bytes / (4 * bias.size) if bias is not None else float("nan")
                row = TpuRow(
                    generation, case.name, name, compiled_cell, vmem, temp, ratio, roofline, per_bias
                )
                rows.append(row)
    return rows


def gpu_rows(cases, dtypes, terms: tuple[str, ...] = ()) -> list[tuple]:
    rows = []
    for case in cases:
        for dtype in dtypes:
            fn, specs = case.attention(dtype, "pallas_gpu", terms)
            lowered = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
            for stats in offline_gpu.triton_kernel_stats(lowered):
                spills = f"{stats.spill_store_bytes}/{stats.spill_load_bytes}"
                smem = stats.shared_memory_bytes / 1024
                rows.append(
                    (
                        case.name,
                        jnp.dtype(dtype).name,
                        stats.registers,
                        spills,
                        f"{smem:.1f}",
                        stats.num_warps,
                    )
                )
    return rows


def _print_tpu_summary(rows: list[TpuRow]) -> None:
    """One row per case and dtype: the generations side by side (the same program, four compilers)."""
    generations = list(offline_tpu.GENERATIONS)
    by_case: dict[tuple[str, str], list[TpuRow]] = {}
    for row in rows:
        by_case.setdefault((row.case, row.dtype), []).append(row)
    table = []
    for (case, dtype), group in by_case.items():
        compiled = sorted({r.generation for r in group if r.compiled == "yes"}, key=generations.index)
        roofline = " / ".join(f"{r.roofline_us:.0f}" for r in group)
        table.append(
            (case, dtype, "all 4" if len(compiled) == len(generations) else ", ".join(compiled) or "none",
             f"{group[0].vmem_mib:.1f}", f"{max(r.temp_per_layer for r in group):.4f}",
             f"{max(r.accessed_per_retained for r in group):.2f}", roofline)
        )  # fmt: skip
    header = (
        "case",
        "dtype",
        "compiles, no copy",
        "VMEM asked MiB",
        "max temp ÷ layer",
        "accessed ÷ retained",
    )
    _print_table((*header, "roofline µs " + "/".join(generations)), table)


def _print_table(header: tuple[str, ...], rows: list[tuple]) -> None:
    cells = [tuple(header)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three cases, bf16 only (figures labelled so)")
    parser.add_argument(
        "--summary",
        action="store_true",
        help="one TPU row per case and dtype (as in docs/guides/accelerators.md)",
    )
    parser.add_argument(
        "--score-terms",
        action="store_true",
        help="the kernels with rel_bias and sink_logits (temp ÷ the bias)",
    )
    args = parser.parse_args(argv)
    cases = accelerator_cases.CASES[:3] if args.quick else accelerator_cases.CASES
    dtypes = (jnp.bfloat16,) if args.quick else accelerator_cases.DTYPES
    terms = ("rel_bias", "sink_logits") if args.score_terms else ()
    label = (" (--quick: a subset)" if args.quick else "") + (
        ", with rel_bias and sink_logits" if terms else ""
    )

    if (missing := offline_tpu.tpu_toolchain_missing()) is None:
        print(f"TPU, Pallas kernel compiled by libtpu{label}")
        rows = tpu_rows(cases, dtypes, terms)
        if args.summary:
            _print_tpu_summary(rows)
        else:
            header = ("gen", "case", "dtype", "compiled", "VMEM asked MiB", "temp ÷ layer")
            header += ("accessed ÷ retained", "roofline µs") + (("temp ÷ rel_bias",) if terms else ())
            cells = [
                (r.generation, r.case, r.dtype, r.compiled, f"{r.vmem_mib:.1f}", f"{r.temp_per_layer:.4f}",
                 f"{r.accessed_per_retained:.2f}", f"{r.roofline_us:.1f}")
                + ((f"{r.temp_per_bias:.2f}",) if terms else ())
                for r in rows
            ]  # fmt: skip
            _print_table(header, cells)
    else:
        print(f"TPU: skipped, {missing}")
    if (missing := offline_gpu.gpu_toolchain_missing()) is None:
        print(f"\nGPU sm_90a, Pallas Triton kernel, ptxas -v{label}")
        header = ("case", "dtype", "registers", "spill st/ld B", "smem KiB", "warps")
        _print_table(header, gpu_rows(cases, dtypes, terms))
    else:
        print(f"GPU: skipped, {missing}")


if __name__ == "__main__":
    main()
