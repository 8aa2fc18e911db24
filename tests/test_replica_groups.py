"""Replica groups end to end: a replica spans 2 hosts (parallel.hosts_per_replica=2), real worker
processes, real SIGKILL. A death idles its group and the other groups go on; a replacement host
re-forms the group, which heals from a sibling replica over the collective (no disk); a region
loss removes its group. Every run ends on the fault-free trajectory (the exact reduction makes
it the same for any layout and any number of groups), with restarts 0 and steps lost 0."""

from __future__ import annotations

import pytest

from conftest import REPO, read_summary, run_cli
from test_elastic import EXPORTED_FOR_THIS_WORLD, STEPS, compiled_reasons, elastic_run

pytestmark = pytest.mark.slow

GROUPS_OF_2 = ("--set", "parallel.hosts_per_replica=2")


@pytest.fixture(scope="module")
def reference(fault_free):
    """The fault-free trajectory, computed in one process on 8 devices (data=8, fsdp=1): the
    groups' layouts (data=2 x fsdp=4, then 1 x 4) must land on the same bits."""
    return fault_free(f"train.steps={STEPS}", "checkpoint.enabled=false")["params_fingerprint"]


def test_a_killed_host_idles_its_group_and_a_replacement_heals_it_from_a_sibling(tmp_path, reference):
    summary = elastic_run(tmp_path, str(REPO / "configs" / "cpu-4host.yaml"), *GROUPS_OF_2,
                          "--set", "checkpoint.enabled=false", "--fault", "kill_host:1@20", "--fault", "join_host@30")
    assert summary["final_step"] == STEPS and summary["params_fingerprint"] == reference
    assert summary["restarts"] == 0 and summary["steps_lost"] == 0
    failure, join = summary["events"]
    # h1's death broke group us (h0+h1): generation 1 is the eu group alone, from its own slices.
    assert (failure["reason"], failure["lost"], failure["resume_step"]) == ("failure", ["h1"], 20)
    assert sorted(failure["adoption"]) == ["h2", "h3"]
    assert all(a["how"].startswith("own slices") for a in failure["adoption"].values())
    # h4 (region us) took h1's slot; h0 had idled since step 20, so both heal from the eu replica.
    assert join["reason"] == "join" and join["joined"] == ["h4"] and join["resume_step"] >= 30
    healed = {h: a for h, a in join["adoption"].items() if a["how"].startswith("healed")}
    assert sorted(healed) == ["h0", "h4"]
    assert sorted(h for h, a in join["adoption"].items() if a["how"].startswith("source")) == ["h2", "h3"]
    for host, adoption in healed.items():
        # The healing host's device memory while the state arrives: its shard plus one leaf in flight.
        assert adoption["peak_over_shard"] <= 1.5, (host, adoption)
    assert summary["replica_groups"] == [{"region": "us", "slots": ["h0", "h4"]},
                                         {"region": "eu", "slots": ["h2", "h3"]}]
    assert failure["from_checkpoint"] is None and join["from_checkpoint"] is None  # memory, never disk
    assert "healed from replica 1" in (tmp_path / "elastic" / "logs" / "h0.log").read_text()


def test_a_region_loss_removes_its_group_and_the_others_keep_the_trajectory(tmp_path, reference):
    summary = elastic_run(tmp_path, str(REPO / "configs" / "cpu-6host-3region.yaml"), *GROUPS_OF_2,
                          "--set", "checkpoint.enabled=false", "--fault", "kill_region:ap@20")
    assert summary["final_step"] == STEPS and summary["params_fingerprint"] == reference
    assert summary["restarts"] == 0 and summary["steps_lost"] == 0
    (failure,) = summary["events"]
    assert sorted(failure["lost"]) == ["h4", "h5"] and failure["resume_step"] == 20
    assert sorted(failure["adoption"]) == ["h0", "h1", "h2", "h3"]  # the us and eu groups, their own slices
    assert summary["replica_groups"][2] == {"region": "ap", "slots": [None, None]}


