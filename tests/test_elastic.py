"""Elastic runtime, end to end: real worker processes on 127.0.0.1, real SIGKILL/SIGSTOP.

Every scenario must finish with restarts 0, steps lost 0 and -- in invariant mode -- the same
params fingerprint as the fault-free run (which equals a single-process run of the same model).
Killing rank 0, losing a region, a latency spike and a straggler without a spare are in the chaos
drill (tests/test_chaos_drill.py).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from resilient_jax.checkpoint import reader

from conftest import REPO, read_summary, run_cli

pytestmark = pytest.mark.slow

STEPS = 60
CPU4 = str(REPO / "configs" / "cpu-4host.yaml")


def elastic_run(run_dir, config: str, *extra: str) -> dict:
    proc = run_cli("resilient_jax.train", "--config", config, "--set", f"run.dir={run_dir}",
                   "--set", f"train.steps={STEPS}", *extra, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}\n" + _logs(run_dir)
    return read_summary(run_dir)


def _logs(run_dir) -> str:
    logs = sorted((run_dir / "elastic" / "logs").glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs)


@pytest.fixture(scope="module")
def reference(fault_free):
    """The fault-free trajectory, computed in one process on 8 devices (invariance makes it the same)."""
    return fault_free(f"train.steps={STEPS}", "checkpoint.enabled=false")["params_fingerprint"]


def assert_absorbed(summary: dict, reference: str, *, lost: list[str], events: int = 1) -> None:
    assert summary["final_step"] == STEPS
    assert summary["restarts"] == 0 and summary["steps_lost"] == 0
    assert summary["params_fingerprint"] == reference
    failures = [e for e in summary["events"] if e["reason"] == "failure"]
    assert len(failures) == events
    assert sorted(h for e in failures for h in e["lost"]) == sorted(lost)
    assert summary["failures_absorbed"] == len(lost)


def test_deaths_while_a_world_moves_state_and_while_one_forms_are_absorbed(tmp_path, reference):
    # h1 dies in step 21; h2 dies as generation 1 moves h0's state to its members (a second failure
    # during a recovery); h3 dies right after joining generation 2, before its first step.
    summary = elastic_run(tmp_path, CPU4, "--fault", "kill_host:1@20", "--fault", "kill_host:2@adopt:1",
                          "--fault", "kill_host:3@formation:2")
    assert_absorbed(summary, reference, lost=["h1", "h2", "h3"], events=3)
    assert [(e["generation"], e["lost"], e["resume_step"]) for e in summary["events"]] == [
        (1, ["h1"], 20), (2, ["h2"], 20), (3, ["h3"], 20)]
    assert all(summary["worker_exit_codes"][h] == -9 for h in ("h1", "h2", "h3"))
    # Each survivor left the failed worlds through the state machine and kept its state throughout.
    log = (tmp_path / "elastic" / "logs" / "h0.log").read_text()
    assert "state ADOPTING -> LEAVING on FAILED" in log
    # h3's death was found by a collective the verdict broke, not by a barrier that timed out
    # (opening the checkpoint store held every survivor in orbax's 300 s barrier).
    assert "timed out" not in log and "DEADLINE_EXCEEDED" not in log
    assert log.count("-> LEAVING on") == 3 and "state TRAINING -> DONE on FINISHED" in log
    assert "holding the state of step 20" in log
    # Survivors only in generations 1-3: each placed its own copy of the state, none was sent.
    assert log.count("its own copy, which every member holds (nothing sent)") == 1  # generation 3's (1 and 2 failed first)
    assert "from a peer" not in log
    # The final rank 0's seconds per state: where its time went, recoveries included.
    seconds = summary["state_seconds"]
    assert seconds["adopting"] > 0 and seconds["leaving"] > 0 and seconds["compiling"] > 0
    assert seconds["training"] > 0 and set(seconds) <= {"waiting", "joining", "restoring", "adopting", "compiling",
                                                       "training", "leaving", "done"}


def test_deaths_while_checkpoints_commit_and_as_the_end_is_reported_are_absorbed_and_checkpoints_record_the_topology(
        tmp_path, reference):
    # h1 dies while the periodic checkpoint of step 25 is written (also the plain killed-host case:
    # the survivors re-form without it). Then h2 dies while the final checkpoint (step 60, not a
    # periodic one) commits, after the last step: the save's barriers go through the coordination
    # service, which the verdict does not abort, and the survivors waited there -- the run hung.
    # Then h0, rank 0 of the world that committed it, dies as it reports the run's end: the others
    # had exited, and the run failed with its final checkpoint committed.
    summary = elastic_run(tmp_path, CPU4, "--set", "checkpoint.every_steps=25", "--fault", "kill_host:1@save:25",
                          "--fault", f"kill_host:2@save:{STEPS}", "--fault", f"kill_host:0@report:{STEPS}")
    assert_absorbed(summary, reference, lost=["h1", "h2", "h0"], events=3)
    event, final, report = summary["events"]
    assert event["resume_step"] == 25  # the survivors' own state after step 25: nothing read back from disk
    assert event["detection_seconds"] is not None and summary["worker_exit_codes"]["h1"] == -9
    # After the final step's deaths each next world has no step to run: it commits the checkpoint
    # (or finds it committed) and reports the end.
    assert (final["generation"], final["lost"], final["resume_step"]) == (2, ["h2"], STEPS)
    assert (report["generation"], report["lost"], report["resume_step"]) == (3, ["h0"], STEPS)
    assert summary["worker_exit_codes"]["h2"] == -9 and summary["worker_exit_codes"]["h0"] == -9
    # Survivors only: each placed its own copy of the state; none was sent across the world.
    log = (tmp_path / "elastic" / "logs" / "h3.log").read_text()
    assert "adopted state after step 25: its own copy, which every member holds (nothing sent)" in log
    assert re.search(r"TRAINING -> LEAVING on STEP_FAILED after [0-9.]+ s: the run's end in generation 1: ", log)
    assert re.search(r"TRAINING -> LEAVING on STEP_FAILED after [0-9.]+ s: the run's end in generation 2: a member "
                     r"of generation 2 died before the run's end was reported", log)
    assert "timed out" not in log and "DEADLINE_EXCEEDED" not in log
    # Those two worlds compiled no step: they had none left to run.
    assert log.count("COMPILING -> TRAINING on COMPILED after") == 4  # generations 0 to 3
    assert len(re.findall(rf"on COMPILED after [0-9.]+ s: nothing: no step left to run after step {STEPS}\n", log)) == 2
    assert log.count("compiled the step in") == 2  # generations 0 and 1
    # Checkpoints written after the faults carry the topology of the world that wrote them.
    context = reader.read_context(tmp_path / "checkpoints" / "50")
    assert context["topology"]["generation"] == 1 and context["topology"]["process_count"] == 3
    assert [h["region"] for h in context["topology"]["hosts"]] == ["us", "eu", "eu"]
    context = reader.read_context(tmp_path / "checkpoints" / str(STEPS))
    assert context["topology"]["generation"] == 2 and context["topology"]["process_count"] == 2
    assert [h["region"] for h in context["topology"]["hosts"]] == ["us", "eu"]
    # Whatever the deaths left of step 25's and of generation 1's step 60 is never offered, and
    # nothing of theirs landed in generation 2's step 60 after its commit: every listed step verifies.
    listed = reader.list_steps(tmp_path / "checkpoints")
    assert listed == [50, 60]
    for step in listed:
        verify = run_cli("resilient_jax.checkpoint", "verify", str(tmp_path / "checkpoints" / str(step)))
        assert verify.returncode == 0, verify.stdout + verify.stderr


def test_the_world_after_a_death_loads_its_step_that_rank_0_compiled_in_the_background(tmp_path, reference):
    # Every host enters each of steps 1-35 1 s late (all alike: no straggler), so the background
    # compile finishes while generation 0 trains (in CI it did by step 14); h1 dies in the first
    # step after it has, and the steps after 35 run at full speed. min_hosts=3 leaves two likely
    # next worlds: a host lost from us, or from eu.
    delays = [a for h in range(4) for a in ("--fault", f"delay_host:{h}@1-35:1")]
    # A cache of its own: no other test's world of this shape can be what generation 1 loads.
    summary = elastic_run(tmp_path, CPU4, "--set", "runtime.precompile_next_worlds=on", "--set", "runtime.min_hosts=3",
                          "--set", f"runtime.compile_cache={tmp_path / 'cache'}",
                          "--fault", "kill_host:1@precompiled:0", *delays)
    assert_absorbed(summary, reference, lost=["h1"])
    (done, *_) = [p for p in summary["precompiled"] if p["generation"] == 0]
    assert [w["regions"] for w in done["worlds"]] == [["us", "eu", "eu"], ["us", "us", "eu"]] and not done["stopped"]
    # Generation 0: rank 0 (h0) compiled, the others loaded its programs (one machine: rank 0
    # compiles for all). Generation 1 is (h0, h2, h3) = (us, eu, eu), and h0 its rank 0: it compiles
    # unless the background compile put the step in the cache -- it loaded it. (h2's and h3's
    # loads alone would not show that: they load whatever rank 0 compiled.)
    # Every member of generation 1 called the step rank 0 exported (resilient_jax.exported): no
    # member traced the model again, and the programs rank 0 compiled through it were in the cache.
    compiled = {host: compiled_reasons(tmp_path, host) for host in ("h0", "h2", "h3")}
    assert "programs compiled (not in the cache)" in compiled["h0"][0], compiled
    assert compiled["h0"][0].endswith(EXPORTED_FOR_THIS_WORLD), compiled  # rank 0 called them too
    for host in ("h0", "h2", "h3"):
        assert len(compiled[host]) == 2, compiled
        assert compiled[host][1].endswith("2 programs from the compile cache, calling the step rank 0 exported earlier for a world "
               "of this shape"), compiled
    assert not any((tmp_path / "elastic" / "exported").iterdir())  # the invocation's programs, removed at its end
    # Generation 0's members share one machine: they called the step rank 0 exported for it.
    assert all(compiled[h][0].endswith(f"2 programs from the compile cache, {EXPORTED_FOR_THIS_WORLD}")
               for h in ("h2", "h3")), compiled
    # The fresh state's program too: h0 compiled it, the others (h1 as well) loaded it.
    ready = {host: compiled_reasons(tmp_path, host, "state_ready")[0] for host in ("h0", "h1", "h2", "h3")}
    assert ready["h0"] == "step 0, a fresh state (1 program compiled (not in the cache), 0 from the cache)", ready
    assert all(ready[h] == "step 0, a fresh state (1 program from the compile cache)" for h in ("h1", "h2", "h3")), ready


# The lifecycle journal's words for a world whose members share one machine and call the programs
# its rank 0 exported for it (none of them traced the model but rank 0).
EXPORTED_FOR_THIS_WORLD = "calling the step rank 0 exported for this world (one machine)"


def compiled_reasons(run_dir, host: str, event: str = "compiled") -> list[str]:
    """What each of `host`'s compiles found, in order: its lifecycle journal's `compiled` lines (or
    `state_ready` lines, which say what making a fresh state compiled)."""
    journal = [json.loads(line) for line in (run_dir / "elastic" / "lifecycle" / f"{host}.jsonl").open()]
    return [line["reason"] for line in journal if line["event"] == event]


def test_a_hung_host_is_detected_and_removed(tmp_path, reference):
    summary = elastic_run(tmp_path, CPU4, "--fault", "hang_host:2@20")
    assert_absorbed(summary, reference, lost=["h2"])
    assert summary["members"]["h2"]["status"] == "dead"


def test_a_straggler_is_replaced_by_a_spare_that_gets_its_state_from_a_peer(tmp_path, reference):
    with_spare = "topology.regions=[{name: us, hosts: 2}, {name: eu, hosts: 2, spares: 1}]"
    summary = elastic_run(tmp_path, CPU4, "--set", with_spare, "--fault", "slow_host:1@15:4")
    assert summary["final_step"] == STEPS and summary["restarts"] == 0 and summary["steps_lost"] == 0
    assert summary["params_fingerprint"] == reference
    (event,) = summary["events"]
    assert event["reason"] == "reslot" and event["reslotted"] == ["h1"] and event["joined"] == ["h4"]
    decision = event["decision"]
    assert decision["action"] == "replace" and decision["ratio"] >= 1.5
    assert decision["window_steps"][1] <= 15 + summary["straggler_window"] + 2  # within the configured window
    assert summary["members"]["h1"]["status"] == "reslotted" and summary["worker_exit_codes"]["h1"] == 0
    log = (tmp_path / "elastic" / "logs" / "h4.log").read_text()
    assert "from a peer" in log


def test_a_new_host_joins_and_gets_its_state_from_a_peer_even_when_a_member_dies_during_the_broadcast(
        tmp_path, reference):
    # h3 joins at a step boundary after step 20: generation 1 broadcasts h0's state to it, and h1
    # dies right then.
    # Generation 2 (h0, h2, h3) broadcasts again: h3 still holds no state.
    three = "topology.regions=[{name: us, hosts: 2}, {name: eu, hosts: 1}]"
    summary = elastic_run(tmp_path, CPU4, "--set", three, "--fault", "join_host@20", "--fault", "kill_host:1@adopt:1")
    assert summary["final_step"] == STEPS and summary["restarts"] == 0 and summary["steps_lost"] == 0
    assert summary["params_fingerprint"] == reference
    join, failure = summary["events"]
    assert join["reason"] == "join" and join["joined"] == ["h3"]
    assert failure["reason"] == "failure" and failure["lost"] == ["h1"]
    assert failure["resume_step"] == join["resume_step"]  # generation 1 never got to run a step
    assert summary["worker_exit_codes"]["h1"] == -9
    assert "state ADOPTING -> LEAVING on FAILED" in (tmp_path / "elastic" / "logs" / "h0.log").read_text()
    log = (tmp_path / "elastic" / "logs" / "h3.log").read_text()
    assert f"adopted state from h0 after step {join['resume_step']} (from a peer" in log


def test_a_controller_stopped_longer_than_dead_after_fences_no_host(tmp_path, reference):
    """SIGSTOP to the driver (controller and coordination service) for dead_after + 4 s mid-run:
    on SIGCONT no host is declared dead (they were not silent; the controller was), and the run
    ends in generation 0 on the fault-free fingerprint. Before, the controller woke up, found every
    host 'silent for 12 s' and fenced them."""
    proc = subprocess.Popen([sys.executable, "-m", "resilient_jax.train", "--config", CPU4, "--set",
                             f"run.dir={tmp_path}", "--set", f"train.steps={STEPS}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        status_file, deadline = tmp_path / "elastic" / "status.json", time.monotonic() + 300
        while time.monotonic() < deadline and not (status_file.exists() and json.loads(status_file.read_text())["step"] >= 10):
            time.sleep(0.2)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(6 + 4)  # configs/cpu-4host.yaml: runtime.dead_after_seconds 6
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}\n" + _logs(tmp_path)
    summary = read_summary(tmp_path)
    assert summary["events"] == [] and summary["restarts"] == 0 and summary["steps_lost"] == 0
    assert summary["params_fingerprint"] == reference
    assert "is dead" not in out and "the controller did not run for" in (
        tmp_path / "elastic" / "logs" / "controller.log").read_text()


def test_status_command_shows_members_and_generation(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "resilient_jax.train", "--config", CPU4, "--set",
                             f"run.dir={run_dir}", "--set", "train.steps=40"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status_file = run_dir / "elastic" / "status.json"
            if status_file.exists() and json.loads(status_file.read_text())["step"] >= 1:
                break
            time.sleep(0.5)
        out = run_cli("resilient_jax.elastic", "status", "--run", str(run_dir), check=True).stdout
        assert "generation 0" in out and all(f"h{i}" in out for i in range(4))
    finally:
        proc.wait(timeout=300)
