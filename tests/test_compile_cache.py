"""The persistent compilation cache (resilient_jax.compile_cache) and cheap dataset re-checks at
later world formations (trainer.resolve_dataset with `verified`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import pytest

from resilient_jax import compile_cache, rng
from resilient_jax import state as state_lib
from resilient_jax.config import DataConfig, load_config
from resilient_jax.data import DatasetError, prepare_dataset
from resilient_jax.fingerprinting import params_fingerprint
from resilient_jax.trainer import Trainer, resolve_dataset

from conftest import REPO, TINY, tiny_config


def test_setting_names_the_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)  # the test session sets one
    assert compile_cache.cache_dir("auto", str(tmp_path)) == tmp_path / "compile_cache"
    assert compile_cache.cache_dir("", str(tmp_path)) is None
    assert compile_cache.cache_dir("off", str(tmp_path)) is None
    assert compile_cache.cache_dir("/shared/xla", str(tmp_path)) == Path("/shared/xla")


def test_a_relative_cache_dir_is_made_absolute_and_auto_keeps_its_meaning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(TINY, ["runtime.compile_cache=shared/xla"]).runtime.compile_cache == str(tmp_path / "shared/xla")
    assert load_config(TINY).runtime.compile_cache == "auto"
    assert load_config(TINY, ["runtime.compile_cache=off"]).runtime.compile_cache == "off"


def test_an_unwritable_cache_dir_is_one_warning_and_leaves_jax_uncached(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    before = jax.config.jax_compilation_cache_dir
    setup = compile_cache.enable(str(blocker / "cache"), str(tmp_path))
    assert setup.path is None
    assert setup.warning.startswith("warning: runtime.compile_cache: cannot write to ")
    assert str(blocker / "cache") in setup.warning and "\n" not in setup.warning
    assert jax.config.jax_compilation_cache_dir == before  # JAX was not pointed at it
    assert compile_cache.check(str(blocker / "cache"), str(tmp_path)) == setup.warning
    assert compile_cache.check("auto", str(tmp_path)) is None  # run.dir/compile_cache is writable


def test_a_cache_dir_another_account_can_write_is_one_warning_and_leaves_jax_uncached(tmp_path):
    # A cache entry is machine code the run executes: an entry planted by another account would run.
    import os

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    before = jax.config.jax_compilation_cache_dir
    setup = compile_cache.enable(str(shared), str(tmp_path))
    assert setup.path is None and jax.config.jax_compilation_cache_dir == before
    assert setup.warning == (f"warning: runtime.compile_cache: {shared} is not safe to load programs from (every "
                             "account can write to it (mode drwxrwxrwx)); compiling without a persistent cache "
                             "(use a directory only this account can write, e.g. chmod o-w, or \"off\")")
    assert compile_cache.check(str(shared), str(tmp_path)) == setup.warning
    shared.chmod(0o775)  # a group the administrator gave the training account is trusted, as for run.dir
    assert compile_cache.check(str(shared), str(tmp_path)) is None
    if os.geteuid() == 0:  # only root can give a directory away
        os.chown(shared, 65534, -1)
        assert "(it belongs to uid 65534, not to this account)" in compile_cache.check(str(shared), str(tmp_path))


def test_the_counter_tells_hits_from_compiles():
    counter = compile_cache.CacheCounter()
    counter.install()
    jax.monitoring.record_event(compile_cache.REQUEST_EVENT)  # a compile that looked and missed
    jax.monitoring.record_event(compile_cache.REQUEST_EVENT)  # one that looked and hit
    jax.monitoring.record_event(compile_cache.HIT_EVENT)
    assert counter.snapshot() == (1, 1)
    assert compile_cache.CompileRecord(0.1, 2, 0).cache_hit
    assert not compile_cache.CompileRecord(0.1, 1, 1).cache_hit
    assert not compile_cache.CompileRecord(0.1, 0, 0).cache_hit  # nothing looked in a cache
    assert compile_cache.CompileRecord(0.1, 1, 0).describe() == "1 program from the compile cache"
    assert compile_cache.CompileRecord(0.1, 1, 2).describe() == "2 programs compiled (not in the cache), 1 from the cache"


def test_a_fresh_state_is_compiled_once_by_the_compile_it_is_given_and_keeps_its_bits(tmp_path, default_dataset):
    # The elastic worker hands fresh_state its world's compile (rank 0 compiles, the others load):
    # the init program must reach it, be compiled there alone -- running it compiles nothing more --
    # and make the state the same init makes unsharded.
    trainer = Trainer(tiny_config(tmp_path / "run"), devices=jax.devices()[:8])
    inside = []

    def compile(lower):
        (program,) = lower()
        inside.append(compile_cache.timed_compile(program.compile))

    made = []
    whole = compile_cache.timed_compile(lambda: made.append(trainer.fresh_state(compiler=compile)))
    assert len(inside) == 1 and inside[0].cache_hits + inside[0].cache_misses == 1
    assert (whole.cache_hits, whole.cache_misses) == (inside[0].cache_hits, inside[0].cache_misses)
    # The bits of another program: the same init, unsharded, on one device.
    unsharded = jax.jit(lambda: state_lib._init(trainer.model_def, trainer.tx, rng.init_key(trainer.cfg.train.seed)))()
    assert params_fingerprint(made[0]) == params_fingerprint(unsharded)


def _dataset(tmp_path: Path) -> DataConfig:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    prepare_dataset(src, tmp_path / "ds", shards=3, seq_len=16)
    return DataConfig(dataset=str(tmp_path / "ds"), src=str(src), shards=3, seq_len=16)


def test_a_worlds_programs_compile_side_by_side_and_a_failed_compile_is_raised():
    # Two compiles that each wait for the other: only side by side do both get past the barrier
    # (one after the other, the first would wait out the timeout and break it).
    barrier = threading.Barrier(2, timeout=10)
    done = []

    class Program:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def compile(self):
            barrier.wait()
            if self.fail:
                raise ValueError(f"{self.name} does not compile")
            time.sleep(0.2)  # still compiling when the other one fails
            done.append(self.name)

    compile_cache.compile_all([Program("compute"), Program("apply")])
    assert sorted(done) == ["apply", "compute"]
    done.clear()
    with pytest.raises(ValueError, match="apply does not compile"):
        compile_cache.compile_all([Program("compute"), Program("apply", fail=True)])
    assert done == ["compute"]  # the other compile still finished before the error was raised
    # Real programs: compiled side by side (two compiles, each a cache lookup), each one is the
    # program its own jit then runs -- calling them compiles nothing more.
    f, g = jax.jit(lambda x: x * 3 + 1), jax.jit(lambda x: x.prod())
    x = jax.numpy.arange(1.0, 9.0)
    before = sum(compile_cache.COUNTER.snapshot())
    compile_cache.compile_all([f.lower(x), g.lower(x)])
    compiled = sum(compile_cache.COUNTER.snapshot())
    assert compiled - before == 2
    assert f(x).tolist() == [3 * i + 1 for i in range(1, 9)] and float(g(x)) == 40320.0
    assert sum(compile_cache.COUNTER.snapshot()) == compiled


def test_rank_0_alone_compiles_a_world_only_where_every_member_shares_its_machine_and_cache():
    one = ["boot-a /runs/x/compile_cache"] * 4
    assert compile_cache.leader_compiles(one, "cpu")  # one machine's cores, one cache dir
    assert not compile_cache.leader_compiles(one[:3] + ["boot-b /runs/x/compile_cache"], "cpu")  # own cores
    assert not compile_cache.leader_compiles(one[:3] + ["boot-a /elsewhere"], "cpu")  # another cache
    assert not compile_cache.leader_compiles(["boot-a "] * 4, "cpu")  # no cache: nothing to load
    assert not compile_cache.leader_compiles(one[:1], "cpu")  # nobody to wait
    assert not compile_cache.leader_compiles(one, "gpu")  # the same key on every rank: shown on CPU only
    machine, cache = compile_cache.placement().split(" ", 1)
    assert machine and cache == os.path.realpath(jax.config.jax_compilation_cache_dir)  # the session's cache


def test_a_dataset_verified_once_is_only_identity_checked_later(tmp_path):
    cfg = _dataset(tmp_path)
    verified = resolve_dataset(cfg)
    shard = verified.root / verified.shards[0].file
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only a full hash sees it
    shard.write_bytes(bytes(data))
    assert resolve_dataset(cfg, verified).version == verified.version  # no re-hash
    with pytest.raises(DatasetError):
        resolve_dataset(cfg)  # a first verification hashes every shard
    shard.write_bytes(bytes(data[:-1]))  # a size change is caught by the cheap check
    with pytest.raises(DatasetError):
        resolve_dataset(cfg, verified)


_COMPILE_ONCE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
from resilient_jax import compile_cache
setup = compile_cache.enable(sys.argv[1], sys.argv[2])
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(jax.devices(), ("data",))
x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("data")))
grad = jax.jit(jax.grad(lambda w: jnp.sum(jnp.tanh(w) ** 2)))
record = compile_cache.timed_compile(lambda: grad.lower(x).compile())
print(json.dumps({"path": str(setup.path), **record.to_event()}))
"""


