"""JAX's persistent compilation cache: where it lives, switching it on, and counting its hits.

Why: a new world recompiles its step from scratch, because leaving a world clears the backends and
with them JAX's in-memory caches -- that compile was nearly all of a recovery's time. The cache on
disk survives `clear_backends`, so a world size this run (or any run sharing the directory) has
compiled before is loaded instead of compiled. JAX writes entries atomically (temp file + rename),
so the processes of one world, and several runs, may share a directory.

Every process of a world loads the same entry: JAX (0.10.2) writes entries from process 0 only,
and keys them on, among others, a fingerprint of the devices' topology, which on CPU describes the
calling process's own devices -- so each rank of a gloo world computed a different key and only
rank 0 ever hit (measured: cpu-4host rerun, rank 0 7.3 s from the cache, ranks 1-3 compiling for
50-54 s). `enable` makes that part of the key the same on every rank (see `_same_key_on_every_rank`).
Each worker logs its own compile line; the metrics.jsonl `compile` event is rank 0's.

`runtime.compile_cache`: "auto" = $RESILIENT_JAX_COMPILE_CACHE if set (one directory for every run
of a user, a CI job or a test session), else <run.dir>/compile_cache; "" or "off" = no persistent
cache; any other value = that directory (e.g. one shared by several runs). An unwritable
directory is a warning, not an error: the run compiles as it would without the cache. So is one
another account could write to (owned by another user, or writable by every account): a cache
entry is machine code the run would execute.

Hits are counted from JAX's own monitoring events: `compile_requests_use_cache` (a compile that
looked in the cache) and `cache_hits`; a miss is a request without a hit. (JAX's own
`cache_misses` event is recorded only where an entry is written, and only process 0 of a world
writes, so it cannot be counted on the other processes.)
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
DISABLED = ("", "off")
SUBDIR = "compile_cache"  # under run.dir, for "auto"
ENV = "RESILIENT_JAX_COMPILE_CACHE"  # where "auto" points when set

REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
HIT_EVENT = "/jax/compilation_cache/cache_hits"


def cache_dir(setting: str, run_dir: str) -> Path | None:
    """The directory `runtime.compile_cache` names, or None when the cache is off."""
    if setting in DISABLED:
        return None
    if setting != AUTO:
        return Path(setting)
    return Path(os.environ[ENV]) if os.environ.get(ENV) else Path(run_dir) / SUBDIR


def unwritable_reason(path: Path) -> str | None:
    """Why nothing can be written under `path`, or None if it can.

    Nothing is created: JAX makes the directory at the first compile, after start-up has checked
    the run, so a run refused at start-up leaves no cache directory behind. A missing directory is
    probed at its nearest existing ancestor (where it would be made)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".probe-"):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def unwritable_warning(path: Path, reason: str) -> str:
    return (f"warning: runtime.compile_cache: cannot write to {path} ({reason}); compiling without "
            "a persistent cache (set runtime.compile_cache to a writable directory, or \"off\")")


def foreign_writer(path: Path) -> str | None:
    """Who else could put an entry in the cache directory, or None: an entry is machine code the run
    executes, so the directory must be this account's and not writable by everyone (a group the
    administrator gave it is trusted, as for run.dir). A missing directory is JAX's to make: ours."""
    try:
        st = path.stat()
    except OSError:
        return None
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this account"
    if st.st_mode & stat.S_IWOTH:
        return f"every account can write to it (mode {stat.filemode(st.st_mode)})"
    return None


def unsafe_warning(path: Path, reason: str) -> str:
    return (f"warning: runtime.compile_cache: {path} is not safe to load programs from ({reason}); compiling "
            "without a persistent cache (use a directory only this account can write, e.g. chmod o-w, or \"off\")")


def _refusal(path: Path) -> str | None:
    """The one-line warning that keeps the cache off at `path`, or None if it may be used."""
    if reason := unwritable_reason(path):
        return unwritable_warning(path, reason)
    if reason := foreign_writer(path):
        return unsafe_warning(path, reason)
    return None


def check(setting: str, run_dir: str) -> str | None:
    """The one-line warning for a cache directory that cannot be used (unwritable, or writable by
    others), or None (fine, or off); for a process that does not compile itself (the elastic
    driver) to warn on its console once."""
    path = cache_dir(setting, run_dir)
    return _refusal(path) if path is not None else None


@dataclass(frozen=True)
class CacheSetup:
    path: Path | None  # the directory in use; None: this process compiles uncached
    warning: str | None = None  # set when the configured directory cannot be used


def enable(setting: str, run_dir: str) -> CacheSetup:
    """Point this process's JAX at the cache directory; must run before the first compile.

    Caches every program, however small or fast to compile (JAX's defaults skip programs that
    compile in under a second, i.e. most of a small model's step). An unwritable directory leaves
    JAX untouched and returns the warning for the caller to show once.
    """
    path = cache_dir(setting, run_dir)
    if path is None:
        return CacheSetup(None)
    if warning := _refusal(path):
        return CacheSetup(None, warning)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _same_key_on_every_rank()
    COUNTER.install()
    return CacheSetup(path)


