"""The control channel over TLS (resilient_jax.elastic.tls), on 127.0.0.0/8 with TLS forced on.

Unit level: a real Controller serving https and real clients (urllib), no training processes,
except one slow test that runs a whole cpu-4host elastic run with runtime.tls=auto.
"""

from __future__ import annotations

import json
import socket
import stat

import pytest

from resilient_jax.config import ConfigError, load_config
from resilient_jax.elastic import run as run_lib
from resilient_jax.elastic import tls as tls_lib
from resilient_jax.elastic.channel import ControllerClient, ControllerError
from resilient_jax.elastic.controller import Controller

from conftest import REPO, read_summary, run_cli

CPU4 = REPO / "configs" / "cpu-4host.yaml"
HASH = "a" * 64


def cfg_with(tmp_path, *overrides: str):
    return load_config(CPU4, [f"run.dir={tmp_path}", *overrides])


@pytest.fixture
def auto_tls(tmp_path):
    return tls_lib.prepare(cfg_with(tmp_path, "runtime.tls=auto").runtime, tmp_path)


@pytest.fixture
def controller(tmp_path, auto_tls):
    ctl = Controller(config_hash=HASH, expected_hosts=2, run_dir=tmp_path, token="s3cret", tls=auto_tls)
    yield ctl
    ctl.close()


def register(client: ControllerClient, host: str, **kw) -> dict:
    return client.call("/register", host=host, region="us", devices=2, config_hash=HASH, **kw)


