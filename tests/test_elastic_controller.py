"""The controller's membership rules and its control channel, without training processes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from resilient_jax.elastic.channel import ControllerClient, ControllerError, check_bind
from resilient_jax.elastic.controller import Controller


@pytest.fixture
def controller(tmp_path):
    ctl = Controller(config_hash="a" * 64, expected_hosts=2, run_dir=tmp_path, token="s3cret", dead_after_seconds=2.0)
    yield ctl
    ctl.close()


def test_binding_beyond_loopback_requires_a_token():
    with pytest.raises(ValueError, match="runtime.token"):
        check_bind("0.0.0.0", "")
    check_bind("0.0.0.0", "tok", tls=True)
    check_bind("127.0.0.1", "")


def test_wrong_token_is_refused_and_the_run_is_not_disturbed(controller):
    intruder = ControllerClient(controller.url, "wrong")
    with pytest.raises(ControllerError, match="token"):
        intruder.call("/register", retry_seconds=0, host="h9", region="x", devices=2, config_hash="a" * 64)
    assert "h9" not in controller.members
    good = ControllerClient(controller.url, "s3cret")
    assert good.call("/register", host="h0", region="us", devices=2, config_hash="a" * 64)["accepted"]


def test_a_silent_or_malformed_client_is_dropped_and_the_run_is_served(tmp_path, monkeypatch):
    from resilient_jax.elastic import channel

    monkeypatch.setattr(channel, "REQUEST_SECONDS", 0.5)
    ctl = Controller(config_hash="a" * 64, expected_hosts=1, run_dir=tmp_path, token="s3cret")
    host, port = ctl.url.removeprefix("http://").split(":")
    try:
        silent = socket.create_connection((host, int(port)))  # promises a body and never sends it
        silent.sendall(b"POST /register HTTP/1.1\r\nAuthorization: Bearer s3cret\r\nContent-Length: 100\r\n\r\n{")
        silent.settimeout(10)
        started = time.monotonic()
        assert silent.recv(1) == b""  # closed by the server, well before our own 10 s
        assert time.monotonic() - started < 5
        silent.close()
        with socket.create_connection((host, int(port))) as not_json:  # a body that is not JSON: a 400
            not_json.sendall(b"POST /heartbeat HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n"
                             b"Content-Length: 8\r\n\r\nnot json")
            not_json.settimeout(10)
            assert not_json.recv(64).startswith(b"HTTP/1.0 400")
        good = ControllerClient(ctl.url, "s3cret")
        assert good.call("/register", host="h0", region="us", devices=2, config_hash="a" * 64)["accepted"]
    finally:
        ctl.close()


def test_other_config_hash_is_refused_with_both_hashes_named(controller):
    client = ControllerClient(controller.url, "s3cret")
    with pytest.raises(ControllerError, match="config bbbbbbbb") as err:
        client.call("/register", retry_seconds=0, host="h0", region="us", devices=2, config_hash="b" * 64)
    assert "aaaaaaaa" in str(err.value)
    assert controller.members == {}


def test_a_host_with_other_devices_or_an_unknown_region_is_refused_and_the_run_goes_on(tmp_path):
    # A hand-started worker with --devices 8 in a 2-device-per-host run once joined the next world
    # and broke its mesh for every member ("cannot reshape array of size 16 into shape (5,2)").
    ctl = Controller(config_hash="a" * 64, expected_hosts=2, run_dir=tmp_path, token="t", dead_after_seconds=60,
                     devices_per_host=2, regions=("us", "eu"))
    try:
        client = ControllerClient(ctl.url, "t")
        with pytest.raises(ControllerError, match=r"^worker h50 has 8 devices, this run's hosts 2 "
                                                  r"\(topology.devices_per_host\); start it with --devices 2$"):
            client.call("/register", retry_seconds=0, host="h50", region="eu", devices=8, config_hash="a" * 64)
        with pytest.raises(ControllerError, match=r"^worker h51: region 'eu-west' is not one of this run's "
                                                  r"\(topology.regions: us, eu\); start it with --region"):
            client.call("/register", retry_seconds=0, host="h51", region="eu-west", devices=2, config_hash="a" * 64)
        assert ctl.members == {}
        for host, region in (("h0", "us"), ("h1", "eu")):
            client.call("/register", host=host, region=region, devices=2, config_hash="a" * 64)
        assert client.call("/world", host="h1", after=-1)["world"]["members"] == ["h0", "h1"]
    finally:
        ctl.close()


def test_world_forms_when_every_expected_host_registered(controller):
    client = ControllerClient(controller.url, "s3cret")
    client.call("/register", host="h0", region="us", devices=2, config_hash="a" * 64)
    assert controller.world is None
    client.call("/register", host="h1", region="eu", devices=2, config_hash="a" * 64)
    world = client.call("/world", host="h1", after=-1)["world"]
    assert world["generation"] == 0 and world["members"] == ["h0", "h1"] and world["resume_step"] == 0
    assert world["coordinator"].startswith("127.0.0.1:")


def test_a_silent_host_is_declared_dead_and_survivors_get_the_next_world(controller):
    client = ControllerClient(controller.url, "s3cret")
    for host in ("h0", "h1"):
        client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
    # h1 never speaks again; h0 reports a failed collective after completing 7 steps.
    reply = client.call("/reform", host="h0", generation=0, completed_step=7, data_position={"step": 7},
                        reason="failure")
    world = reply["world"]
    assert world["generation"] == 1 and world["members"] == ["h0"]
    assert world["resume_step"] == 7 and world["source"] == "h0"
    assert world["holders"] == ["h0"]  # every member holds the state: the world sends none
    assert controller.members["h1"].status == "dead"
    (event,) = controller.elastic_report()["events"]
    assert event["lost"] == ["h1"] and event["steps_lost"] == 0


CONTROLLER_PROCESS = """
import sys, time
from pathlib import Path
from resilient_jax.elastic.controller import Controller
ctl = Controller(config_hash="a" * 64, expected_hosts=2, run_dir=Path(sys.argv[1]), token="s3cret",
                 dead_after_seconds=2.0)
