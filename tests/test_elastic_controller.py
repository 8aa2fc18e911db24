"""The controller's membership rules and its control channel, without training processes."""

from __future__ import annotations

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
    check_bind("0.0.0.0", "tok")
    check_bind("127.0.0.1", "")


def test_wrong_token_is_refused_and_the_run_is_not_disturbed(controller):
    intruder = ControllerClient(controller.url, "wrong")
    with pytest.raises(ControllerError, match="token"):
        intruder.call("/register", retry_seconds=0, host="h9", region="x", devices=2, config_hash="a" * 64)
    assert "h9" not in controller.members
    good = ControllerClient(controller.url, "s3cret")
    assert good.call("/register", host="h0", region="us", devices=2, config_hash="a" * 64)["accepted"]


def test_other_config_hash_is_refused_with_both_hashes_named(controller):
    client = ControllerClient(controller.url, "s3cret")
    with pytest.raises(ControllerError, match="config bbbbbbbb") as err:
        client.call("/register", retry_seconds=0, host="h0", region="us", devices=2, config_hash="b" * 64)
    assert "aaaaaaaa" in str(err.value)
    assert controller.members == {}


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
    # h1 never speaks again; h0 reports a failed collective after completing step 6.
    reply = client.call("/reform", host="h0", generation=0, completed_step=6, data_position={"step": 7},
                        reason="failure")
    world = reply["world"]
    assert world["generation"] == 1 and world["members"] == ["h0"]
    assert world["resume_step"] == 7 and world["source"] == "h0"
    assert controller.members["h1"].status == "dead"
    (event,) = controller.elastic_report()["events"]
    assert event["lost"] == ["h1"] and event["steps_lost"] == 0
