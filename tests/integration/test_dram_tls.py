"""TLS on a DRAM storage node's TCP listener, with a self-signed certificate made by the test.

The same-host shared-memory path is a local Unix socket and stays as it is; TCP clients verify the
node's certificate with the store option ``tls_ca``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import uuid

import pytest

from tests.conftest import _server
from tq_redis.backends.dram.launcher import _log_tail, spawn_node
from tq_redis.backends.dram.store import DramStore
from tq_redis.errors import StorageAuthError, StorageUnavailable

x509 = pytest.importorskip("cryptography.x509", reason="the cryptography package makes the test certificate")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

TOKEN = "tls-s3cret"


def self_signed(directory, common_name: str = "tq-dram-test") -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key, as PEM files in ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(directory, "node.crt"), os.path.join(directory, "node.key")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))  # fmt: skip
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory):
    cert, key = self_signed(str(tmp_path_factory.mktemp("tls")))
    ns = f"tls{uuid.uuid4().hex[:6]}"
    url = _server("valkey").url
    node = spawn_node(
        url, ns, capacity="128MiB", token=TOKEN,
        extra_args=("--tls-cert", cert, "--tls-key", key, "--handshake-timeout", "1"),
    )  # fmt: skip
    node.ns, node.url, node.cert = ns, url, cert
    yield node
    node.stop()


@pytest.fixture
def make_store(tls_node):
    made = []

    def make(**kw) -> DramStore:
        kw.setdefault("token", TOKEN)
        s = DramStore(tls_node.url, tls_node.ns, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_tcp_clients_speak_tls_and_verify_the_node(tls_node, make_store):
    assert tls_node.info["tls"] is True
    store = make_store(shm=False, tls_ca=tls_node.cert)
    value = os.urandom(5 << 20)  # several TLS records each way
    keys = [f"k{i}" for i in range(50)]
    store.put(keys, [[value[i * 1000 : (i + 1) * 1000]] for i in range(49)] + [[value]])
    got = store.get(keys)
    assert bytes(got[-1]) == value and bytes(got[3]) == value[3000:4000]
    (link,) = store._current_ring().links
    conn = link.acquire()
    try:
        assert isinstance(conn.sock, ssl.SSLSocket) and conn.sock.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        link.release(conn)
    store.delete(keys)


def test_an_unverified_certificate_or_plain_tcp_is_refused(tls_node, make_store):
    with pytest.raises(StorageAuthError, match="certificate did not verify.*tls_ca"):
        make_store(shm=False).put(["k"], [[b"v"]])  # the system CAs do not know a self-signed cert
    with pytest.raises(StorageUnavailable):
        make_store(shm=False, tls=False, timeout_s=1.0).put(["k"], [[b"v"]])  # plain TCP to a TLS listener
    with socket.create_connection(tls_node.address.rsplit(":", 1)) as s:  # garbage instead of a ClientHello
        s.settimeout(5)
        s.sendall(b"\xff" * 32)
        try:
            assert s.recv(1 << 16) == b""  # closed (an alert first would be read here instead)
        except ConnectionResetError:
            pass
    assert tls_node.proc.poll() is None
    assert "TLS failed" in _log_tail(tls_node.log_file)
    store = make_store(shm=False, tls_ca=tls_node.cert)
    store.put(["ok"], [[b"v"]])
    assert bytes(store.get(["ok"])[0]) == b"v"


def test_the_same_host_shared_memory_path_stays_local(tls_node, make_store):
    store = make_store(shm=True, tls_ca=tls_node.cert)
    store.put(["shm"], [[b"s" * 400_000]])  # through shared memory
    (link,) = store._current_ring().links
    assert link.local_ok is True
    conn = link.acquire()
    try:
        assert conn.sock.family == socket.AF_UNIX and not isinstance(conn.sock, ssl.SSLSocket)
    finally:
        link.release(conn)
    assert bytes(store.get(["shm"])[0]) == b"s" * 400_000
    # without tls_ca the local path still works: TLS only guards TCP
    assert bytes(make_store(shm=True).get(["shm"])[0]) == b"s" * 400_000
