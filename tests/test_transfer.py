"""State adoption (elastic/transfer.broadcast) between two real processes: the receiver gets the
source's bytes exactly -- -0.0, float16, bool, uint64 included -- through one packed buffer, and every
leaf keeps its shape: a 0-d leaf (an optimizer's step count) that came back as shape (1,) once made the
next world compile another update program and leave the fault-free trajectory."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

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
        "k": np.array([2**63 + 5, 1], np.uint64), "h": np.ones((2, 2), np.float16) * (rank + 2),
        "count": np.array(rank + 3, np.int32), "t": rng.standard_normal((4, 3)).astype(np.float32).T}
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


def test_a_state_leaf_of_another_shape_is_refused_naming_the_leaf(tmp_path):
    # The second line of defence: a world only places a host state whose every leaf has the shape
    # and dtype of its own state, so a transport that reshapes a leaf fails loudly, not in the bits.
    import jax
    import numpy as np

    from resilient_jax.trainer import Trainer

    from conftest import tiny_config

    trainer = Trainer(tiny_config(tmp_path, "checkpoint.enabled=false"), devices=jax.devices()[:2])
    template = trainer.host_state_template()
    placed = trainer.state_from_host(template)
    assert jax.tree.map(np.shape, placed) == jax.tree.map(np.shape, template)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    index = next(i for i, (_, leaf) in enumerate(leaves) if np.ndim(leaf) == 0)  # a step count
    path = leaves[index][0]
    arrays = [leaf for _, leaf in leaves]
    arrays[index] = arrays[index].reshape(1)
    with pytest.raises(ValueError, match=re.escape(f"state leaf {jax.tree_util.keystr(path)} is int32[1]")):
        trainer.state_from_host(jax.tree.unflatten(treedef, arrays))


def test_to_host_rebuilds_every_layout_of_this_hosts_devices_bit_for_bit():
    # A survivor's copy of its state comes from its own shards: replicated over its devices (one
    # copy taken of each distinct slice), sharded along one axis, along two, on a sub-mesh, and 0-d.
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from resilient_jax.elastic import transfer

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    rng = np.random.default_rng(0)
    values = {"w": rng.standard_normal((8, 12)).astype(np.float32), "neg0": np.array([-0.0, 2.0], np.float32),
              "count": np.array(7, np.int32), "m": rng.standard_normal((4, 6)).astype(np.float16)}
    specs = {"w": P("data", "fsdp"), "neg0": P(), "count": P(), "m": P(None, "data")}
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in values.items()}
    placed["sub"] = jax.device_put(values["w"], NamedSharding(Mesh(np.array(jax.devices()[:2]), ("fsdp",)), P("fsdp")))
    values["sub"] = values["w"]
    host = transfer.to_host(placed)
    for name, want in values.items():
        got = host[name]
        assert isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == want.dtype, name
        assert got.tobytes() == want.tobytes(), name  # bits, -0.0 included