def test_a_preempted_run_of_2_host_replicas_resumes_with_1_host_replicas_on_the_same_trajectory(tmp_path, fault_free):
    # parallel.hosts_per_replica is layout, like fsdp: the checkpoint's arrays do not depend on it,
    # its topology field records the groups, and the exact reduction keeps the trajectory.
    import signal

    from resilient_jax.checkpoint import reader

    from test_elastic_first_hour import STEPS as STOP_STEPS, interrupt, train_args

    reference = fault_free(f"train.steps={STOP_STEPS}", "checkpoint.enabled=false")["params_fingerprint"]
    run_dir = tmp_path / "run"
    code, out, err = interrupt(tmp_path, "groups", train_args(run_dir, *GROUPS_OF_2), after_step=10, times=1,
                               signum=signal.SIGTERM)
    assert code == 143, out + err
    preempted = reader.list_steps(run_dir / "checkpoints")[-1]
    assert 10 <= preempted < STOP_STEPS
    saved = reader.read_context(run_dir / "checkpoints" / str(preempted))["topology"]
    assert saved["replica_groups"] == [[0, 1], [2, 3]] and saved["mesh"]["shape"] == [2, 4, 1]

    resumed = run_cli(*train_args(run_dir), timeout=600)  # hosts_per_replica back to its default, 1
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"resumes from the checkpoint of step {preempted}" in resumed.stdout
    summary = read_summary(run_dir)
    assert summary["final_step"] == STOP_STEPS and summary["params_fingerprint"] == reference
    final = reader.read_context(run_dir / "checkpoints" / str(STOP_STEPS))["topology"]
    assert final["replica_groups"] == [[0], [0], [1], [1], [2], [2], [3], [3]]  # data=8: 2 replicas a host
    (change,) = [h for h in final["history"] if h["step"] == preempted]
    assert "replicas of 2 hosts" in change["from_text"] and "replicas of" not in change["to_text"]


def test_the_next_world_of_the_complete_groups_is_compiled_ahead_and_loaded_from_the_cache(tmp_path, reference):
    # Rank 0 compiles, while generation 0 trains, the worlds one group fewer: (eu, eu) and (us, us).
    # h1's death idles the us group; generation 1 is the eu group, whose hosts load its step from
    # the cache instead of compiling on the recovery path. Steps are slowed to 1 s until 35 so the
    # compiles finish while the world trains. A cache of its own: no other test's world can be hit.
    delays = [a for h in range(4) for a in ("--fault", f"delay_host:{h}@1-35:1")]
    summary = elastic_run(tmp_path, str(REPO / "configs" / "cpu-4host.yaml"), *GROUPS_OF_2,
                          "--set", "checkpoint.enabled=false", "--set", "runtime.precompile_next_worlds=on",
                          "--set", f"runtime.compile_cache={tmp_path / 'cache'}",
                          "--fault", "kill_host:1@precompiled:0", *delays)
    assert summary["final_step"] == STEPS and summary["params_fingerprint"] == reference
    assert summary["restarts"] == 0 and summary["steps_lost"] == 0
    (done, *_) = [p for p in summary["precompiled"] if p["generation"] == 0]
    assert [w["regions"] for w in done["worlds"]] == [["eu", "eu"], ["us", "us"]] and not done["stopped"]
    # Generation 0: rank 0 (h0) compiled, h2 and h3 loaded its programs. Generation 1 is (h2, h3),
    # h2 its rank 0, which compiles unless the background compile cached the step: it loaded it
    # (h3 loads whatever h2 has compiled either way) -- calling the step h0 exported, untraced.
    compiled = {host: compiled_reasons(tmp_path, host) for host in ("h0", "h2", "h3")}
    assert "programs compiled (not in the cache)" in compiled["h0"][0], compiled
    assert compiled["h0"][0].endswith(EXPORTED_FOR_THIS_WORLD), compiled  # rank 0 called them too
    for host in ("h2", "h3"):
        assert len(compiled[host]) == 2, compiled
        assert compiled[host][0].endswith(f"2 programs from the compile cache, {EXPORTED_FOR_THIS_WORLD}"), compiled
        assert compiled[host][1].endswith("2 programs from the compile cache, calling the step rank 0 exported earlier for a world "
               "of this shape"), compiled


def test_a_straggler_is_replaced_by_a_spare_of_its_region_and_its_group_heals(tmp_path, reference):
    # us has a spare (h4). h1 runs 4x slower from step 15: the straggler policy replaces it; h4 takes
    # its slot in the us group, whose hosts (h0 and h4) then heal from the eu replica.
    with_spare = "topology.regions=[{name: us, hosts: 2, spares: 1}, {name: eu, hosts: 2}]"
    summary = elastic_run(tmp_path, str(REPO / "configs" / "cpu-4host.yaml"), *GROUPS_OF_2, "--set", with_spare,
                          "--set", "checkpoint.enabled=false", "--fault", "slow_host:1@15:4")
    assert summary["final_step"] == STEPS and summary["params_fingerprint"] == reference
    assert summary["restarts"] == 0 and summary["steps_lost"] == 0
    (event,) = summary["events"]
    assert event["reason"] == "reslot" and event["reslotted"] == ["h1"] and event["decision"]["action"] == "replace"
    healed = sorted(h for h, a in event["adoption"].items() if a["how"].startswith("healed"))
    assert healed == ["h0", "h4"]
    assert summary["replica_groups"] == [{"region": "us", "slots": ["h0", "h4"]},
                                         {"region": "eu", "slots": ["h2", "h3"]}]
