"""TLS for the control channel: which certificate the controller serves, and what clients trust.

`runtime.tls`:
- `off`: plain HTTP; allowed on loopback only (channel.check_bind).
- `auto`: a per-run CA and a server certificate for `runtime.bind`, made with `cryptography` under
  run.dir/elastic/tls/ (keys mode 0600). The CA's private key is never written: it signs the one
  server certificate and is dropped, so nothing on disk can mint another. Workers a launcher starts
  get the CA's PEM in $RESILIENT_JAX_TLS_CA_PEM; a hand-started worker is given ca.pem with --tls-ca.
- `files`: the operator's `runtime.tls_cert`, `runtime.tls_key` (the controller's) and
  `runtime.tls_ca` (what workers verify it against).

Every certificate is checked before the controller starts by one in-memory TLS handshake between
the server context and a client context that trusts only the CA and expects `runtime.bind` as the
host name -- exactly what a worker will do -- so a wrong key, CA or host name fails at start-up
with one line naming the file, not later as a worker that cannot connect.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from resilient_jax.config import ConfigError

CA_ENV = "RESILIENT_JAX_TLS_CA_PEM"  # the CA's PEM text, for workers started by a launcher
AUTO_VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ServerTls:
    cert: Path
    key: Path
    ca: Path  # what clients verify the controller against

    @property
    def ca_pem(self) -> str:
        return self.ca.read_text()

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context


def client_context(ca_pem: str = "") -> ssl.SSLContext:
    """Verifies the controller's certificate and host name; against `ca_pem` only when given, else the
    system's CAs (a controller certificate from a public CA)."""
    context = ssl.create_default_context(cadata=ca_pem or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def check_config(runtime, token: str) -> None:
    """Start-up rules for runtime.tls*; raises ConfigError naming the key or file."""
    from resilient_jax.elastic.channel import check_bind

    given = [k for k in ("tls_cert", "tls_key", "tls_ca") if getattr(runtime, k)]
    if runtime.tls != "files" and given:
        raise ConfigError(f"runtime.{given[0]} is set but runtime.tls is {runtime.tls}: set runtime.tls=files to "
                          "serve your certificate, or remove runtime.tls_cert/tls_key/tls_ca")
    try:
        check_bind(runtime.bind, token, runtime.tls != "off")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if runtime.tls == "files":
        files_tls(runtime)


def files_tls(runtime) -> ServerTls:
    missing = [f"runtime.{k}" for k in ("tls_cert", "tls_key", "tls_ca") if not getattr(runtime, k)]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: not set; runtime.tls=files needs the controller's certificate "
                          "(tls_cert), its private key (tls_key) and the CA workers verify it against (tls_ca), as PEM files")
    tls = ServerTls(Path(runtime.tls_cert), Path(runtime.tls_key), Path(runtime.tls_ca))
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    parsers = {"tls_cert": ("a PEM certificate", x509.load_pem_x509_certificate),
               "tls_key": ("an unencrypted PEM private key", lambda data: serialization.load_pem_private_key(data, None)),
               "tls_ca": ("a PEM CA certificate", x509.load_pem_x509_certificates)}
    for key, path in (("tls_cert", tls.cert), ("tls_key", tls.key), ("tls_ca", tls.ca)):
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"runtime.{key}: cannot read {path} ({e.strerror or e})") from None
        what, parse = parsers[key]
        try:
            parse(data)
        except (ValueError, TypeError):
            raise ConfigError(f"runtime.{key}: {path} is not {what}") from None
    verify(tls, runtime.bind)
    return tls


def prepare(runtime, run_dir: Path) -> ServerTls | None:
    """The controller's TLS material for this run (None for tls=off); `auto` reuses the run's
    certificate while it still verifies for runtime.bind, so hand-started workers keep their ca.pem
    across invocations."""
    if runtime.tls == "off":
        return None
    if runtime.tls == "files":
        return files_tls(runtime)
    directory = Path(run_dir) / "elastic" / "tls"
    tls = ServerTls(directory / "server.pem", directory / "server.key", directory / "ca.pem")
    if all(p.is_file() for p in (tls.cert, tls.key, tls.ca)):
        try:
            verify(tls, runtime.bind)
            return tls
        except ConfigError:
            pass  # made for another runtime.bind: make a new one
    make_auto(directory, runtime.bind)
    verify(tls, runtime.bind)
    return tls


def verify(tls: ServerTls, host: str) -> None:
    """One in-memory handshake: `tls` served, a client trusting only tls.ca and expecting `host`."""
    try:
        server = tls.server_context()
    except ssl.SSLError as e:
        raise ConfigError(f"runtime.tls_key: {tls.key} is not the private key of {tls.cert} or not PEM "
                          f"({e.reason or e})") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"runtime.tls_cert: {tls.cert} with key {tls.key} could not be loaded ({e})") from None
    try:
        client = client_context(tls.ca.read_text())
    except (ssl.SSLError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"runtime.tls_ca: {tls.ca} is not a PEM CA certificate ({e})") from None
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(to_client, to_server, server_hostname=connect_host(host))
    s = server.wrap_bio(to_server, to_client, server_side=True)
    for _ in range(10):
        done = 0
        for side in (c, s):
            try:
                side.do_handshake()
                done += 1
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except ssl.SSLCertVerificationError as e:
                if "hostname" in (e.verify_message or "").lower() or "ip address" in (e.verify_message or "").lower():
                    raise ConfigError(f"runtime.tls_cert: {tls.cert} is not for {host} (runtime.bind): "
                                      f"{(e.verify_message or '').rstrip('.')}; issue one whose subjectAltName includes {host}") from None
                raise ConfigError(f"runtime.tls_ca: {tls.cert} does not verify against {tls.ca} "
                                  f"({e.verify_message}); set runtime.tls_ca to the CA that signed it") from None
            except ssl.SSLError as e:
                raise ConfigError(f"runtime.tls_cert: TLS handshake with {tls.cert} failed ({e.reason or e})") from None
        if done == 2:
            return
    raise ConfigError(f"runtime.tls_cert: TLS handshake with {tls.cert} did not complete")


def connect_host(bind: str) -> str:
    """The name clients dial for a controller bound to `bind` (a wildcard bind: this machine's name)."""
    try:
        if ipaddress.ip_address(bind).is_unspecified:
            return socket.getfqdn()
    except ValueError:
        pass
    return bind


def make_auto(directory: Path, bind: str) -> None:
    """A fresh CA and a server certificate for `bind`, written under `directory` (keys 0600)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    host = connect_host(bind)
    try:
        names = [x509.IPAddress(ipaddress.ip_address(host))]
    except ValueError:
        names = [x509.DNSName(host)]
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "resilient_jax run CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + AUTO_VALIDITY)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + AUTO_VALIDITY)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    pem = serialization.Encoding.PEM
    _write(directory / "server.key", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()), 0o600)
    _write(directory / "server.pem", cert.public_bytes(pem), 0o644)
    _write(directory / "ca.pem", ca_cert.public_bytes(pem), 0o644)


def _write(path: Path, data: bytes, mode: int) -> None:
    # Created with its mode (no window where a key is world-readable), replaced atomically.
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
