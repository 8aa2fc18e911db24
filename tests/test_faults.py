"""The fault-injection grammar: every kind parses, and a bad spec gets one error naming the grammar."""

from __future__ import annotations

import pytest

from resilient_jax.config import ConfigError
from resilient_jax.faults import parse_fault


def test_every_kind_parses_and_prints_back():
    for spec in ["nan_shard:3@20", "kill_host:1@20", "kill_region:eu-west@5", "hang_host:0@7", "join_host@9",
                 "delay_host:2@15-17:8", "slow_host:1@12:4.5", "kill_host:1@formation:2", "kill_host:0@adopt:1",
                 "kill_host:3@save:20", "kill_host:1@precompiled:0"]:
        assert str(parse_fault(spec)) == spec


def test_delays_apply_to_their_steps_only():
    spike = parse_fault("delay_host:2@15-17:8")
    assert [spike.delay_before(k, 0.2) for k in (14, 15, 17, 18)] == [0.0, 8.0, 8.0, 0.0]
    slow = parse_fault("slow_host:1@12:4")
    assert slow.delay_before(11, 0.25) == 0.0 and slow.delay_before(12, 0.25) == slow.delay_before(99, 0.25) == 0.75


@pytest.mark.parametrize("spec, message", [
    ("explode_host:1@3", "unknown kind 'explode_host'"),
    ("delay_host:1@15:8", "delay_host:HOST@FIRST-LAST:SECONDS"),
    ("delay_host:1@15-14:8", "last delayed step 14 is before the first 15"),
    ("slow_host:1@12", r"slow_host:HOST@STEP\[-LAST\]:FACTOR"),
    ("slow_host:1@12:0.5", "FACTOR must be > 1"),
    ("kill_host:1@compile:2", "unknown moment 'compile' (known: formation, adopt, save"),
    ("kill_host:1@adopt:0", "generation 0 adopts no state"),
    ("kill_host:1@save:0", "checkpoints are numbered by completed steps, from 1"),
    ("kill_host:1@Save:3", "kill_host:HOST@STEP or kill_host:HOST@MOMENT:N"),
])
def test_a_bad_spec_names_what_is_wrong(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_fault(spec)


def test_a_moment_is_kept_apart_from_the_step_it_counts():
    formation = parse_fault("kill_host:2@formation:1")
    assert (formation.kind, formation.target, formation.moment, formation.step) == ("kill_host", "2", "formation", 1)
    assert parse_fault("kill_host:2@1").moment == "step"


def test_a_kill_waiting_for_the_precompile_fires_in_the_first_step_after_it_and_only_once(monkeypatch):
    from resilient_jax.elastic import injection

    fired = []
    monkeypatch.setattr(injection.threading, "Timer", lambda delay, fn, args: type(
        "T", (), {"start": lambda self: fired.append(args)})())

    class Client:
        def __init__(self):
            self.calls = []

        def call(self, path, **kw):
            self.calls.append((path, kw["kind"], kw["step"]))

    client = Client()
    faults = injection.HostFaults([parse_fault("kill_host:1@precompiled:2")], 1, "us", client, "h1")
    for step, precompiled in [(5, -1), (6, 1), (7, 2), (8, 3)]:
        faults.before_step(step, clock=None, precompiled=precompiled)
    assert client.calls == [("/fault", "kill_host", 7)] and len(fired) == 1


def test_a_kill_waiting_for_a_precompile_the_run_never_does_is_refused_before_it_starts(tmp_path, monkeypatch):
    from resilient_jax.config import load_config
    from resilient_jax.preflight import check_faults

    from conftest import REPO

    cfg = load_config(REPO / "configs" / "cpu-4host.yaml", [f"run.dir={tmp_path}"])
    fault = parse_fault("kill_host:1@precompiled:0")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the workers' platform, as the driver detects it
    with pytest.raises(ConfigError, match="can never fire; set runtime.precompile_next_worlds=on"):
        check_faults(cfg, [fault])  # auto: off on CPU workers (this machine's)
    with pytest.raises(ConfigError, match="runtime.compile_cache is off"):
        check_faults(load_config(REPO / "configs" / "cpu-4host.yaml", [f"run.dir={tmp_path}", "runtime.compile_cache=off",
                                                                        "runtime.precompile_next_worlds=on"]), [fault])
    check_faults(load_config(REPO / "configs" / "cpu-4host.yaml", [f"run.dir={tmp_path}",
                                                                    "runtime.precompile_next_worlds=on"]), [fault])


def test_joining_hosts_take_the_next_ids_and_regions_in_turn(tmp_path):
    from conftest import REPO
    from resilient_jax.config import load_config
    from resilient_jax.elastic.run import join_plan

    cfg = load_config(REPO / "configs" / "cpu-4host.yaml", [f"run.dir={tmp_path}", "faults=[join_host@30, join_host@9]"])
    # After 4 hosts and 1 spare: h5 and h6, in step order, regions taking turns (us, eu).
    assert join_plan(cfg, first_index=5) == [("h5", "eu", 9), ("h6", "us", 30)]


class _Statuses:
    """A controller client whose GET /status answers from a list, one reply per call."""

    def __init__(self, *replies):
        self.replies, self.calls = list(replies), 0

    def call(self, path, **kwargs):
        assert path == "/status" and kwargs["method"] == "GET"
        self.calls += 1
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def _status(step, finished=False, error=None, stopping=None):
    return {"step": step, "finished": finished, "error": error, "stopping": stopping}


def test_a_joining_worker_registers_once_the_run_reaches_its_step_and_not_after_it_ended():
    from resilient_jax.elastic.worker import _run_reached

    client = _Statuses(_status(0), _status(8), _status(9), _status(10))
    assert _run_reached(client, 9, poll_seconds=0) and client.calls == 3
    assert not _run_reached(_Statuses(_status(7), _status(7, finished=True)), 9, poll_seconds=0)
    assert not _run_reached(_Statuses(_status(3, stopping="interrupted")), 9, poll_seconds=0)
    assert not _run_reached(_Statuses(_status(3, error="worker h1 failed")), 9, poll_seconds=0)
    # Past the step but over or stopping by the first look (a slow start, a resume past it): no join.
    assert not _run_reached(_Statuses(_status(12, finished=True)), 9, poll_seconds=0)
    assert not _run_reached(_Statuses(_status(12, stopping="interrupted")), 9, poll_seconds=0)


def test_a_joining_worker_tells_a_vanished_controller_from_a_refusal():
    from resilient_jax.elastic.channel import ControllerError, ControllerUnreachable
    from resilient_jax.elastic.worker import _run_reached

    # Gone (the run is over and its controller with it): leave quietly.
    assert not _run_reached(_Statuses(_status(3), ControllerUnreachable("unreachable")), 9, poll_seconds=0)
    # Refused (a wrong token, say): the caller reports it and exits 3, not "the run ended".
    with pytest.raises(ControllerError, match="bad token"):
        _run_reached(_Statuses(ControllerError("bad token")), 9, poll_seconds=0)


def test_a_joiner_that_dies_before_its_step_leaves_the_run_going():
    from resilient_jax.elastic.run import exit_verdict

    joining = {"h4"}
    # Waiting for its step, h4 is in no world: its death is a console line, not the run's failure.
    assert exit_verdict("h4", 1, run_over=False, joining=joining, registered=False) == "joiner_gone"
    # Once registered it is a member like any other; a host of the first world always goes to the controller.
    assert exit_verdict("h4", 1, run_over=False, joining=joining, registered=True) == "worker_exited"
    assert exit_verdict("h1", 1, run_over=False, joining=joining, registered=False) == "worker_exited"
    assert exit_verdict("h1", -9, run_over=False, joining=joining, registered=True) == "worker_exited"
    # A clean exit, or any exit after the run is over, changes nothing.
    assert exit_verdict("h4", 0, run_over=False, joining=joining, registered=False) == "ignore"
    assert exit_verdict("h1", 1, run_over=True, joining=joining, registered=True) == "ignore"