def test_auto_makes_a_ca_and_a_server_certificate_with_private_keys_0600(tmp_path, auto_tls):
    directory = tmp_path / "elastic" / "tls"
    assert sorted(p.name for p in directory.iterdir()) == ["ca.pem", "server.key", "server.pem"]
    assert stat.S_IMODE(auto_tls.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert "PRIVATE KEY" not in auto_tls.ca.read_text()  # the CA's key is never written
    # A second invocation of the same run keeps the CA, so hand-started workers keep their ca.pem.
    again = tls_lib.prepare(cfg_with(tmp_path, "runtime.tls=auto").runtime, tmp_path)
    assert again.ca_pem == auto_tls.ca_pem


def test_tls_client_round_trip_register_heartbeat_and_status(controller, auto_tls):
    assert controller.url.startswith("https://127.0.0.1:")
    client = ControllerClient(controller.url, "s3cret", ca_pem=auto_tls.ca_pem)
    assert register(client, "h0")["accepted"]
    register(client, "h1")
    assert isinstance(client.call("/heartbeat", host="h0", generation=0, step=0), dict)
    status = client.call("/status", method="GET")
    assert sorted(status["members"]) == ["h0", "h1"]


def test_plaintext_client_is_refused_and_good_clients_keep_being_served(controller, auto_tls):
    plaintext = ControllerClient(controller.url.replace("https://", "http://"), "s3cret")
    with pytest.raises(ControllerError, match="unreachable"):
        register(plaintext, "h9", retry_seconds=0)
    assert "h9" not in controller.members
    good = ControllerClient(controller.url, "s3cret", ca_pem=auto_tls.ca_pem)
    assert register(good, "h0")["accepted"]


def test_client_with_another_ca_is_refused_at_once(controller, auto_tls, tmp_path):
    other = tls_lib.prepare(cfg_with(tmp_path / "other", "runtime.tls=auto").runtime, tmp_path / "other")
    assert other.ca_pem != auto_tls.ca_pem
    stranger = ControllerClient(controller.url, "s3cret", ca_pem=other.ca_pem)
    with pytest.raises(ControllerError, match="not the one this run trusts: .*certificate"):
        register(stranger, "h9", retry_seconds=30)  # a verification failure is not retried for 30 s
    assert "h9" not in controller.members
    good = ControllerClient(controller.url, "s3cret", ca_pem=auto_tls.ca_pem)
    assert register(good, "h0")["accepted"]


def test_a_silent_connection_does_not_hold_up_other_clients(controller, auto_tls):
    # A client that connects and never starts the handshake: accept must not wait on it.
    with socket.create_connection(("127.0.0.1", controller.server.server_address[1])):
        good = ControllerClient(controller.url, "s3cret", ca_pem=auto_tls.ca_pem, timeout=5)
        assert register(good, "h0", retry_seconds=0)["accepted"]


def test_client_refuses_a_controller_whose_certificate_names_another_host(tmp_path):
    # Certificate for 127.0.0.2 served on 127.0.0.1: the client's host-name check refuses it.
    tls_lib.make_auto(tmp_path / "elastic" / "tls", "127.0.0.2")
    wrong = tls_lib.ServerTls(*(tmp_path / "elastic" / "tls" / n for n in ("server.pem", "server.key", "ca.pem")))
    ctl = Controller(config_hash=HASH, expected_hosts=1, run_dir=tmp_path, token="s3cret", tls=wrong)
    try:
        client = ControllerClient(ctl.url, "s3cret", ca_pem=wrong.ca_pem)
        with pytest.raises(ControllerError, match="127.0.0.1"):
            register(client, "h0", retry_seconds=0)
        assert ctl.members == {}
    finally:
        ctl.close()


# -- start-up validation (the config path; nothing is bound off loopback) -----------------------------


@pytest.mark.parametrize("overrides, named", [
    ([], ["runtime.token", "runtime.tls"]),
    (["runtime.token=tok"], ["runtime.tls"]),
    (["runtime.tls=auto"], ["runtime.token"]),
])
def test_off_loopback_without_token_or_tls_refuses_naming_the_keys(tmp_path, monkeypatch, overrides, named):
    monkeypatch.delenv("RESILIENT_JAX_TOKEN", raising=False)
    cfg = cfg_with(tmp_path, "runtime.bind=10.1.2.3", *overrides)
    with pytest.raises(ConfigError) as err:
        run_lib.validate(cfg)
    message = str(err.value)
    assert "\n" not in message and "10.1.2.3" in message
    for key in named:
        assert key in message
    for key in {"runtime.token", "runtime.tls"} - set(named):
        assert key not in message


def test_off_loopback_with_token_and_tls_passes_validation(tmp_path, monkeypatch):
    monkeypatch.delenv("RESILIENT_JAX_TOKEN", raising=False)
    run_lib.validate(cfg_with(tmp_path, "runtime.bind=10.1.2.3", "runtime.token=tok", "runtime.tls=auto"))
    monkeypatch.setenv("RESILIENT_JAX_TOKEN", "from-env")
    run_lib.validate(cfg_with(tmp_path, "runtime.bind=10.1.2.3", "runtime.tls=auto"))


@pytest.mark.parametrize("url, problem", [
    ("http://192.0.2.2:8470", "is plain http to another machine: the run's token would cross the network in clear"),
    ("ftp://127.0.0.1:8470", "is not a controller address"),
    ("127.0.0.1:8470", "is not a controller address"),
])
def test_a_client_refuses_an_address_it_would_send_the_token_to_unverified(url, problem):
    with pytest.raises(ValueError, match=problem):
        ControllerClient(url, "s3cret")
    ControllerClient("http://127.0.0.1:8470", "s3cret")  # loopback: the controller serves plain http only there


@pytest.mark.parametrize("args, problem", [
    (["--controller", "http://192.0.2.2:8470"], "http://192.0.2.2:8470 is plain http to another machine"),
    (["--controller", "http://127.0.0.1:8470", "--tls-ca", "ca.pem"], "is not https, so --tls-ca ca.pem would verify"),
])
def test_a_hand_started_worker_with_a_plaintext_address_is_one_line_and_sends_nothing(tmp_path, args, problem):
    proc = run_cli("resilient_jax.elastic", "worker", "--host", "h9", "--config-json", str(tmp_path / "none.json"),
                   *args, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: --controller ") and problem in line, line


def test_a_worker_the_controller_refuses_at_registration_exits_2_in_one_line(tmp_path):
    # Exit 2 is bad input, as for `python -m resilient_jax.train`: a launcher or an operator's script
    # must not read a wrong token as a crash worth retrying.
    cfg = cfg_with(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    ctl = Controller(config_hash=cfg.hash, expected_hosts=2, run_dir=tmp_path, token="s3cret")
    try:
        proc = run_cli("resilient_jax.elastic", "worker", "--host", "h9", "--controller", ctl.url,
                       "--config-json", str(tmp_path / "config.json"), timeout=120,
                       env={"RESILIENT_JAX_TOKEN": "wrong"})
    finally:
        ctl.close()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: the controller refused h9:") and "token" in line, line


@pytest.mark.parametrize("config_json, problem", [
    ("missing.json", "No such file or directory"),
    ("configs/cpu-4host.yaml", "Expecting value"),  # the YAML instead of the run's resolved JSON
    ("bad.json", "config key train.steps: must be >= 1, got 0"),
])
def test_a_hand_started_worker_with_a_config_json_it_cannot_use_is_one_line(tmp_path, config_json, problem):
    (tmp_path / "bad.json").write_text(json.dumps({**cfg_with(tmp_path).to_dict(), "train": {"steps": 0}}))
    path = REPO / config_json if config_json.startswith("configs/") else tmp_path / config_json
    proc = run_cli("resilient_jax.elastic", "worker", "--host", "h9", "--controller", "http://127.0.0.1:9",
                   "--config-json", str(path), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"error: --config-json {path}: ") and problem in line, line


def test_a_worker_that_cannot_reach_the_controller_says_so_not_refused():
    # (Through the CLI this takes the client's 30 s of registration retries: a briefly unreachable
    # controller is waited for.) It said "the controller refused h50" about a controller that was not there.
    from resilient_jax.elastic.channel import ControllerUnreachable
    from resilient_jax.elastic.worker import _cannot_register

    line = _cannot_register("h9", ControllerUnreachable("controller at http://127.0.0.1:9 unreachable: refused"))
    assert line.startswith("error: h9 cannot reach the controller: controller at http://127.0.0.1:9 unreachable")
    assert _cannot_register("h9", ControllerError("wrong or missing token")) == (
        "error: the controller refused h9: wrong or missing token")


def test_cli_off_loopback_plaintext_is_one_error_line_exit_2(tmp_path):
    proc = run_cli("resilient_jax.train", "--config", str(CPU4), "--set", f"run.dir={tmp_path}",
                   "--set", "runtime.bind=10.1.2.3", "--set", "runtime.token=tok", timeout=120,
                   env={"RESILIENT_JAX_TOKEN": ""})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: runtime.bind is 10.1.2.3") and "runtime.tls" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "elastic" / "controller.json").exists()


@pytest.fixture
def material(tmp_path):
    """A valid CA + certificate for 127.0.0.1, and a second set (other CA, other key) to mix in."""
    good, other = tmp_path / "good", tmp_path / "other"
    tls_lib.make_auto(good, "127.0.0.1")
    tls_lib.make_auto(other, "127.0.0.1")
    return good, other


def files_cfg(tmp_path, cert, key, ca):
    return cfg_with(tmp_path, "runtime.tls=files", f"runtime.tls_cert={cert}", f"runtime.tls_key={key}",
                    f"runtime.tls_ca={ca}")


def test_user_supplied_files_serve_tls(tmp_path, material):
    good, _ = material
    cfg = files_cfg(tmp_path, good / "server.pem", good / "server.key", good / "ca.pem")
    run_lib.validate(cfg)
    server_tls = tls_lib.prepare(cfg.runtime, tmp_path)
    ctl = Controller(config_hash=HASH, expected_hosts=1, run_dir=tmp_path, tls=server_tls)
    try:
        client = ControllerClient(ctl.url, ca_pem=(good / "ca.pem").read_text())
        assert register(client, "h0")["accepted"]
    finally:
        ctl.close()


@pytest.mark.parametrize("case, key", [
    ("missing key setting", "runtime.tls_key"),
    ("cert file absent", "runtime.tls_cert"),
    ("key unreadable (a directory)", "runtime.tls_key"),
    ("cert not PEM", "runtime.tls_cert"),
    ("key of another cert", "runtime.tls_key"),
    ("ca that did not sign it", "runtime.tls_ca"),
    ("cert for another host", "runtime.tls_cert"),
])
def test_bad_tls_files_are_one_line_naming_the_key_and_file(tmp_path, material, case, key):
    good, other = material
    cert, tkey, ca = good / "server.pem", good / "server.key", good / "ca.pem"
    named = None
    if case == "missing key setting":
        tkey = ""
    elif case == "cert file absent":
        cert = named = tmp_path / "nope.pem"
    elif case == "key unreadable (a directory)":  # mode 0 would not stop root; a directory stops everyone
        tkey = named = tmp_path / "keys"
        tkey.mkdir()
    elif case == "cert not PEM":
        cert = named = tmp_path / "garbage.pem"
        cert.write_text("not a certificate\n")
    elif case == "key of another cert":
        tkey = named = other / "server.key"
    elif case == "ca that did not sign it":
        ca = named = other / "ca.pem"
    elif case == "cert for another host":
        tls_lib.make_auto(tmp_path / "elsewhere", "127.0.0.2")
        cert, tkey, ca = (tmp_path / "elsewhere" / n for n in ("server.pem", "server.key", "ca.pem"))
        named = cert
    with pytest.raises(ConfigError) as err:
        run_lib.validate(files_cfg(tmp_path, cert, tkey, ca))
    message = str(err.value)
    assert "\n" not in message and message.startswith(key), message
    if named is not None:
        assert str(named) in message


def test_cert_settings_without_tls_files_are_refused(tmp_path, material):
    good, _ = material
    with pytest.raises(ConfigError, match="runtime.tls_cert is set but runtime.tls is off"):
        run_lib.validate(cfg_with(tmp_path, f"runtime.tls_cert={good / 'server.pem'}"))


def test_drain_cli_verifies_the_controller_with_the_run_ca(tmp_path, controller, auto_tls):
    from resilient_jax.elastic.__main__ import drain

    info = tmp_path / "elastic" / "controller.json"
    (tmp_path / "elastic" / "token").write_text("s3cret")
    info.write_text(json.dumps({"url": controller.url, "pid": 0, "tls_ca": str(auto_tls.ca)}))
    client = ControllerClient(controller.url, "s3cret", ca_pem=auto_tls.ca_pem)
    register(client, "h0")
    register(client, "h1")
    # Over TLS, verified against the run's CA: the controller answers (a world of 2 drains to 1).
    assert drain(tmp_path, "h1") == 0
    # The same command against a CA file that is not the run's: refused, one line, exit 2.
    info.write_text(json.dumps({"url": controller.url, "pid": 0, "tls_ca": str(tmp_path / "missing-ca.pem")}))
    assert drain(tmp_path, "h1") == 2


@pytest.mark.slow
def test_cpu4host_elastic_run_over_tls_auto_to_the_end(tmp_path):
    proc = run_cli("resilient_jax.train", "--config", str(CPU4), "--set", f"run.dir={tmp_path}",
                   "--set", "train.steps=12", "--set", "runtime.tls=auto", "--set", "checkpoint.enabled=false",
                   "--set", "runtime.token=e2e-secret-7f3a", timeout=600)
    logs = "\n".join(p.read_text()[-1500:] for p in sorted((tmp_path / "elastic" / "logs").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}\n{logs}"
    assert "controller https://127.0.0.1:" in proc.stdout + proc.stderr
    summary = read_summary(tmp_path)
    assert summary["final_step"] == 12 and summary["restarts"] == 0
    # The token is written once, to a file only this user can read; no config copy records it.
    holders = [p for p in tmp_path.rglob("*") if p.is_file() and b"e2e-secret-7f3a" in p.read_bytes()]
    assert holders == [tmp_path / "elastic" / "token"]
    assert (tmp_path / "elastic" / "token").stat().st_mode & 0o077 == 0
