"""Replica groups (resilient_jax.elastic.groups), pure: the layout a config makes, every regrouping
transition and the choice of the state a re-formed world adopts -- no controller, threads or JAX.
The end-to-end runs (real processes, real SIGKILL) are in tests/test_replica_groups.py."""

from __future__ import annotations

import pytest

from resilient_jax.config import ConfigError, load_config
from resilient_jax.elastic import run as run_lib
from resilient_jax.elastic.groups import Group, host_order, initial, layout, pick_source, regroup

from conftest import REPO

CPU4 = REPO / "configs" / "cpu-4host.yaml"
CPU6 = REPO / "configs" / "cpu-6host-3region.yaml"
US, EU = "us", "eu"


def cfg(path, *overrides):
    return load_config(path, ["run.dir=/tmp/unused", *overrides])


# -- layout and bad input ---------------------------------------------------------------------------


def test_fsdp_left_at_1_spans_the_group_and_data_follows_the_groups():
    effective = layout(cfg(CPU4, "parallel.hosts_per_replica=2"))
    assert (effective.parallel.fsdp, effective.parallel.data, effective.parallel.tensor) == (4, -1, 1)
    with_tensor = layout(cfg(CPU4, "parallel.hosts_per_replica=2", "parallel.tensor=2"))
    assert (with_tensor.parallel.fsdp, with_tensor.parallel.tensor) == (2, 2)
    plain = cfg(CPU4)
    assert layout(plain) is plain  # k = 1: nothing changes, the config hash neither


@pytest.mark.parametrize("overrides, key", [
    # k not dividing a region's hosts (us has 2)
    (["parallel.hosts_per_replica=3"], "topology.regions[us].hosts"),
    # a replica group split across regions without allow_cross_region_replica: 4 hosts, 2 per region
    (["parallel.hosts_per_replica=4"], "parallel.allow_cross_region_replica"),
    (["parallel.hosts_per_replica=2", "runtime.min_replicas=3"], "runtime.min_replicas"),
    (["parallel.hosts_per_replica=2", "parallel.fsdp=2"], "parallel.fsdp x parallel.tensor"),
    (["parallel.hosts_per_replica=2", "parallel.data=4"], "parallel.data"),
])
def test_a_layout_that_cannot_make_groups_is_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        run_lib.validate(cfg(CPU4, *overrides))
    assert key in str(e.value) and "\n" not in str(e.value)


def test_a_group_may_span_regions_when_allowed():
    effective = run_lib.validate(cfg(CPU4, "parallel.hosts_per_replica=4", "parallel.allow_cross_region_replica=true"))
    assert effective.parallel.fsdp == 8
    with pytest.raises(ConfigError, match="divide the run's 6 hosts"):
        run_lib.validate(cfg(CPU6, "parallel.hosts_per_replica=4", "parallel.allow_cross_region_replica=true"))


def test_a_single_process_run_refuses_groups(tmp_path):
    from resilient_jax import preflight

    with pytest.raises(ConfigError, match="parallel.hosts_per_replica = 2: .*no topology.regions"):
        preflight.check_run(load_config(REPO / "configs" / "tiny.yaml",
                                        [f"run.dir={tmp_path}", "parallel.hosts_per_replica=2"]))


# -- groups and their transitions ---------------------------------------------------------------


def test_initial_groups_are_consecutive_hosts_of_one_region():
    hosts = [("h0", US), ("h1", US), ("h2", EU), ("h3", EU)]
    assert initial(hosts, 2) == (Group(US, ("h0", "h1")), Group(EU, ("h2", "h3")))
    assert initial(hosts, 4) == (Group("eu+us", ("h0", "h1", "h2", "h3")),)
    assert sorted(["h10", "h2", "h1"], key=host_order) == ["h1", "h2", "h10"]


GROUPS = (Group(US, ("h0", "h1")), Group(EU, ("h2", "h3")))


def test_a_death_idles_its_groups_survivors_and_the_others_go_on():
    r = regroup(GROUPS, live=["h0", "h2", "h3"], spares=(), newcomers=(), k=2, cross_region=False)
    assert r.groups == (Group(US, ("h0", None)), Group(EU, ("h2", "h3")))
    assert (r.complete, r.members, r.idle, r.placed) == ((1,), ("h2", "h3"), ("h0",), ())