def _same_key_on_every_rank() -> None:
    """Key a CPU program's cache entry on facts every rank of the world shares, so ranks 1..N-1
    load the entry rank 0 wrote instead of compiling (JAX writes from process 0 only).

    JAX hashes `xla_client.get_topology_for_devices(devices).fingerprint()`, which on CPU differs
    per process (the topology of the calling process's devices) -- no config flag changes that in
    0.10.2; `jax_share_binary_between_hosts` needs equal keys too. For CPU devices we hash instead
    each device's kind and owning process, in order: the same on every rank, and a layout of the
    same devices over other processes still gets another key (the compile options, also hashed,
    carry the device assignment). Other platforms keep JAX's hash. Private API
    (jax._src.cache_key._hash_accelerator_config / _hash_devices): tests/test_private_apis.py fails
    when it moves; tests/test_compile_cache.py checks two ranks get one key and both hit.
    """
    from jax._src import cache_key

    jax_hash = cache_key._hash_accelerator_config
    if getattr(jax_hash, "resilient_jax", False):
        return  # already in place (enable runs once per world formation)

    def hash_accelerator_config(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if not all(d.platform == "cpu" for d in devices):
            return jax_hash(hash_obj, accelerators)
        for device in devices:
            cache_key._hash_string(hash_obj, f"{device.device_kind}@process{device.process_index}")

    hash_accelerator_config.resilient_jax = True
    hash_accelerator_config.__wrapped__ = jax_hash  # JAX's own, for tests/test_private_apis.py
    cache_key._hash_accelerator_config = hash_accelerator_config


class CacheCounter:
    """This process's persistent-cache hits and misses, from JAX's monitoring events."""

    def __init__(self):
        self.requests = 0
        self.hits = 0
        self._lock = threading.Lock()  # compiles may run on several threads
        self._installed = False

    def install(self) -> None:
        """Listen to JAX's events (once per process; JAX keeps listeners for the process's life)."""
        with self._lock:
            if self._installed:
                return
            self._installed = True
        import jax

        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == REQUEST_EVENT:
            with self._lock:
                self.requests += 1
        elif event == HIT_EVENT:
            with self._lock:
                self.hits += 1

    def snapshot(self) -> tuple[int, int]:
        """(hits, misses) so far."""
        with self._lock:
            return self.hits, self.requests - self.hits


COUNTER = CacheCounter()


@dataclass(frozen=True)
class CompileRecord:
    """One compile phase: its seconds, and how many programs it loaded from the cache / compiled."""

    seconds: float
    cache_hits: int
    cache_misses: int

    @property
    def cache_hit(self) -> bool:
        """Every program this phase compiled came from the cache (False when it compiled none)."""
        return self.cache_hits > 0 and self.cache_misses == 0

    def describe(self) -> str:
        if self.cache_hit:
            return f"{_programs(self.cache_hits)} from the compile cache"
        if self.cache_misses:
            return f"{_programs(self.cache_misses)} compiled (not in the cache), {self.cache_hits} from the cache"
        return "no persistent compile cache"

    def to_event(self) -> dict:
        return {"seconds": self.seconds, "cache_hit": self.cache_hit, "cache_hits": self.cache_hits,
                "cache_misses": self.cache_misses}


def _programs(count: int) -> str:
    return f"{count} program{'' if count == 1 else 's'}"


def timed_compile(compile_fn) -> CompileRecord:
    """Run `compile_fn()` and say how long it took and what the cache did meanwhile."""
    hits0, misses0 = COUNTER.snapshot()
    t0 = time.perf_counter()
    compile_fn()
    seconds = time.perf_counter() - t0
    hits1, misses1 = COUNTER.snapshot()
    return CompileRecord(seconds, hits1 - hits0, misses1 - misses0)


def compile_all(programs: list) -> None:
    """Compile `programs` (traced and lowered: jax.stages.Lowered) side by side, one thread each.

    Why: XLA compiles one program on about 1.5 cores, so a world's compute and apply compiled one
    after the other leave cores idle. Side by side, tiny's compute and apply on 6 devices took
    8.5 s instead of 10.8 s on 2 cores (CPU time 14.8 s vs 16.4 s). Each program compiles exactly
    as it would alone, into the same executable: compiles share no state but JAX's caches, which
    take concurrent compiles (CacheCounter counts under a lock). A failed compile raises here,
    once every compile has returned."""
    programs = list(programs)
    if len(programs) <= 1:
        for program in programs:
            program.compile()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(programs), thread_name_prefix="compile") as pool:
        futures = [pool.submit(program.compile) for program in programs]
    for future in futures:
        future.result()


def leader_compiles(placements: list[str], platform: str) -> bool:
    """Whether rank 0 alone compiles a world's programs and the other members load them from the
    persistent compile cache once it has (resilient_jax.elastic.world.compile_world).

    `placements`: every member's `placement()` -- where it runs and which cache it uses -- as all
    of them read it, so every member decides alike. Only where all are equal and name a cache: one
    machine (one kernel, so one set of cores) and one cache directory. N members compiling the same
    program side by side there cost N times the CPU on the same cores (a 4-process world on 2 cores:
    46 s, against ~12 s for one compile), and JAX writes the entry from process 0 only. Members on
    machines of their own compile in parallel on their own cores, which is no slower than waiting
    for one of them. (Containers on one kernel whose equal paths are different directories: the
    others find nothing and compile after rank 0 -- slower, never wrong.) CPU only: there every
    rank computes the same cache key (`enable`); on GPUs that is not established, and a follower
    that missed would compile after rank 0 instead of alongside it."""
    return (platform == "cpu" and len(placements) > 1 and len(set(placements)) == 1
            and not placements[0].endswith(" "))


def placement() -> str:
    """Where this process runs and which cache it uses: the kernel's boot id (the same for every
    process and container on one kernel), else the host name; then the cache directory, empty when
    the cache is off."""
    import socket

    import jax

    try:
        machine = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        machine = socket.gethostname()
    cache = jax.config.jax_compilation_cache_dir or ""
    return f"{machine} {os.path.realpath(cache) if cache else ''}"
