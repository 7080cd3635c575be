"""TLS on the API listener and the admin listener's actions on TCP (issue 30, point 8).

API keys crossed the LAN in clear text; the admin listener, once moved to TCP as the
README suggests for Prometheus, served ``POST /models/swap`` to anyone."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import stat
import subprocess
from pathlib import Path

import httpx
import trio

from forged.daemon.tls import TLS
from tests.conftest import DaemonFactory
from tests.daemonproc import free_port
from tests.test_models import as_toml


def self_signed(tmp: Path, name: str) -> tuple[Path, Path]:
    """A self-signed pair for 127.0.0.1 (openssl, as the package makes one)."""
    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def served_certificate(port: int) -> str:
    """The SHA-256 of the certificate a new connection to ``port`` is shown."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest()


def fingerprint(cert: Path) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert.read_text())).hexdigest()


async def test_the_api_speaks_tls_and_a_reload_renews_the_certificate(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    cert, key = self_signed(tmp_path, "first")
    with trio.fail_after(90):
        async with start_daemon(tiny_model, server={
                "tls_cert": str(cert), "tls_key": str(key)}) as d:
            port = int(d.url.rsplit(":", 1)[1])
            url = f"https://127.0.0.1:{port}"
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(cert)),
                                         timeout=30) as c:
                r = await c.post(url + "/v1/completions", json={"prompt": "x",
                                                                "max_tokens": 2})
                assert r.status_code == 200, r.text
            async with httpx.AsyncClient(timeout=10) as plain:
                try:
                    r = await plain.get(f"http://127.0.0.1:{port}/health")
                    refused = r.status_code >= 400
                except httpx.HTTPError:
                    refused = True
                assert refused  # no clear text on a TLS listener
            assert await trio.to_thread.run_sync(served_certificate, port) == fingerprint(cert)

            # a renewed certificate at the same paths; the reload reads it again
            new_cert, new_key = self_signed(tmp_path, "second")
            cert.write_bytes(new_cert.read_bytes())
            key.write_bytes(new_key.read_bytes())
            d.daemon.config_path.write_text(as_toml(d.daemon.cfg))
            d.daemon.reload()
            assert await trio.to_thread.run_sync(served_certificate, port) == \
                fingerprint(new_cert)

async def test_a_reload_of_a_mismatched_pair_keeps_serving_the_old_one(
        tmp_path: Path) -> None:
    """A renewed certificate copied in before its key: the reload fails, and the old
    pair must still serve (OpenSSL had installed the new certificate before it found
    the key did not match: every handshake then failed)."""
    cert, key = self_signed(tmp_path, "first")
    first = fingerprint(cert)
    tls = TLS(str(cert), str(key))
    cert.write_bytes(self_signed(tmp_path, "second")[0].read_bytes())
    tls.reload()
    with trio.fail_after(30):
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        port = listener.socket.getsockname()[1]

        async def serve_one() -> None:
            raw = await listener.accept()
            try:
                await trio.SSLStream(raw, tls.context, server_side=True).do_handshake()
            except trio.BrokenResourceError:
                pass  # the client says why
            finally:
                await raw.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_one)
            seen = await trio.to_thread.run_sync(served_certificate, port)
        await listener.aclose()
    assert seen == first


async def test_admin_actions_on_tcp_need_the_admin_token(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    port = free_port()
    admin = f"http://127.0.0.1:{port}"
    swap = {"path": str(tmp_path / "missing.gguf")}
    with trio.fail_after(90):
        async with start_daemon(tiny_model, server={"admin_listen": f"127.0.0.1:{port}"}) \
                as d, httpx.AsyncClient(base_url=admin, timeout=30) as c:
            assert (await c.get("/metrics")).status_code == 200  # read-only: open
            r = await c.post("/models/swap", json=swap)
            assert r.status_code == 403 and "admin_token" in r.json()["error"]

            d.daemon.config_path.write_text(
                as_toml(d.daemon.cfg).replace('admin_token = ""', 'admin_token = "s3cret"'))
            d.daemon.reload()
            assert (await c.post("/models/swap", json=swap)).status_code == 401
            r = await c.post("/models/swap", json=swap,
                             headers={"Authorization": "Bearer s3cret"})
            # past the guard: the swap itself refuses a file that is not there
            assert r.status_code == 409, r.text


async def test_the_admin_socket_lets_its_group_connect(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """Under the unit's UMask=0027 the socket was 0750: connecting needs write
    permission, so the forged group the docs name (sudo adduser alice forged) could not
    run forged status. Its folder (0750 under /run) keeps everyone else out."""
    old = os.umask(0o027)
    metrics = Path(tmp_path) / "metrics.sock"
    try:
        with trio.fail_after(60):
            async with start_daemon(tiny_model,
                                    server={"metrics_listen": f"unix:{metrics}"}) as d:
                modes = [stat.S_IMODE(os.stat(p).st_mode) for p in (d.admin_sock, metrics)]
    finally:
        os.umask(old)
    # A Unix metrics socket too (a proxy or an exporter in the group): it was 0750.
    assert all(m & 0o060 == 0o060 and not m & 0o007 for m in modes), list(map(oct, modes))
