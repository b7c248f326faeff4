"""Gemma 3 streams on the bounded caches: the two cache specs, their resource runner, the captured steps.

`Gemma3Streams` holds the model's weights, two `BoundedKVManager`s (local and global layers, see
`model.py`) behind one `ResourceRunner`, and the step compiled ahead of time for every bucket: prefill
walks of `chunk` tokens a row and decode walks of one, at each batch size. A step of rows is padded to
its tightest bucket, admitted and planned by both caches, replayed on the donated caches, and
committed (`run`). What a step returns is its head: each row's next greedy token, every position's
logits, or the log-probability of given target tokens (computed on the device, so a 262,144-word
vocabulary never crosses to the host).

On top: `score` streams a text through in chunks and returns every token's log-probability at flat
memory, `logits` every position's logits (short texts), `greedy` continues a prompt, one stream at a
time. Many streams at once are the engine's (`Gemma3Serving`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.sink_window_attention import table as tbl
from mstar_jax.checks import check_bool, check_int
from mstar_jax.compile import (
    Buckets,
    BucketSet,
    CapturedStep,
    CaptureReport,
    ExecutableStore,
    cap_batch_sizes,
    capture,
)
from mstar_jax.distributed import manager_shards
from mstar_jax.models.gemma3 import screen
from mstar_jax.models.gemma3.gguf import Gemma3Config
from mstar_jax.models.gemma3.model import Gemma3
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.config import (
    BoundedKVConfig,
    BoundedKVSpec,
    BoundedKVStep,
    SinkWindow,
    StreamPosition,
)
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.kv.bounded.sharding import place_on_mesh
from mstar_jax.resources.runner import ResourceRunner
from mstar_jax.resources.step import BucketKey, FullAdmitOutcome, Segment
from mstar_jax.serving import (
    Declared,
    Resources,
    abstract,
    admit,
    declare,
    layer_attention,
    run_admitted,
    sample,
    sample_or,
    shaped,
)

__all__ = [
    "DECODE",
    "GLOBAL_KV",
    "HEADS",
    "LOCAL_KV",
    "PREFILL",
    "Gemma3Streams",
    "cache_configs",
    "step_extras",
]

LOCAL_KV, GLOBAL_KV = "gemma3_local_kv", "gemma3_global_kv"
PREFILL, DECODE = "gemma3_prefill", "gemma3_decode"
HEADS = ("next", "logits", "log_probs")
"""What a step returns per row: `next` i32 (the argmax after its last real token), `logits`
f32[T, V], `log_probs` f32[T] (of the step's `targets`)."""


def step_extras(rows: int, tokens: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The abstract inputs a step of `rows` rows of `tokens` tokens takes after `lengths`: targets
    i32[B, T], temperatures f32[B], seeds u32[B] (`Gemma3Streams.step`)."""
    return shaped((rows, tokens), jnp.int32), shaped((rows,), jnp.float32), shaped((rows,), jnp.uint32)


def cache_configs(
    config: Gemma3Config, *, global_retention: SinkWindow, max_slots: int = 1, dtype=jnp.float32
) -> tuple[BoundedKVConfig, BoundedKVConfig]:
    """The local and global layers' cache configs.

    Local layers keep the last `sliding_window - 1` positions and attend a causal band of
    `sliding_window` (Gemma's window, which counts the query's own position). Global layers keep what
    `global_retention` says and attend a band of its window + 1, so a prefill chunk attends exactly
    what one-token steps would.

    Raises:
      ValueError: for a retention that is not a `SinkWindow` of ints, or a window below 1.
    """
    if not isinstance(global_retention, SinkWindow) or global_retention.window < 1:
        raise ValueError(f"global_retention={global_retention!r} must be a SinkWindow(sink, window >= 1)")
    if global_retention.window_includes_step:
        raise ValueError(
            f"global_retention={global_retention!r} has window_includes_step=True: it must be False (the "
            "causal band of window + 1 already counts the step's own position)"
        )
    layers = sum(config.is_global(i) for i in range(config.num_layers))
    common = {
        "num_heads": config.num_kv_heads, "head_dim": config.head_dim, "rows_per_request": 1,
        "max_source_len": 0, "max_slots": max_slots, "dtype": dtype,
    }  # fmt: skip
    window = config.sliding_window
    local = BoundedKVConfig(
        num_layers=config.num_layers - layers,
        retention=SinkWindow(0, window - 1),
        query_window=window,
        **common,
    )
    global_ = BoundedKVConfig(
        num_layers=layers, retention=global_retention, query_window=global_retention.window + 1, **common
    )
    return local, global_


class Gemma3Streams:
    """A Gemma 3 model serving streams on its two bounded caches.

    Args:
      config: the model's geometry.
      model: the weights (`Gemma3.from_tensors`).
      global_retention: what the global layers keep (`SinkWindow(0, n)` with `n` at least the stream's
        length is the dense model).
      max_slots: streams served at once.
      chunk: prefill tokens per row and step.
      batch_sizes: rows per compiled program, below `max_slots`; `max_slots` itself is always one.
      implementation, interpret: the attention implementation (`sink_window_attention`).
      store: load captured programs from here where a previous start stored them, and store the ones
        compiled (None: compile every time).
      mesh: a `(data, model)` mesh (`sharding.make_mesh`) to serve on: `data` slot pools split
        `max_slots`, `model` shards split the KV heads, the weights are replicated; a multi-process
        mesh's process admits into its own data shards. None: one device. The engine serves a meshed
        `Gemma3Streams` (`Gemma3Serving`); its own `run` needs one device.
      greedy_screen: CPU, float32 only: take greedy tokens (head `next`, temperature 0) with
        `mstar_jax.native.screened_argmax`, which reads a two-level int8 copy of the output projection
        (336 MiB more for the 270M model) instead of the float32 one, then finishes the few words it
        cannot rule out in float32: the argmax of float32 logits, summed in its own fixed order (so a
        near-tie may go another way than XLA's product would). Sampled rows and the other heads still
        compute every logit.

    Attributes:
      runner: both caches' `ResourceRunner`; `local`, `global_` the managers.
      buckets: the prefill and decode walks' buckets.
      captures: the report of every capture so far; `late_captures` counts buckets captured while
        serving, because `capture` had not been called for their head.
    """

    def __init__(
        self,
        config: Gemma3Config,
        model: Gemma3,
        *,
        global_retention: SinkWindow,
        max_slots: int = 1,
        chunk: int = 128,
        batch_sizes: Sequence[int] = (1,),
        implementation: str = "auto",
        interpret=False,
        store: ExecutableStore | None = None,
        mesh: jax.sharding.Mesh | None = None,
        greedy_screen: bool = False,
    ):
        check_int("chunk", chunk, minimum=1)
        self.greedy_screen = check_bool("greedy_screen", greedy_screen)
        if greedy_screen:
            screen.require(mesh, model.embed_t[...].dtype)
        self.config, self.chunk, self.mesh = config, chunk, mesh
        local, global_ = cache_configs(
            config, global_retention=global_retention, max_slots=max_slots, dtype=model.embed_t[...].dtype
        )
        shards = {} if mesh is None else manager_shards(mesh)
        self.local, self.global_ = (
            BoundedKVManager(BoundedKVSpec(key, {"gemma3"}, cfg), num_sources=1, **shards)
            for key, cfg in ((LOCAL_KV, local), (GLOBAL_KV, global_))
        )
        self.runner = ResourceRunner({LOCAL_KV: self.local, GLOBAL_KV: self.global_})
        # On a mesh a bucket's batch size counts one data shard's rows.
        per_shard = max_slots // shards.get("data_shards", 1)
        sizes = cap_batch_sizes([b for b in batch_sizes if b < per_shard] or [per_shard], per_shard)
        self.buckets = Buckets((
            BucketSet(graph_walk=PREFILL, batch_sizes=sizes, token_counts=(chunk,)),
            BucketSet(graph_walk=DECODE, batch_sizes=sizes, token_counts=(1,)),
        ))  # fmt: skip
        self._graphdef, self.params = nnx.split(model)
        if greedy_screen:
            self.params = (self.params, screen.arrays(model.embed_t[...]))
        if mesh is not None:
            for manager in self.managers:
                place_on_mesh(manager, mesh)
            self.params = jax.device_put(self.params, NamedSharding(mesh, P()))
        self._fn = functools.partial(self.step, implementation=implementation, interpret=interpret)
        self._programs: dict[tuple[str, BucketKey], CapturedStep] = {}
        self._store = store
        self.captures: list[CaptureReport] = []
        self.late_captures = 0
        self._counter = 0

    @property
    def managers(self) -> tuple[BoundedKVManager, BoundedKVManager]:
        return self.local, self.global_

    @property
    def step_fn(self):
        """`step` with this instance's attention implementation bound (what its programs capture)."""
        return self._fn

    @property
    def store(self) -> ExecutableStore | None:
        """Where captured programs are loaded from and stored (None: compiled every time)."""
        return self._store

    @property
    def bytes_per_stream(self) -> int:
        """Device bytes one stream's slot holds in both caches, whatever its length."""
        return sum(m.cache.nbytes // m.cache.k[0].shape[0] for m in self.managers)

    def step(
        self, params, caches, banks, tables, tokens: jax.Array, lengths: jax.Array, targets: jax.Array,
        temperatures: jax.Array, seeds: jax.Array, *, head: str, implementation: str = "auto",
        interpret=False,
    ):  # fmt: skip
        """One step of every row: prefill chunks or one-token decode, the same code.

        Args:
          params: the model's state (`nnx.split`).
          caches, banks: (local, global) caches (donated) and source banks.
          tables: (local, global) plans (`BoundedKVPlan`), or their tables i32[B, ROW_INTS].
          tokens: i32[B, T]; row b's first `lengths[b]` are real.
          lengths: i32[B].
          targets: i32[B, T], the token each position is scored on (head `log_probs`; ignored otherwise).
          temperatures, seeds: f32[B], u32[B]: head `next` samples row b's token at temperature
            `temperatures[b]` (0: the argmax) from a key of its seed and position (`sample`); ignored
            otherwise.
          head: static, one of `HEADS`.

        Returns:
          (caches, per-row output as `HEADS` says, with a leading B axis).
        """
        state, screened = params if self.greedy_screen else (params, None)
        model = nnx.merge(self._graphdef, state)
        configs = (self.local.config, self.global_.config)
        plans = [t if isinstance(t, BoundedKVPlan) else BoundedKVPlan(t) for t in tables]
        positions = plans[0].positions(tokens.shape[1])

        layers = [
            layer_attention(
                config, bank, table, implementation=implementation, interpret=interpret, mesh=self.mesh
            )
            for config, bank, table in zip(configs, banks, plans, strict=True)
        ]

        def attend_fn(state, is_global, index, q, k, v):
            kind = int(is_global)
            out, cache = layers[kind](state[kind], index, q, k, v)
            return out, ((cache, state[1]) if kind == 0 else (state[0], cache))

        hidden, caches = model(tokens, positions, caches, attend_fn)
        if head == "next":
            last = jnp.maximum(lengths - 1, 0)
            hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
            at = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0]
            if screened is None:
                return caches, sample(model.logits(hidden), temperatures, seeds, at)
            greedy = screen.greedy(hidden, model.embed_t[...], screened)
            return caches, sample_or(greedy, lambda: model.logits(hidden), temperatures, seeds, at)
        logits = model.logits(hidden)
        if head == "logits":
            return caches, logits
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return caches, jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]

    # -- capture -----------------------------------------------------------------------------------

    def _abstract_args(self, bucket: BucketKey) -> tuple:
        rows, width = bucket.bs, bucket.num_tokens
        table = shaped((rows, tbl.ROW_INTS), jnp.int32)
        ids = shaped((rows, width), jnp.int32)
        return (
            abstract(self.params), abstract((self.local.cache, self.global_.cache)),
            abstract((self.local.bank, self.global_.bank)), (table, table), ids,
            shaped((rows,), jnp.int32), *step_extras(rows, width),
        )  # fmt: skip

    def capture(self, heads: Iterable[str] = ("next",), *, progress: bool = False) -> list[CaptureReport]:
        """Compile the step ahead of time for every bucket, once per head; serving then never compiles.

        Raises:
          ValueError: for a head not in `HEADS`.
        """
        reports, every_bucket = [], self.buckets.keys()
        for head in heads:
            if head not in HEADS:
                raise ValueError(f"head={head!r} must be one of {HEADS}")
            missing = [key for key in every_bucket if (head, key) not in self._programs]
            reports.append(self._capture(head, missing, progress))
        return [r for r in reports if r is not None]

    def _capture(self, head: str, keys: list[BucketKey], progress: bool) -> CaptureReport | None:
        if not keys:
            return None
        captured = capture(
            self._fn, keys, self._abstract_args, static_kwargs={"head": head}, donate_argnums=(1,),
            name=f"gemma3 {head}", progress=progress, store=self._store,
            fingerprint=(self.config, self.local.config, self.global_.config, self.greedy_screen),
        )  # fmt: skip
        self._programs.update(dict.fromkeys(((head, k) for k in keys), captured))
        self.captures.append(captured.report)
        return captured.report

    # -- one step ----------------------------------------------------------------------------------

    def declare(self, rows: Sequence[tuple[str, Sequence[int]]]) -> Declared:
        """The step of `rows` (request id, its step's tokens) on both caches, padded to its tightest
        bucket."""
        spans = [len(tokens) for _, tokens in rows]
        walk = DECODE if max(spans) == 1 else PREFILL
        bucket = self.buckets.bucket_for(walk, len(rows), max(spans))
        rids = [rid for rid, _ in rows]
        step = BoundedKVStep(
            tuple(Segment(rid, "main", span) for rid, span in zip(rids, spans, strict=True)),
            {rid: StreamPosition(0, self.local.written(rid)) for rid in rids},
            dict(zip(rids, spans, strict=True)),
        )
        return declare((LOCAL_KV, GLOBAL_KV), step, bucket)

    def run(
        self, rows: Sequence[tuple[str, Sequence[int]]], *, head: str = "next",
        targets: Sequence[Sequence[int]] | None = None,
    ) -> tuple[FullAdmitOutcome, list | None]:  # fmt: skip
        """Admit, plan, run and commit one step of `rows` (request id, its step's tokens) on both caches.

        Returns:
          (the runner's admission outcome, each row's output as `HEADS` says); the outputs are None and
          nothing changed when a cache refused the step (e.g. `AllocationFailed`: no free slot).
        """
        if head not in HEADS:
            raise ValueError(f"head={head!r} must be one of {HEADS}")
        if self.mesh is not None:
            raise RuntimeError(
                "Gemma3Streams.run runs on one device; serve a meshed Gemma3Streams with the engine "
                "(ServingEngine(Gemma3Serving(streams)))"
            )
        declared = self.declare(rows)
        outcome = admit(self.runner, declared)
        if not (outcome.ok and outcome.ready):
            return outcome, None
        padded, spans = declared.padded, [len(tokens) for _, tokens in rows]
        tokens = padded.pad([np.asarray(ids, np.int32) for _, ids in rows], dtype=np.int32)
        goals = np.zeros_like(tokens) if targets is None else padded.pad(
            [np.asarray(t, np.int32) for t in targets], dtype=np.int32
        )  # fmt: skip
        lengths = np.zeros(padded.num_rows, np.int32)
        lengths[list(padded.rows.values())] = spans
        greedy = np.zeros(padded.num_rows, np.float32), np.zeros(padded.num_rows, np.uint32)
        key = (head, declared.bucket)

        def replay(resources: Resources):
            if key not in self._programs:
                self.late_captures += 1
                self._capture(head, [declared.bucket], progress=False)
            tables = tuple(plan.table for plan in resources.plans)
            return self._programs[key].replay(
                declared.bucket,
                self.params,
                resources.caches,
                resources.banks,
                tables,
                tokens,
                lengths,
                goals,
                *greedy,
            )

        out = np.asarray(run_admitted(self.runner, declared, replay))
        if head == "next":
            return outcome, [int(x) for x in out[: len(rows)]]
        return outcome, [out[i, : spans[i]] for i in range(len(rows))]

    def open(self) -> str:
        """A new request id, ingested into both caches (its slot is claimed by its first step)."""
        self._counter += 1
        rid = f"stream{self._counter}"
        self.runner.ingest_request(rid)
        return rid

    def close(self, rid: str) -> None:
        """Give the request's slots back."""
        self.runner.remove_request(rid)

    def _run_one(self, rid: str, tokens: Sequence[int], **kwargs):
        outcome, out = self.run([(rid, tokens)], **kwargs)
        if out is None:
            raise RuntimeError(f"{outcome.failed_resource} refused the step: {outcome.reason}")
        return out[0]

    def _stream(self, tokens: np.ndarray, head: str, targets: np.ndarray | None = None) -> Iterator:
        """Stream `tokens` through one new request in chunks; yield each chunk's output. The request's
        slots are given back at the end."""
        rid = self.open()
        try:
            for start in range(0, len(tokens), self.chunk):
                end = start + self.chunk
                goals = None if targets is None else [targets[start:end]]
                yield self._run_one(rid, tokens[start:end], head=head, targets=goals)
        finally:
            self.close(rid)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """f32[len, V]: the next-token logits after each prefix of `tokens` (a short text: V floats each)."""
        return np.concatenate(list(self._stream(np.asarray(tokens, np.int32), "logits")))

    def score(self, tokens: Sequence[int]) -> np.ndarray:
        """Stream `tokens` through in chunks; return f64[len - 1] the log-probability of each token after
        the first given those before it (as the bounded caches retain them), at flat memory."""
        tokens = np.asarray(tokens, np.int32)
        if len(tokens) < 2:
            return np.zeros(0)
        pieces = self._stream(tokens[:-1], "log_probs", tokens[1:])
        return np.concatenate(list(pieces)).astype(np.float64)

    def greedy(self, prompt: Sequence[int], count: int) -> list[int]:
        """The `count` tokens greedy decoding appends to `prompt` (prefilled in chunks)."""
        prompt = np.asarray(prompt, np.int32)
        rid, out = self.open(), []
        try:
            for start in range(0, len(prompt), self.chunk):
                nxt = self._run_one(rid, prompt[start : start + self.chunk])
            for _ in range(count):
                out.append(nxt)
                if len(out) < count:
                    nxt = self._run_one(rid, [nxt])
        finally:
            self.close(rid)
        return out