@pytest.mark.slow
def test_a_second_process_loads_the_program_from_the_cache(tmp_path):
    def compile_in_new_process() -> dict:
        env = {k: v for k, v in os.environ.items() if k != compile_cache.ENV}  # "auto" = <run.dir>/compile_cache
        proc = subprocess.run([sys.executable, "-c", _COMPILE_ONCE, "auto", str(tmp_path)], capture_output=True,
                              text=True, cwd=REPO, timeout=300, check=True, env=env)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first, second = compile_in_new_process(), compile_in_new_process()
    assert first["path"] == str(tmp_path / "compile_cache")
    assert first["cache_misses"] >= 1 and first["cache_hits"] == 0 and not first["cache_hit"]
    assert second["cache_hit"] and second["cache_misses"] == 0


def test_auto_names_the_shared_directory_when_the_environment_sets_one(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "shared"))
    assert compile_cache.cache_dir("auto", str(tmp_path)) == tmp_path / "shared"
    assert compile_cache.cache_dir("/other", str(tmp_path)) == Path("/other")  # explicit beats the env
    assert compile_cache.cache_dir("off", str(tmp_path)) is None
    monkeypatch.setenv(compile_cache.ENV, "")
    assert compile_cache.cache_dir("auto", str(tmp_path)) == tmp_path / "compile_cache"


