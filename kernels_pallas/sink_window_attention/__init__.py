"""Sink+window attention over a bounded KV cache (attention sinks + a ring-buffer window + a shared source).

`sink_window_attention` is the public op; `table` is the plan-table contract with the host planner;
`sink_window_attention_reference` is the float64 oracle; `store_step` writes a step's new entries into
their ring slots after attention. The Pallas kernels (`tpu`, `gpu`, `store_tpu`, `store_gpu`) are
imported only when an op dispatches to them.
"""

from kernels_pallas.sink_window_attention import table
from kernels_pallas.sink_window_attention.attention import sink_window_attention
from kernels_pallas.sink_window_attention.reference import sink_window_attention_reference
from kernels_pallas.sink_window_attention.store import store_step
from kernels_pallas.sink_window_attention.xla import sink_window_attention_xla

__all__ = [
    "sink_window_attention",
    "sink_window_attention_reference",
    "sink_window_attention_xla",
    "store_step",
    "table",
]
