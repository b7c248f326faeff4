"""`offline_tpu`'s reading of compiled programs."""

from mstar_jax.compile import offline_tpu

# --- large_copies on hand-written optimized HLO -------------------------------------------------------------

LAYER = "bf16[129,1,1,1008,128]"  # 32.8 MB
HBM, VMEM, CMEM = (
    "{4,3,2,1,0:T(8,128)(2,1)}",
    "{4,3,2,1,0:T(8,128)(2,1)S(1)}",
    "{4,3,2,1,0:T(8,128)(2,1)S(3)}",
)
HLO = f"""
ENTRY %main {{
  %p = {LAYER}{HBM} parameter(0)
  %copy-start = ({LAYER}{HBM}, {LAYER}{VMEM}, u32[]{{:S(2)}}) copy-start(%p)
  %slice-start = (({LAYER}{HBM}), bf16[33,1,1,1008,128]{VMEM}, s32[]{{:S(2)}}) slice-start(%p)
  %slice-start.1 = (({LAYER}{HBM}), bf16[1,1,1,1008,128]{VMEM}, s32[]{{:S(2)}}) slice-start(%p)
  %staged = {LAYER}{CMEM} custom-call(%p), custom_call_target="ConcatBitcast"
  %kernel = {LAYER}{HBM} custom-call(%p), custom_call_target="tpu_custom_call"
  %copy.1 = f32[8,128]{{1,0:T(8,128)}} copy(%small)
  ROOT %transpose.2 = bf16[129,1,1,128,1008]{{4,3,2,1,0}} transpose(%p), dimensions={{0,1,2,4,3}}
}}
"""


class _Compiled:
    def as_text(self):
        return HLO


def test_large_copies_finds_moves_into_any_memory_space_and_relayouts():
    found = offline_tpu.large_copies(_Compiled(), 129 * 1008 * 128 * 2 // 8)
    # The copy-start (by its op), the slice of a quarter layer and the layer staged in S(3) (by where they
    # land), the transpose; not the one-slot slice of the layer, the kernel in HBM or the small copy.
    assert [f.split(":")[0] for f in found] == [
        "copy-start copy-start",
        "slice-start slice-start",
        "custom-call staged",
        "transpose transpose.2",
    ]