_COMPILE_IN_A_WORLD = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
from resilient_jax import compile_cache
compile_cache.enable(sys.argv[1], "unused")
jax.distributed.initialize(sys.argv[2], 2, int(sys.argv[3]))
import numpy as np
import jax.numpy as jnp
from jax._src import cache_key
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("data",))  # 4 devices over 2 processes: a gloo program
x = jax.make_array_from_callback((8, 4), NamedSharding(mesh, P("data")), lambda i: np.arange(32.0).reshape(8, 4)[i])
total = jax.jit(lambda x: jnp.sum(jnp.tanh(x)), out_shardings=NamedSharding(mesh, P()))
keys = []
original_get = cache_key.get
cache_key.get = lambda *a, **k: keys.append(original_get(*a, **k)) or keys[-1]
record = compile_cache.timed_compile(lambda: total.lower(x).compile())
value = float(total(x))
print(json.dumps({"key": keys[-1], "value": value, **record.to_event()}))
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_every_rank_of_a_world_loads_the_program_rank_0_cached(tmp_path):
    """JAX writes entries from process 0 only; rank 1 must compute the same key and load it."""
    from conftest import free_port

    def world() -> list[dict]:
        address = f"127.0.0.1:{free_port()}"
        procs = [subprocess.Popen([sys.executable, "-c", _COMPILE_IN_A_WORLD, str(tmp_path / "cache"), address,
                                   str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
                 for rank in range(2)]
        try:
            outs = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
        return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]

    cold, warm = world(), world()
    assert cold[0]["key"] == cold[1]["key"] == warm[0]["key"] == warm[1]["key"]
    # Rank 0 compiles (nothing is cached yet); rank 1 may already find rank 0's entry, if it came later.
    assert not cold[0]["cache_hit"]
    assert warm[0]["cache_hit"] and warm[1]["cache_hit"], warm  # rank 1 loads the entry rank 0 wrote
    assert {r["value"] for r in cold + warm} == {cold[0]["value"]}  # the loaded program computes the same
