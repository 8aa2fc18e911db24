"""The controller's re-formation decision (resilient_jax.elastic.membership.plan_reform) and its
liveness verdict (silent_hosts), pure: every outcome from plain dicts -- no controller, threads,
HTTP or JAX."""

from __future__ import annotations

import pytest

from resilient_jax.elastic.membership import PlannedChange, ReformPlan, TooFewHosts, plan_reform, silent_hosts

MEMBERS = ("h0", "h1", "h2", "h3")


def plan(status=None, completed=None, change=None, *, min_hosts=1, spares=(), registered=0):
    status = {**{h: "active" for h in MEMBERS}, **(status or {})}
    return plan_reform(MEMBERS, status, completed or {}, change, min_hosts=min_hosts, spares=list(spares),
                       registered=registered)


def test_nothing_to_do_while_nobody_asked_and_nobody_died():
    assert plan() is None


def test_a_live_member_still_in_the_old_world_is_waited_for():
    assert plan({"h1": "dead"}, {"h0": 8, "h2": 8}) is None  # h3 has not failed its collective yet


def test_a_death_resumes_from_the_most_advanced_survivor_and_every_holder_is_named():
    result = plan({"h1": "dead"}, {"h0": 7, "h2": 8, "h3": 8})
    assert result == ReformPlan(reason="failure", resume_step=8, source="h2", holders=("h2", "h3"), lost=("h1",),
                                evicted=(), evicted_status=None, promoted=())


def test_the_source_is_the_lowest_ranked_holder():
    assert plan({"h3": "dead"}, {"h0": 8, "h1": 8, "h2": 8}).source == "h0"


def test_too_few_survivors_fail_the_run_naming_them():
    assert plan({"h0": "dead", "h1": "dead", "h2": "dead"}, {"h3": 8}, min_hosts=2) == TooFewHosts(("h3",))


def test_no_state_in_memory_restores_from_disk():
    # The first world failed while it formed: nobody completed a step in memory.
    result = plan({"h1": "dead"}, {"h0": -1, "h2": -1, "h3": -1})
    assert result.source is None and result.holders == () and result.resume_step == 0


def test_spares_take_the_slots_of_lost_hosts_in_preference_order():
    result = plan({"h1": "dead", "h2": "dead", "s0": "spare", "s1": "spare", "s2": "spare"}, {"h0": 5, "h3": 5},
                  spares=["s1", "s0", "s2"])
    assert result.promoted == ("s1", "s0") and result.lost == ("h1", "h2")


def test_a_reslot_evicts_the_straggler_and_its_named_spare_joins_once():
    change = PlannedChange("reslot", "h2", "s1")
    result = plan({"h1": "dead", "s0": "spare", "s1": "spare"}, {"h0": 9, "h2": 9, "h3": 9}, change,
                  spares=["s0", "s1"])
    # A death and a reslot at once: two slots to fill, the named spare first, and never twice.
    assert result.reason == "failure" and result.evicted == ("h2",) and result.evicted_status == "reslotted"
    assert result.promoted == ("s1", "s0")
    assert result.source == "h0" and "h2" in result.holders  # the evicted host still holds the state


def test_an_evicted_host_is_never_the_source():
    change = PlannedChange("drain", "h0", None)
    result = plan(None, {h: 4 for h in MEMBERS}, change)
    assert result.reason == "drain" and result.evicted_status == "drained" and result.source == "h1"
    assert result.promoted == ()


@pytest.mark.parametrize("registered, reason", [(1, "join"), (0, "collective-timeout")])
def test_every_member_asking_without_a_death_is_a_join_or_the_backstop(registered, reason):
    assert plan(None, {h: 3 for h in MEMBERS}, registered=registered).reason == reason


def test_a_host_silent_past_dead_after_is_named_with_its_silence_and_the_others_are_not():
    seen = {"h0": 100.0, "h1": 93.0, "h2": 99.5}
    last_seen, silent = silent_hosts(seen, now=100.1, pauses=[], dead_after=6.0)
    assert last_seen == seen and [(h, round(s, 1)) for h, s in silent] == [("h1", 7.1)]


def test_time_the_controller_did_not_run_is_not_its_hosts_silence():
    # The process did not run from 100.05 to 260 (~160 s). Each host's last_seen moves by the part
    # of the pause after it was last heard: none is silent now, and each keeps the silence it had
    # before (h1: 4 s), so it is declared dead 2 s later, not at once.
    seen = {"h0": 100.0, "h1": 96.0}
    last_seen, silent = silent_hosts(seen, now=260.0, pauses=[(100.05, 260.0)], dead_after=6.0)
    assert silent == [] and last_seen == {"h0": pytest.approx(259.95), "h1": pytest.approx(255.95)}
    assert silent_hosts(last_seen, now=261.0, pauses=[], dead_after=6.0)[1] == []
    assert [h for h, _ in silent_hosts(last_seen, now=262.5, pauses=[], dead_after=6.0)[1]] == ["h1"]


def test_a_host_heard_after_the_pause_gets_no_credit_and_nothing_moves_past_now():
    # h0's heartbeat, queued during the pause, was read before the monitor's verdict: it is not
    # credited (it would be seen in the future, and its death after the pause found ~160 s late).
    last_seen, _ = silent_hosts({"h0": 259.9, "h1": 100.0}, now=260.0, pauses=[(100.05, 259.8)], dead_after=6.0)
    assert last_seen["h0"] == 259.9 and last_seen["h1"] == pytest.approx(259.75)
    # A pause that began before a host was heard credits only what came after (cannot happen in one
    # process, but two pauses can straddle a heartbeat): never past now.
    last_seen, _ = silent_hosts({"h0": 150.0}, now=160.0, pauses=[(100.0, 155.0), (156.0, 170.0)], dead_after=6.0)
    assert last_seen["h0"] == 160.0
