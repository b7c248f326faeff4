"""Building a program's Triton kernels for an NVIDIA GPU on a host without one, and reading ptxas' figures.

A program lowered for CUDA (`jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))`) carries
each Pallas Triton kernel as a `__gpu$xla.gpu.triton` custom call whose backend config holds the
Triton IR (`ir`) and its launch settings (`num_warps`, `num_stages`). The CUDA plugin's Triton pipeline
(the compilation handler it registers in `jax._src.lib.triton`, a private JAX module) turns that IR
into PTX for a compute capability, and `ptxas -v` assembles the PTX and reports registers per thread,
spill traffic and stack. No GPU and no CUDA driver are needed; this shows whether a kernel builds,
spills or overflows shared memory, never its numerics or speed.

Needs `jax-cuda12-plugin` and `jax-cuda12-pjrt` at jax's version and `nvidia-cuda-nvcc-cu12` (for
`ptxas`). On a host without a GPU the plugin registers its Triton compiler only when it skips its
CUDA-runtime check: run with `JAX_PLATFORMS=cpu` (or `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`).
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re
import shutil
import subprocess
import tempfile

import jax
from jax._src.lib.mlir import ir

__all__ = ["PtxStats", "gpu_toolchain_missing", "triton_kernel_stats"]

_TRITON_CALL = "__gpu$xla.gpu.triton"
_PLUGIN_MODULE = "jax_plugins.xla_cuda12"
_PTXAS_TIMEOUT_S = 120
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_STATIC_SMEM = re.compile(r"(\d+) bytes smem")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PtxStats:
    """What building one Triton kernel for one GPU reported.

    Attributes:
      name: the kernel's name (the `pallas_call`'s `name=`).
      arch: the ptxas target, e.g. "sm_90a".
      num_warps: warps per program (launch setting from the backend config).
      num_stages: software-pipelining stages (launch setting from the backend config).
      registers: registers per thread (ptxas; 255 is the hardware maximum).
      spill_store_bytes: bytes of register spill stores per thread (ptxas).
      spill_load_bytes: bytes of register spill loads per thread (ptxas).
      stack_frame_bytes: bytes of local-memory stack frame per thread (ptxas).
      shared_memory_bytes: shared memory per program: Triton's dynamic allocation plus ptxas' static one.
    """

    name: str
    arch: str
    num_warps: int
    num_stages: int
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int
    shared_memory_bytes: int


def _ptxas() -> str | None:
    """The `ptxas` of `nvidia-cuda-nvcc-cu12` if installed, else the one on PATH, else None."""
    try:
        roots = importlib.import_module("nvidia.cuda_nvcc").__path__
    except ImportError:
        roots = []
    for candidate in (pathlib.Path(root) / "bin" / "ptxas" for root in roots):
        if candidate.is_file():
            return str(candidate)
    return shutil.which("ptxas")


def _triton_compiler():
    """JAX's private Triton binding (`jax._src.lib.triton`), after plugin discovery has run."""
    # Imported on use: a jaxlib without the binding makes `gpu_toolchain_missing` say so.
    from jax._src.lib import triton

    jax.devices()  # initialises the backends, which imports the plugins and registers their compilers
    return triton


