"""Child process of `test_store.py` on 8 simulated CPU devices: programs stored and loaded back where the
process has more devices than a program runs on, or a mesh's devices are not in id order. Prints one JSON
line: per program, the stores' counts and whether the loaded program computes what the compiled one did.

Run with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the parent sets it).
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mstar_jax.compile import BucketSet, ExecutableStore, capture

BUCKETS = BucketSet(graph_walk="tiny", batch_sizes=(8,), token_counts=(4,))


def _step(state, x):
    state = state + jnp.tanh(x).sum()
    return state, x * state


def _served(sharding, directory: str) -> dict:
    """Capture twice into one store (the second loads) and run both on the same inputs."""

    def abstract(bucket):
        x = jax.ShapeDtypeStruct((bucket.bs, bucket.num_tokens), jnp.float32, sharding=sharding)
        return jax.ShapeDtypeStruct((), jnp.float32, sharding=scalar), x

    scalar = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else sharding
    bucket = next(iter(BUCKETS))
    x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4) / 9, sharding)
    outputs, stores = [], []
    for _ in range(2):
        jax.clear_caches()
        store = ExecutableStore(directory)
        step = capture(_step, BUCKETS, abstract, donate_argnums=0, progress=False, store=store)
        state = jax.device_put(jnp.asarray(1.0, jnp.float32), scalar)
        new_state, out = step.replay(bucket, state, x)
        outputs.append((float(new_state), np.asarray(out).tolist()))
        stores.append([store.saved, store.loaded, store.rejected])
    return {"stores": stores, "equal": outputs[0] == outputs[1], "out": outputs[1][1]}


def main() -> None:
    devices = jax.devices()
    reversed_mesh = jax.sharding.Mesh(np.array(devices[::-1]).reshape(4, 2), ("data", "model"))
    cases = {
        "one device": jax.sharding.SingleDeviceSharding(devices[0]),
        "another single device": jax.sharding.SingleDeviceSharding(devices[5]),
        "mesh in reversed order": NamedSharding(reversed_mesh, P("data", "model")),
    }
    results = {}
    for name, sharding in cases.items():
        with tempfile.TemporaryDirectory() as directory:
            results[name] = _served(sharding, directory)
        print(name, "done", file=sys.stderr, flush=True)  # which case a crash came in
    print(json.dumps(results))


if __name__ == "__main__":
    main()
