"""One process of `test_multiprocess_engine.py`'s job: two processes of 4 simulated CPU devices serving one
workload on one `(data=4, model=2)` mesh, each its own half of the requests (`mesh_child.serve`'s
workload, request `i` on process `i % 2`): one frame a dispatch, process 1's requests submitted only once
process 0 decodes (decode and prefill rows together on the combined walk when they meet); blocks of 4;
blocks of 4 pipelined; one frame a dispatch with snapshots and a fault in process 0; and with a stream of
each process offloaded and reloaded. Prints one JSON line: its shards, each of its requests' codes and
audio, compilations after warm-up, the steps it entered with no rows, the walks it ran with rows, its
report's mesh, and the same of the other runs (the pipelined one's overlap counters, the faulty one's
fault and snapshot counters, the offloading one's offloads and reloads).

Run as `python -m tests.engine.multiprocess_child` with the `MSTAR_*` variables set (the test does).
"""

from __future__ import annotations

import collections
import functools
import tempfile

from mstar_jax.distributed import DistributedSettings, initialize
from tests.simulated_devices import report_as_process


def main() -> dict:
    initialize(DistributedSettings.from_env(initialization_timeout_s=60))
    # Imported after joining: nothing may start a JAX backend before `initialize`.
    import jax

    from mstar_jax.models.streaming_tts.report import summarize
    from tests.engine.mesh_child import MODEL
    from tests.engine.mesh_child import serve as serve_on_mesh

    share = (jax.process_index(), jax.process_count())
    # JAX's persistent compilation cache, one folder a process (a job of many processes keeps no
    # executable store): the runs below share most programs, so each is compiled once a process.
    cache = tempfile.TemporaryDirectory(prefix="mesh-cache-")  # removed once `main` returns
    serve = functools.partial(serve_on_mesh, cache_dir=cache.name)
    # Decode blocks of 4: the processes agree on one bucket a block, not one a token.
    block_engine, block_served = serve(4, 2, MODEL, share=share, decode_steps=4)
    # Pipelined: each process dispatches a step before it reads the last; the codes feed on the device.
    piped_engine, piped_served = serve(4, 2, MODEL, share=share, decode_steps=4, pipelined=True)
    # Snapshots every 3 steps, taken by both processes at once; process 0's 5th talker step fails after
    # consuming its caches, and it restores its own shards from its last snapshot and replays.
    schedule = (lambda n: "after" if n == 5 else None) if share[0] == 0 else (lambda n: None)
    faulty_engine, faulty_served = serve(
        4, 2, MODEL, share=share, snapshot_every=3, faults=("talker", schedule)
    )  # fmt: skip
    # Each process offloads one of its own streams after 4 steps, through its own shards; it comes
    # back when next admitted.
    moved_engine, moved_served = serve(4, 2, MODEL, share=share, offload_at=4)
    # One frame a dispatch, the run the others are compared with. Process 1 submits its three requests
    # only after 3 steps, while process 0 decodes: at 4 rows a step its new rows are all prefill rows,
    # two on one shard, more than a combined step has room for.
    engine, served = serve(4, 2, MODEL, share=share, late_after=3, max_batch=4)
    report = summarize(engine, wall_secs=1.0, capture_secs=1.0, warmup_compilations=0)
    errors = sorted({s.error for s in engine.finished.values() if s.error})
    return {
        "process": jax.process_index(),
        "lockstep": engine.lockstep,
        "local_shards": list(engine.talker.local_data_shards),
        "served": {rid: [codes, audio.tolist()] for rid, (codes, audio) in served.items()},
        "done": report["streams"]["done"],
        "errors": errors,
        "compilations": engine.compilations,
        "empty_steps": engine.stats.lockstep_empty_steps,
        "walks": dict(collections.Counter(r.walk for r in engine.records)),
        "mesh": report["mesh"],
        "blocks": {
            "served": {rid: [codes, audio.tolist()] for rid, (codes, audio) in block_served.items()},
            "compilations": block_engine.compilations,
            "decode_tokens": sorted(
                {r.bucket.num_tokens for r in block_engine.records if r.walk == "talker_decode"}
            ),
            "decode_dispatches": sum(r.walk == "talker_decode" for r in block_engine.records),
            "decode_dispatches_one_step": sum(
                r.walk in ("talker_decode", "talker_mixed") for r in engine.records
            ),
        },
        "pipelined": {
            "served": {rid: [codes, audio.tolist()] for rid, (codes, audio) in piped_served.items()},
            "compilations": piped_engine.compilations,
            "errors": sorted({s.error for s in piped_engine.finished.values() if s.error}),
            "overlap": piped_engine.stats.pipeline(),
            "in_flight_after": piped_engine.drain(),
        },
        "offloaded": {
            "served": {rid: [codes, audio.tolist()] for rid, (codes, audio) in moved_served.items()},
            "errors": sorted({s.error for s in moved_engine.finished.values() if s.error}),
            "offloads": moved_engine.stats.offloads,
            "reloads": moved_engine.stats.reloads,
            "compilations": moved_engine.compilations,
        },
        "faulty": {
            "served": {rid: [codes, audio.tolist()] for rid, (codes, audio) in faulty_served.items()},
            "errors": sorted({s.error for s in faulty_engine.finished.values() if s.error}),
            "counters": {
                name: getattr(faulty_engine.stats, name)
                for name in ("faults", "snapshots", "requests_lost", "requests_restored")
            },
            "steps_run": faulty_engine.steps_run,
            "compilations": faulty_engine.compilations,
        },
    }


if __name__ == "__main__":
    report_as_process(main)
