"""The streaming TTS model's compiled programs: one per graph walk and bucket, captured at load time.

Walks and their buckets (`B` the batch sizes):

- `talker_decode`: B x (K,): a block of K one-token decode steps per program (`decode_steps`,
  `mstar_jax.serving.steps`; K = 1 is one step);
- `talker_prefill`: B x (the largest token count,): prompts are read in chunks of that many tokens,
  a shorter last chunk padded (one program per batch size rather than one per token count: on a
  CPU each costs seconds to compile);
- `talker_mixed`: the combined walk, B x the prefill token counts, each bucket with room for
  `max_prefill_rows(B)` prefill rows beside its B decode rows (only with K = 1: a block's K steps and a
  prefill chunk do not share a program);
- `flow_chunk`: B x (the smallest token count holding a whole flow chunk,).

Every program takes `(params, cache, bank, plan, *inputs)` with the cache donated, and is compiled for
the model's `settings` (the steps' static argument), so `TTSPrograms` built for one cache geometry serve
any engine whose managers have that geometry and whose model has those settings (tests share them); an
engine refuses programs captured for other settings (`SettingsMismatchError`).

The talker programs take the previous talker step's codes as they are on the device, so a pipelined
engine can dispatch step t + 1 before it reads step t: their inputs begin `prev_codes i32[C, K], feed
i32[B]` (for the combined walk `feed i32[Bd]`, its decode rows), and a decode row with `feed[b] >= 0`
reads its input token from `prev_codes` flattened, at `feed[b]`, instead of its host token. Every talker
program returns its codes padded to the same `[C, K]` (`codes_width`; a prefill row's code in column 0,
a block row's K codes in order), whatever its bucket, so any program's codes feed any other's (on a
mesh, whose engine never feeds, they stay as they are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.checks import check_int
from mstar_jax.compile import (
    Buckets,
    BucketSet,
    CapturedStep,
    CaptureReport,
    CombinedRows,
    ExecutableStore,
    capture,
    describe,
)
from mstar_jax.models.streaming_tts.model import (
    FLOW_CHUNK,
    MIXED_SPLIT,
    TALKER_DECODE,
    TALKER_MIXED,
    TALKER_PREFILL,
    StreamingTTSModel,
    flow_step,
    talker_combined_step,
    talker_step,
)
from mstar_jax.models.streaming_tts.settings import StreamingTTSSettings
from mstar_jax.resources.kv.bounded.cache import BoundedKVPlan
from mstar_jax.resources.kv.bounded.manager import BoundedKVManager
from mstar_jax.resources.kv.bounded.sharding import DATA
from mstar_jax.resources.step import BucketKey
from mstar_jax.serving import feed
from mstar_jax.serving.abstract import abstract, shaped
from mstar_jax.serving.steps import decode_block

__all__ = ["SettingsMismatchError", "TTSPrograms", "codes_width", "fed", "tts_buckets"]

WALKS = (TALKER_DECODE, TALKER_PREFILL, TALKER_MIXED, FLOW_CHUNK)


def tts_buckets(
    *,
    batch_sizes: Sequence[int],
    token_counts: Sequence[int],
    flow_chunk: int,
    max_prefill_rows_in_combined: int | None = 1,
    combined: bool = True,
    decode_steps: int = 1,
) -> Buckets:
    """The buckets of the four walks (three without the combined walk).

    Args:
      batch_sizes: rows per program, strictly increasing (the largest is the engine's max batch).
      token_counts: per-row token buckets, strictly increasing; the largest is the prefill chunk size.
      flow_chunk: frames per flow chunk; the flow compiles at the smallest token count holding it.
      max_prefill_rows_in_combined: prefill rows a combined step makes room for (None: as many as it
        has rows).
      combined: whether to capture the combined walk (else decode and prefill run as separate steps).
      decode_steps: K, the one-token decode steps a decode program runs (`EngineSettings.decode_steps`);
        the combined walk needs K = 1.

    Raises:
      ValueError: when no token count holds a flow chunk, for a combined walk with K > 1, or for
        `decode_steps` or `max_prefill_rows_in_combined` not an int in range.
    """
    check_int("decode_steps", decode_steps, minimum=1)
    check_int("max_prefill_rows_in_combined", max_prefill_rows_in_combined, minimum=0, allow_none=True)
    if combined and decode_steps > 1:
        raise ValueError(
            f"decode_steps={decode_steps} runs a decode block of its own program; the combined walk needs "
            "decode_steps=1 (pass combined=False)"
        )
    prefill_tokens = (max(token_counts),)
    flow_tokens = [t for t in token_counts if t >= flow_chunk]
    if not flow_tokens:
        raise ValueError(
            f"token_counts={list(token_counts)} has no bucket of >= flow_chunk={flow_chunk} frames; add "
            f"{flow_chunk} to compile.token_counts"
        )
    mixed = BucketSet.combined(
        MIXED_SPLIT,
        batch_sizes=batch_sizes,
        token_counts=prefill_tokens,
        max_rows_in_combined={TALKER_PREFILL: max_prefill_rows_in_combined},
    )
    return Buckets(
        (
            BucketSet(graph_walk=TALKER_DECODE, batch_sizes=tuple(batch_sizes), token_counts=(decode_steps,)),
            BucketSet(graph_walk=TALKER_PREFILL, batch_sizes=tuple(batch_sizes), token_counts=prefill_tokens),
            *((mixed,) if combined else ()),
            BucketSet(graph_walk=FLOW_CHUNK, batch_sizes=tuple(batch_sizes), token_counts=(flow_tokens[0],)),
        )
    )


def fed(step, *, width: int, steps: int = 1, sharding=None):
    """`step` (a talker step function) reading fed decode tokens from `prev_codes`, its codes padded to
    `[width, steps]` and placed by `sharding` (on a mesh: replicated, where every program reads them).

    A fed row's token is `text_vocab_size + prev_codes[feed]`, as the talker node writes it on the host
    (`mstar_jax.serving.feed.fed`).
    """
    return feed.fed(step, width=width, offset=_code_token_offset, steps=steps, sharding=sharding)


def _code_token_offset(*, settings: StreamingTTSSettings) -> int:
    return settings.config.text_vocab_size


def codes_width(buckets: Buckets, shards: int = 1) -> int:
    """`C`: the most rows any talker program runs (all data shards' on a mesh)."""
    rows = [
        key.bs + (key.cg_key_info.prefill_rows if isinstance(key.cg_key_info, CombinedRows) else 0)
        for walk in buckets.walks if walk != FLOW_CHUNK for key in buckets[walk]
    ]  # fmt: skip
    return shards * max(rows)


class SettingsMismatchError(ValueError):
    """Programs were captured for other model settings than those of the model meant to run them.

    Attributes:
      differences: `(name, captured, this model's)` for each setting that differs
        (`StreamingTTSSettings.differences`).
    """

    def __init__(self, differences: tuple[tuple[str, Any, Any], ...]):
        self.differences = differences
        shown = "; ".join(
            f"{name}: captured for {_show(captured)}, this model has {_show(own)}"
            for name, captured, own in differences
        )
        super().__init__(
            f"programs were captured for another model ({shown}); capture them for this model "
            "(TTSPrograms.capture(model, ...)), or build the model with the settings they were captured for"
        )


def _show(value: Any) -> str:
    text = describe(value)  # a mesh by its device ids too, which its repr leaves out
    return text if len(text) <= 200 else f"{text[:200]}..."


@dataclasses.dataclass(frozen=True, eq=False)
class TTSPrograms:
    """Every walk's `CapturedStep`, and the buckets they were captured for.

    Build with `TTSPrograms.capture`. `codes_width` is `C` of the module docstring; `settings` are the
    model's settings the programs were compiled for, which an engine checks its own model's against
    (`check`).
    """

    buckets: Buckets
    steps: dict[str, CapturedStep]
    codes_width: int
    settings: StreamingTTSSettings

    @property
    def decode_steps(self) -> int:
        """K: the one-token steps each decode program runs (its bucket's tokens)."""
        return self.buckets.max_tokens(TALKER_DECODE)

    def check(self, settings: StreamingTTSSettings) -> None:
        """Raise `SettingsMismatchError` unless the programs were captured for `settings`."""
        if settings != self.settings:
            raise SettingsMismatchError(self.settings.differences(settings))

    @classmethod
    def capture(
        cls,
        model: StreamingTTSModel,
        buckets: Buckets,
        *,
        talker: BoundedKVManager,
        flow: BoundedKVManager,
        progress: bool = True,
        max_workers: int = 1,
        store: ExecutableStore | None = None,
    ) -> TTSPrograms:
        """Compile every bucket of every walk ahead of time, from abstract arguments only (or load it).

        Args:
          model: its weights and `settings`, which every program is compiled for.
          buckets: from `tts_buckets`.
          talker, flow: managers whose cache and bank shapes the programs are compiled for.
          progress: one tqdm bar per walk.
          max_workers: buckets compiled at once (threads; XLA compiles without the GIL).
          store: load each program from here where it was stored before, and store those compiled.
        """
        mesh = model.mesh
        sharded = mesh is not None
        # On a mesh a bucket's rows are per data shard: its arrays hold every shard's, split on `data`.
        shards = 1 if mesh is None else mesh.shape[DATA]
        rows_sharding = None if mesh is None else NamedSharding(mesh, P(DATA))
        block_sharding = None if mesh is None else NamedSharding(mesh, P(None, DATA))  # [K, rows, ...]
        steps = buckets.max_tokens(TALKER_DECODE)
        talker_state = tuple(
            abstract(x, sharded=sharded) for x in (model.talker_params, talker.cache, talker.bank)
        )
        flow_state = tuple(abstract(x, sharded=sharded) for x in (model.flow_params, flow.cache, flow.bank))
        i32, u32 = jnp.int32, jnp.uint32

        def plan(rows: int, key: BucketKey) -> BoundedKVPlan:  # the manager's plan of a step in `key`
            return BoundedKVPlan.abstract(shards * rows, key.num_tokens, rows_sharding)

        def rows_of(bs: int, *shape: int, dtype=i32) -> jax.ShapeDtypeStruct:
            return shaped((shards * bs, *shape), dtype, rows_sharding)

        width = codes_width(buckets, shards)
        prev_codes = shaped((width, steps), i32, None if mesh is None else NamedSharding(mesh, P()))

        def plain(key: BucketKey) -> tuple:
            bs, t = key.bs, key.num_tokens
            return (
                *talker_state, plan(bs, key), prev_codes, rows_of(bs),
                rows_of(bs, t), rows_of(bs), rows_of(bs, dtype=u32),
            )  # fmt: skip

        def block(key: BucketKey) -> tuple:  # K one-token steps: one table each, one input token a row
            bs = key.bs
            table = BoundedKVPlan.abstract(shards * bs, 1, block_sharding, steps=key.num_tokens)
            return (
                *talker_state, table, prev_codes, rows_of(bs), rows_of(bs, 1), rows_of(bs),
                rows_of(bs, dtype=u32),
            )  # fmt: skip

        def mixed(key: BucketKey) -> tuple:
            rows: CombinedRows = key.cg_key_info
            d, p, t = rows.decode_rows, rows.prefill_rows, key.num_tokens
            return (
                *talker_state, plan(d + p, key), prev_codes, rows_of(d), rows_of(d, 1), rows_of(d),
                rows_of(p, t), rows_of(p), rows_of(d + p, dtype=u32),
            )  # fmt: skip

        def chunk(key: BucketKey) -> tuple:
            bs, t = key.bs, key.num_tokens
            return (*flow_state, plan(bs, key), rows_of(bs, t), rows_of(bs, dtype=u32))

        # Every talker program returns its codes [C, K] where the next one reads them (`feed.fed`).
        feeding = {"width": width, "sharding": None if mesh is None else NamedSharding(mesh, P())}
        decode = (
            (fed(talker_step, **feeding), plain) if steps == 1 else
            (fed(decode_block(talker_step, steps=steps, offset=_code_token_offset), steps=steps, **feeding),
             block)
        )  # fmt: skip
        plans = {
            TALKER_DECODE: decode,
            TALKER_PREFILL: (fed(talker_step, steps=steps, **feeding), plain),
            TALKER_MIXED: (fed(talker_combined_step, **feeding), mixed),
            FLOW_CHUNK: (flow_step, chunk),
        }
        steps = {}
        # A static argument: what the store's keys describe, so nothing else needs a fingerprint.
        static = {"settings": model.settings}
        for walk in buckets.walks:
            fn, arguments = plans[walk]
            steps[walk] = capture(
                fn, buckets[walk].keys(), arguments, static_kwargs=static, donate_argnums=1, name=walk,
                progress=progress, max_workers=max_workers, store=store, frozen_argnums=(0,),
            )  # fmt: skip
        return cls(buckets=buckets, steps=steps, codes_width=width, settings=model.settings)

    @property
    def reports(self) -> list[CaptureReport]:
        return [step.report for step in self.steps.values()]

    @property
    def compile_secs(self) -> float:
        return sum(report.compile_secs + report.lower_secs for report in self.reports)

    @property
    def wall_secs(self) -> float:
        return sum(report.wall_secs for report in self.reports)