print(ctl.url, flush=True)
time.sleep(600)
"""


def test_a_controller_process_that_did_not_run_does_not_declare_its_hosts_dead_on_its_return(tmp_path):
    """SIGSTOP to a controller's process for longer than dead_after: on SIGCONT its hosts have a
    whole dead_after to be heard from (a run whose machine froze for 160 s had all four hosts
    declared dead at once and failed); and silence still counts from its return."""
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER_PROCESS, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        client = ControllerClient(proc.stdout.readline().strip(), "s3cret")
        for host in ("h0", "h1"):
            client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.0 + 1.5)
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.5)  # its threads' ticks after the pause

        def statuses():
            return {h: m["status"] for h, m in json.loads((tmp_path / "elastic" / "status.json").read_text())[
                "members"].items()}

        assert "dead" not in statuses().values(), statuses()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and set(statuses().values()) != {"dead"}:
            time.sleep(0.1)
        assert set(statuses().values()) == {"dead"}
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_lock_held_by_slow_requests_is_not_a_pause_and_hides_no_death(controller):
    """The controller's lock held again and again (a slow disk under its status writes): the other
    threads run meanwhile, so no silence is credited and a silent host is still declared dead."""
    client = ControllerClient(controller.url, "s3cret")
    for host in ("h0", "h1"):
        client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
    stop = threading.Event()

    def hog():
        while not stop.is_set():
            with controller._lock:
                time.sleep(1.2)
            time.sleep(0.01)

    hogging = threading.Thread(target=hog, daemon=True)
    hogging.start()
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and controller.members["h1"].status != "dead":
            time.sleep(0.1)
    finally:
        stop.set()
        hogging.join()
    assert controller.members["h1"].status == "dead"


def test_a_member_a_step_behind_is_not_a_holder_so_the_world_broadcasts(controller):
    client = ControllerClient(controller.url, "s3cret")
    for host in ("h0", "h1"):
        client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
    # Both alive; a collective failed after h1 completed step 7 but before h0 did.
    replies = {}
    threads = [threading.Thread(target=lambda h=h, done=done: replies.__setitem__(h, client.call(
        "/reform", host=h, generation=0, completed_step=done, data_position={"step": done}, reason="failure")))
        for h, done in (("h0", 6), ("h1", 7))]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    world = replies["h0"]["world"]
    assert world["members"] == ["h0", "h1"] and world["resume_step"] == 7 and world["source"] == "h1"
    assert world["holders"] == ["h1"]  # h0 holds step 6's state: it must receive h1's


def test_a_world_that_failed_while_forming_restores_from_disk_not_from_a_member_without_state(controller):
    client = ControllerClient(controller.url, "s3cret")
    for host in ("h0", "h1"):
        client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
    # h1 died while generation 0 formed; h0 never held a state in memory (completed_step -1).
    reply = client.call("/reform", host="h0", generation=0, completed_step=-1, data_position=None,
                        reason="failure")
    world = reply["world"]
    assert world["generation"] == 1 and world["members"] == ["h0"]
    assert world["source"] is None and world["resume_step"] == 0  # the newest checkpoint, not zeros
    assert world["holders"] == []
    assert controller.restarts == 0  # no step ran since the checkpoint: nothing was lost


def test_a_restore_from_disk_after_steps_ran_counts_a_restart(controller):
    client = ControllerClient(controller.url, "s3cret")
    for host in ("h0", "h1"):
        client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
    client.call("/progress", host="h0", generation=0, step=1)  # generation 0 ran steps
    reply = client.call("/reform", host="h0", generation=0, completed_step=-1, data_position=None,
                        reason="failure")
    assert reply["world"]["source"] is None and controller.restarts == 1


def _heartbeat(client, host, generation=0, step=0, **kw):
    return client.call("/heartbeat", host=host, generation=generation, step=step, **kw)


def test_a_stall_with_every_member_alive_is_waited_out_and_a_dead_member_aborts_the_world(tmp_path):
    ctl = Controller(config_hash="a" * 64, expected_hosts=2, run_dir=tmp_path, token="t", dead_after_seconds=60)
    try:
        client = ControllerClient(ctl.url, "t")
        for host in ("h0", "h1"):
            client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
        reply = _heartbeat(client, "h0", step=9, stalled_seconds=4.5, deadline_seconds=2.0,
                           timings=[[9, 0.01, 0.2, 0.0]])
        assert reply == {"reform_signal": 0, "abort": False, "stop": None, "precompiled": -1}  # backpressure: keep waiting
        _heartbeat(client, "h0", step=10, timings=[[10, 0.0, 4.6, 0.0]])  # ... and the step completes
        (stall,) = ctl.elastic_report()["stalls"]
        assert stall["step"] == 10 and stall["deadline_seconds"] == 2.0 and "all 2 members alive" in stall["response"]
        assert ctl.world.generation == 0
        ctl.mark_dead("h1", "process exited with code -9")
        assert _heartbeat(client, "h0", step=10, stalled_seconds=5.0, deadline_seconds=2.0)["abort"] is True
        assert len(ctl.elastic_report()["stalls"]) == 1  # a dead member is not a stall
    finally:
        ctl.close()


def _steady_timings(step, ready):
    return [[step, ready, 0.1, 0.0]]


def test_a_straggler_is_replaced_by_a_spare_at_a_step_boundary(tmp_path):
    ctl = Controller(config_hash="a" * 64, expected_hosts=3, run_dir=tmp_path, token="t", dead_after_seconds=60,
                     total_steps=100, straggler_factor=1.5, straggler_window=5)
    try:
        client = ControllerClient(ctl.url, "t")
        for host in ("h0", "h1", "h2"):
            client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
        client.call("/register", host="h3", region="us", devices=2, config_hash="a" * 64, spare=True)
        assert ctl.world.members == ("h0", "h1", "h2") and ctl.members["h3"].status == "spare"
        for step in range(1, 8):
            for host in ("h0", "h1", "h2"):
                _heartbeat(client, host, step=step, timings=_steady_timings(step, 0.5 if host == "h1" else 0.01))
        deadline = time.monotonic() + 5  # the controller's monitor judges timings every 50 ms
        while _heartbeat(client, "h0", step=7)["reform_signal"] != 1:  # change the world at the next boundary
            assert time.monotonic() < deadline, "the straggler was not acted on"
            time.sleep(0.05)
        replies = {}
        threads = [threading.Thread(target=lambda h=h: replies.__setitem__(h, client.call(
            "/reform", host=h, generation=0, completed_step=8, data_position={"step": 8}, reason="change")))
            for h in ("h0", "h1", "h2")]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        world = replies["h0"]["world"]
        assert world["members"] == ["h0", "h2", "h3"] and world["resume_step"] == 8 and world["source"] == "h0"
        assert world["holders"] == ["h0", "h2"]  # not the spare, not the evicted straggler: h3 needs a broadcast
        assert replies["h1"] == {"evicted": True}
        (event,) = ctl.elastic_report()["events"]
        assert event["reason"] == "reslot" and event["reslotted"] == ["h1"] and event["joined"] == ["h3"]
        assert event["decision"]["action"] == "replace" and event["decision"]["ratio"] >= 1.5
    finally:
        ctl.close()


def test_an_operator_drain_takes_a_host_out_at_a_step_boundary_and_bad_drains_are_refused(tmp_path):
    ctl = Controller(config_hash="a" * 64, expected_hosts=2, run_dir=tmp_path, token="t", dead_after_seconds=60,
                     min_hosts=2)
    try:
        client = ControllerClient(ctl.url, "t")
        for host in ("h0", "h1"):
            client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
        with pytest.raises(ControllerError, match="runtime.min_hosts 2, and no spare"):
            client.call("/drain", retry_seconds=0, host="h1")
        with pytest.raises(ControllerError, match="h7 is not an active member"):
            client.call("/drain", retry_seconds=0, host="h7")
        client.call("/register", host="h2", region="eu", devices=2, config_hash="a" * 64, spare=True)
        assert client.call("/drain", host="h1")["pending"]["spare"] == "h2"
        assert _heartbeat(client, "h0", step=3)["reform_signal"] == 1
        replies = {}
        threads = [threading.Thread(target=lambda h=h: replies.__setitem__(h, client.call(
            "/reform", host=h, generation=0, completed_step=4, data_position={"step": 4}, reason="change")))
            for h in ("h0", "h1")]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        assert replies["h0"]["world"]["members"] == ["h0", "h2"] and replies["h1"] == {"evicted": True}
        (event,) = ctl.elastic_report()["events"]
        assert event["reason"] == "drain" and event["reslotted"] == ["h1"] and event["joined"] == ["h2"]
        assert ctl.members["h1"].status == "drained"
    finally:
        ctl.close()


def test_a_signal_asks_every_member_to_stop_and_a_second_kills_the_workers(controller):
    """SIGTERM on the driver: heartbeat replies carry the stop (the workers agree on the step
    through their per-step all-gather); a second signal kills the workers and unwinds the wait."""
    import signal

    from resilient_jax.elastic.run import _KillNow, _StopOnSignal

    client = ControllerClient(controller.url, "s3cret")
    for host in ("h0", "h1"):
        client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
    killed = []
    stop = _StopOnSignal(controller, lambda: killed.append(True))
    stop(signal.SIGTERM, None)
    assert _heartbeat(client, "h0")["stop"] == "preempted" and not killed
    stop.waiting = True
    with pytest.raises(_KillNow) as second:
        stop(signal.SIGINT, None)
    assert killed and second.value.twice


def test_a_client_that_vanishes_mid_request_leaves_no_traceback_and_the_run_is_served(tmp_path, capfd):
    # A worker killed (or Ctrl-C'd) between sending its headers and its body: the controller must
    # neither call the handler with an empty body nor print a traceback when its reply finds no one.
    ctl = Controller(config_hash="a" * 64, expected_hosts=1, run_dir=tmp_path, token="s3cret")
    host, port = ctl.url.removeprefix("http://").split(":")
    try:
        for _ in range(5):
            with socket.create_connection((host, int(port))) as gone:
                gone.sendall(b"POST /heartbeat HTTP/1.1\r\nAuthorization: Bearer s3cret\r\nContent-Length: 40\r\n\r\n")
        good = ControllerClient(ctl.url, "s3cret")
        assert good.call("/register", host="h0", region="us", devices=2, config_hash="a" * 64)["accepted"]
    finally:
        ctl.close()
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out, captured.err


def test_the_cold_start_is_launch_to_the_first_step_and_each_recovery_is_compared_with_it(tmp_path):
    launched = time.monotonic() - 4.0  # the driver started 4 s ago (its imports, the controller)
    ctl = Controller(config_hash="a" * 64, expected_hosts=2, run_dir=tmp_path, token="s3cret", dead_after_seconds=2,
                     launched_at=launched)
    try:
        client = ControllerClient(ctl.url, "s3cret")
        for host in ("h0", "h1"):
            client.call("/register", host=host, region="us", devices=2, config_hash="a" * 64)
        assert ctl.elastic_report()["cold_start_seconds"] is None  # no step done yet
        client.call("/progress", host="h0", generation=0, step=1)
        cold = ctl.elastic_report()["cold_start_seconds"]
        assert 4.0 <= cold <= 4.0 + (time.monotonic() - launched - 4.0)  # from the launch, not the controller
        # h1 falls silent after step 3; h0 asks for the next world and completes its first step.
        client.call("/reform", host="h0", generation=0, completed_step=3, data_position={"step": 3},
                    reason="failure")
        client.call("/progress", host="h0", generation=1, step=4)
        report = ctl.elastic_report()
        assert report["cold_start_seconds"] == cold  # generation 0's, whatever came after
        (event,) = report["events"]
        assert event["reason"] == "failure" and event["recovery_seconds"] is not None
        assert event["recovery_vs_cold_start"] == round(event["recovery_seconds"] / cold, 3)
    finally:
        ctl.close()


def _status_files(run_dir, *, error=None):
    (run_dir / "elastic").mkdir(parents=True)
    (run_dir / "elastic" / "status.json").write_text(json.dumps({
        "controller": "http://127.0.0.1:1", "generation": 0, "step": 21, "finished": False, "error": error,
        "members": {"h0": {"region": "us", "status": "active", "generation": 0, "step": 21, "step_seconds": 0.1}},
        "events": []}))


def test_status_of_a_run_whose_driver_was_killed_says_so_and_how_to_resume(tmp_path, capsys):
    import socket
    import subprocess
    import sys

    from resilient_jax.elastic.__main__ import drain, status

    _status_files(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)  # exited: a driver SIGKILLed without removing controller.json
    (tmp_path / "elastic" / "controller.json").write_text(
        json.dumps({"url": "http://127.0.0.1:1", "pid": pid, "host": socket.gethostname()}))
    assert status(tmp_path) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"the run is not running: its driver (pid {pid}) is gone without finishing") and \
        first.endswith("Rerun the train command to resume from the last checkpoint"), first
    assert drain(tmp_path, "h0") == 2 and f"its driver (pid {pid}) is gone" in capsys.readouterr().err
    # A failed invocation's status is not spoken for by an earlier invocation's summary.json.
    other = tmp_path / "failed"
    _status_files(other, error="worker h0 failed: ...")
    (other / "summary.json").write_text(json.dumps({"stopped": "stop_at", "final_step": 30}))
    assert status(other) == 0
    assert capsys.readouterr().out.splitlines()[0] == "the run is over: it failed (the error is below)"


def test_drain_that_cannot_read_the_run_files_is_one_line(tmp_path, monkeypatch, capsys):
    # The token is 0600: drain from another account raised PermissionError with a traceback.
    from pathlib import Path

    from resilient_jax.elastic.__main__ import drain

    (tmp_path / "elastic").mkdir()
    (tmp_path / "elastic" / "controller.json").write_text("{")  # cut short
    (tmp_path / "elastic" / "token").write_text("t")
    assert drain(tmp_path, "h1") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: drain h1: cannot read the run's ") and "\n" not in err, err
    assert "account" not in err
    real = Path.read_text

    def denied(self, *a, **kw):
        if self.name == "token":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", denied)
    assert drain(tmp_path, "h1") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: drain h1: cannot read the run's {tmp_path / 'elastic' / 'token'} (Permission denied); "
                   "run drain as the account that started the run"), err
