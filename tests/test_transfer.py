"""State adoption (elastic/transfer.broadcast) between two real processes: the receiver gets the
source's bytes exactly -- -0.0, float16, bool, uint64 included -- through one packed buffer."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO, free_port

BROADCAST_BETWEEN_TWO_PROCESSES = """
import sys, hashlib
import numpy as np
import jax
rank, addr = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_enable_recoverability", True)
jax.config.update("jax_num_cpu_devices", 2)
from resilient_jax.elastic import world, transfer
svc = world.CoordinationService(addr, 2) if rank == 0 else None
world.join(addr, 2, rank)
rng = np.random.default_rng(rank)
tree = {"w": rng.standard_normal((3, 5)).astype(np.float32), "neg0": np.array([-0.0, 0.0], np.float32),
        "i": np.arange(7, dtype=np.int32) * (rank + 1), "b": np.array([True, False, rank == 0]),
        "k": np.array([2**63 + 5, 1], np.uint64), "h": np.ones((2, 2), np.float16) * (rank + 2)}
if rank == 0:
    tree["neg0"] = np.array([-0.0, 1.5], np.float32)
got = transfer.broadcast(tree, is_source=rank == 0)
digest = hashlib.sha256(b"".join(np.ascontiguousarray(got[k]).tobytes() + str(got[k].dtype).encode() + str(got[k].shape).encode() for k in sorted(got))).hexdigest()
src = hashlib.sha256(b"".join(np.ascontiguousarray(tree[k]).tobytes() + str(tree[k].dtype).encode() + str(tree[k].shape).encode() for k in sorted(tree))).hexdigest()
print(f"rank {rank} got {digest} own {src}", flush=True)
world.leave()
if svc: svc.shutdown()
"""


def test_broadcast_gives_every_process_the_sources_bytes(tmp_path):
    script = tmp_path / "broadcast.py"
    script.write_text(BROADCAST_BETWEEN_TWO_PROCESSES)
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), address], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    (source_got, source_own), = re.findall(r"^rank 0 got (\w+) own (\w+)$", outs[0], re.M)
    (other_got, other_own), = re.findall(r"^rank 1 got (\w+) own (\w+)$", outs[1], re.M)
    assert source_got == source_own == other_got  # everyone ends with the source's tree, bit for bit
    assert other_own != source_own  # the receiver's own tree differed, so this proves a transfer