def test_a_newcomer_of_the_region_fills_the_vacant_slot_and_the_group_rejoins_in_its_place():
    broken = (Group(US, ("h0", None)), Group(EU, ("h2", "h3")))
    r = regroup(broken, live=["h0", "h2", "h3"], spares=(), newcomers=[("h4", US)], k=2, cross_region=False)
    assert r.groups == (Group(US, ("h0", "h4")), Group(EU, ("h2", "h3")))
    # Group-major ranks: each group is one `data` row; h0 keeps slot 0, h4 takes h1's slot 1.
    assert (r.complete, r.members, r.idle, r.placed) == ((0, 1), ("h0", "h4", "h2", "h3"), (), ("h4",))


def test_a_candidate_of_another_region_does_not_fill_a_slot_unless_groups_may_span_regions():
    broken = (Group(US, ("h0", None)), Group(EU, ("h2", "h3")))
    r = regroup(broken, live=["h0", "h2", "h3"], spares=[("h5", EU)], newcomers=(), k=2, cross_region=False)
    assert r.members == ("h2", "h3") and r.idle == ("h0",) and r.placed == ()
    r = regroup(broken, live=["h0", "h2", "h3"], spares=[("h5", EU)], newcomers=(), k=2, cross_region=True)
    assert r.members == ("h0", "h5", "h2", "h3")


def test_spares_fill_before_newcomers_and_a_group_is_filled_whole_or_not_at_all():
    broken = (Group(US, (None, None, "h2")),)
    one = regroup(broken, live=["h2"], spares=[("s1", US)], newcomers=(), k=3, cross_region=False)
    assert one.placed == () and one.idle == ("h2",)  # s1 stays a spare: one slot would stay vacant
    both = regroup(broken, live=["h2"], spares=[("s1", US)], newcomers=[("n1", US)], k=3, cross_region=False)
    assert both.groups == (Group(US, ("s1", "n1", "h2")),) and both.placed == ("s1", "n1")


def test_a_lost_region_removes_its_group_which_reforms_from_k_newcomers_of_one_region():
    lost = regroup(GROUPS, live=["h0", "h1"], spares=(), newcomers=(), k=2, cross_region=False)
    assert lost.groups[1] == Group(EU, (None, None)) and lost.members == ("h0", "h1") and lost.idle == ()
    back = regroup(lost.groups, live=["h0", "h1"], spares=(), newcomers=[("h4", "ap"), ("h5", US), ("h6", "ap")],
                   k=2, cross_region=False)
    assert back.groups[1] == Group("ap", ("h4", "h6")) and back.unplaced == ("h5",)


def test_newcomers_left_over_grow_the_run_by_whole_groups():
    r = regroup(GROUPS, live=["h0", "h1", "h2", "h3"], spares=(), newcomers=[("h4", EU), ("h5", US), ("h6", EU)],
                k=2, cross_region=False)
    assert r.groups[2] == Group(EU, ("h4", "h6")) and r.members[-2:] == ("h4", "h6") and r.unplaced == ("h5",)


# -- whose state the next world adopts ------------------------------------------------------------


def test_the_source_is_the_newest_complete_group_that_holds_one_step_whole():
    r = regroup((Group(US, ("h0", "h4")), Group(EU, ("h2", "h3"))), live=["h0", "h4", "h2", "h3"], spares=(),
                newcomers=(), k=2, cross_region=False)
    # h0 idled at step 20 and h4 is new: only the eu group holds step 36, on data row 1.
    source = pick_source(r, {"h2": 36, "h3": 36})
    assert (source.step, source.group, source.host, source.holders) == (36, 1, "h2", ("h2", "h3"))
    # Every member holds the same step: nothing needs to be sent.
    assert pick_source(r, {h: 36 for h in r.members}).holders == r.members
    # A group whose hosts hold different steps holds no consistent state.
    assert pick_source(r, {"h0": 36, "h4": 35, "h2": 35, "h3": 35}).group == 1
    assert pick_source(r, {"h0": 36, "h4": 35}) is None  # no group whole: the newest checkpoint
