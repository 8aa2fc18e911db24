"""Wait until the Ray cluster at ADDRESS has its head and WORKERS worker nodes (nodes advertising the
`resilient_jax_host` resource), or fail in one line after --timeout seconds.

    python scripts/slurm/wait_for_ray.py HEAD_IP:PORT WORKERS [--timeout 600]

scripts/slurm/train.sbatch runs it between starting Ray on every node and starting the driver: a
node whose `ray start` is slow (a cold filesystem, a busy node) then delays the run instead of
failing it with "N of M alive nodes can run a worker". Ray token authentication comes from the
environment (RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH), as for every other Ray process of the job.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

WORKER_RESOURCE = "resilient_jax_host"  # resilient_jax.elastic.ray_placement's worker resource


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("workers", type=int)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    host, _, port = args.address.rpartition(":")
    if not host or not port.isdigit():
        parser.exit(2, f"error: {args.address!r} is not HOST:PORT (the Ray head's GCS address, e.g. 10.0.0.5:6379)\n")
    deadline = time.monotonic() + args.timeout
    while True:  # the head's GCS port first: ray.init itself waits minutes on an address with no GCS
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
            break
        except OSError as e:
            if time.monotonic() > deadline:
                print(f"error: no Ray head answered at {args.address} within {args.timeout:g} s ({e}); see the "
                      "head's `ray start` output above", file=sys.stderr)
                return 1
            time.sleep(2)
    import ray

    try:
        ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 -- Ray raises ConnectionError, RuntimeError, its AuthenticationError
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: cannot attach to the Ray cluster at {args.address}: {reason} (is RAY_AUTH_TOKEN_PATH the "
              "token file the nodes were started with?)", file=sys.stderr)
        return 1
    try:
        while True:
            have = sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(WORKER_RESOURCE))
            if have >= args.workers:
                print(f"ray: {have} worker nodes registered at {args.address}", flush=True)
                return 0
            if time.monotonic() > deadline:
                print(f"error: {have} of {args.workers} Ray worker nodes registered at {args.address} within "
                      f"{args.timeout:g} s; see the `ray start` output above for the nodes that did not",
                      file=sys.stderr)
                return 1
            time.sleep(2)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