def gpu_toolchain_missing() -> str | None:
    """Says why Triton kernels cannot be built for CUDA here, or None when they can.

    Returns:
      None when the CUDA plugin, its Triton compiler and a working `ptxas` are all present; else a
      one-line reason naming what is absent (fit for `pytest.skip`).
    """
    try:
        importlib.import_module(_PLUGIN_MODULE)
    except ImportError:
        return f"the JAX CUDA plugin ({_PLUGIN_MODULE}) is not installed: install jax-cuda12-plugin"
    try:
        triton = _triton_compiler()
    except ImportError as e:
        return f"this jaxlib has no Triton binding (jax._src.lib.triton): {e}"
    if not triton.has_compilation_handler("CUDA"):
        return (
            "the CUDA plugin registered no Triton compiler (without a GPU, set JAX_PLATFORMS=cpu or "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 so that it skips its CUDA-runtime check)"
        )
    ptxas = _ptxas()
    if ptxas is None:
        return "ptxas not found: install nvidia-cuda-nvcc-cu12"
    try:
        subprocess.run([ptxas, "--version"], capture_output=True, check=True, timeout=_PTXAS_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{ptxas} does not run: {e}"
    return None


def _arch(compute_capability: str) -> str:
    """ptxas' target for a capability: "9.0" -> "sm_90a" (the "a" features Triton uses from sm_90 on)."""
    major, minor = (int(part) for part in compute_capability.split("."))
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def _triton_calls(lowered: jax.stages.Lowered) -> list[ir.DictAttr]:
    """The backend configs of the lowered StableHLO module's Triton custom calls, in program order."""
    calls = []

    def visit(op) -> None:
        for region in op.regions:
            for block in region.blocks:
                for view in block.operations:
                    child = view.operation
                    if child.name == "stablehlo.custom_call":
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        if target == _TRITON_CALL:
                            calls.append(ir.DictAttr(child.attributes["mhlo.backend_config"]))
                    visit(child)

    visit(lowered.compiler_ir("stablehlo").operation)
    return calls


def _assemble(ptx: str, arch: str, ptxas: str) -> str:
    """Runs `ptxas -v` on the PTX and returns its report (stderr); raises on a failed assembly."""
    with tempfile.TemporaryDirectory() as tmp:
        source = pathlib.Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run(
            [ptxas, "-v", f"-arch={arch}", str(source), "-o", str(pathlib.Path(tmp) / "kernel.cubin")],
            capture_output=True,
            text=True,
            timeout=_PTXAS_TIMEOUT_S,
        )
    if result.returncode:
        raise RuntimeError(f"ptxas -arch={arch} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stderr


def triton_kernel_stats(lowered: jax.stages.Lowered, *, compute_capability: str = "9.0") -> list[PtxStats]:
    """Builds every Triton kernel of a program lowered for CUDA and returns what ptxas reports for each.

    Args:
      lowered: a `jax.stages.Lowered` from `.lower(lowering_platforms=("cuda",))`.
      compute_capability: the GPU's compute capability, "major.minor" ("9.0": H100/H200, ptxas target
        sm_90a).

    Returns:
      One `PtxStats` per Triton custom call, in program order.

    Raises:
      ValueError: the lowered module holds no Triton custom call (e.g. it was lowered for another
        platform, or the kernel's XLA path was taken).
      RuntimeError: the toolchain is missing (`gpu_toolchain_missing`'s reason), Triton fails to
        build the IR, or ptxas fails to assemble the PTX.
      subprocess.TimeoutExpired: ptxas ran past its time limit.
    """
    calls = _triton_calls(lowered)
    if not calls:
        raise ValueError(
            f"the lowered module holds no {_TRITON_CALL} custom call; lower the Pallas Triton kernel "
            'with lowering_platforms=("cuda",) and select it explicitly (implementation="pallas_gpu")'
        )
    if reason := gpu_toolchain_missing():
        raise RuntimeError(reason)
    triton, ptxas, arch = _triton_compiler(), _ptxas(), _arch(compute_capability)
    stats = []
    for config in calls:
        num_warps = ir.IntegerAttr(config["num_warps"]).value
        num_stages = ir.IntegerAttr(config["num_stages"]).value
        built = triton.compile(
            "CUDA",
            ir.StringAttr(config["ir"]).value_bytes,
            compute_capability,
            num_warps=num_warps,
            num_ctas=1,
            num_stages=num_stages,
        )
        report = _assemble(built.asm, arch, ptxas)
        frame, registers = _FRAME.search(report), _REGISTERS.search(report)
        if frame is None or registers is None:
            raise RuntimeError(f"unexpected ptxas -v report (no register or spill figures): {report!r}")
        static_smem = _STATIC_SMEM.search(report)
        stats.append(
            PtxStats(
                name=ir.StringAttr(config["name"]).value,
                arch=arch,
                num_warps=num_warps,
                num_stages=num_stages,
                registers=int(registers[1]),
                spill_store_bytes=int(frame[2]),
                spill_load_bytes=int(frame[3]),
                stack_frame_bytes=int(frame[1]),
                shared_memory_bytes=built.smem_bytes + (int(static_smem[1]) if static_smem else 0),
            )
        )
    return stats
