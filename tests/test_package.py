"""The .deb packages in a booted systemd (systemd-nspawn), loopback only.

Runs the admin's whole life cycle in order: install, socket activation, requests,
reload, restart under load, watchdog, broken config, upgrade, remove and purge. The
tests of this module share one container and must run in file order.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.nspawn import BootedContainer

pytestmark = pytest.mark.package

DEB_DIR = ROOT / "build" / "deb"
API = "http://127.0.0.1:8080"


def _debs() -> list[Path]:
    debs = sorted(DEB_DIR.glob("forged*_*.deb"))  # forged, and two model packages
    if len(debs) != 3:
        pytest.fail(f"build the packages first (make deb): found {debs} in {DEB_DIR}")
    return debs


def bump_version(deb: Path, suffix: str, out: Path) -> Path:
    """A copy of ``deb`` whose version is higher by ``suffix``: only the control member
    changes, so installing it over ``deb`` is a real dpkg upgrade (maintainer scripts,
    conffiles, units) that costs seconds instead of a second build."""
    work = out / "repack"
    (work / "control").mkdir(parents=True)
    subprocess.run(["ar", "x", str(deb)], cwd=work, check=True, timeout=60)
    control = next(work.glob("control.tar.*"))
    subprocess.run(["tar", "-xf", control.name, "-C", "control"], cwd=work, check=True,
                   timeout=60)
    fields = (work / "control" / "control").read_text()
    version = re.search(r"^Version: (.*)$", fields, re.M)
    assert version is not None
    new_version = version.group(1) + suffix
    (work / "control" / "control").write_text(
        fields.replace(version.group(0), f"Version: {new_version}"))
    control.unlink()
    subprocess.run(["tar", "-cJf", "control.tar.xz", "--owner=0", "--group=0", "-C",
                    "control", "."], cwd=work, check=True, timeout=60)
    data = next(work.glob("data.tar.*"))
    new = out / deb.name.replace(f"_{version.group(1)}_", f"_{new_version}_")
    # dpkg wants the members in this order.
    subprocess.run(["ar", "rc", str(new), "debian-binary", "control.tar.xz", data.name],
                   cwd=work, check=True, timeout=60)
    return new


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BootedContainer]:
    debs = _debs()
    pristine = Path(subprocess.run([str(ROOT / "scripts" / "nspawn-root.sh")], check=True,
                                   capture_output=True, text=True, timeout=600).stdout.strip())
    c = BootedContainer(pristine, tmp_path_factory.mktemp("nspawn"))
    try:
        for deb in debs:
            c.copy_in(deb, f"/root/debs/{deb.name}")
        c.wait_booted()
        yield c
    finally:
        c.close()


def status_text(box: BootedContainer) -> str:
    return box.run("systemctl show -p StatusText --value forged").stdout.strip()


def n_restarts(box: BootedContainer) -> int:
    return int(box.run("systemctl show -p NRestarts --value forged").stdout.strip())


def wait_until(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_1_install(box: BootedContainer) -> None:
    box.run("dpkg -i /root/debs/*.deb", timeout=300)
    assert box.run("test -x /usr/bin/forged && getent passwd forged").stdout.startswith("forged:")
    assert box.run("systemctl is-enabled forged.socket").stdout.strip() == "enabled"
    assert box.run("systemctl is-active forged.socket").stdout.strip() == "active"
    # started by the socket, not at install
    assert box.run("systemctl is-active forged", check=False).stdout.strip() == "inactive"
    stat = box.run("stat -c '%U:%G %a' /etc/forged/forged.toml").stdout.strip()
    assert stat == "root:forged 640"
    # Where model packages (and admins) put [[models]] tables; the daemon's user reads it.
    box.run("test -d /etc/forged/models.d && test -r /etc/forged/models.d/minilm.toml")
    # A self-signed TLS pair for a fresh appliance, its key readable by the daemon only.
    stat = box.run("stat -c '%U:%G %a' /etc/forged/tls/forged.key").stdout.strip()
    assert stat == "root:forged 640"
    box.run("openssl x509 -noout -in /etc/forged/tls/forged.crt")
    # The HAProxy configuration for a pool (README, "More than one node").
    box.run("grep -q 'agent-check' /usr/share/forged/haproxy/forged.cfg")
    # Prometheus' rules and scrape job, Grafana's dashboard (README, "Prometheus and
    # Grafana"), the man page and bash completion (built at package time).
    box.run("grep -q ForgedWorkerRestarting /usr/share/forged/prometheus/forged-rules.yml && "
            "grep -q 'job_name: forged' /usr/share/forged/prometheus/forged-scrape.yml && "
            "grep -q forged-overview /usr/share/forged/grafana/forged-dashboard.json")
    box.run("zcat /usr/share/man/man1/forged.1.gz | grep -q 'forged keys rotate'")
    box.run("grep -q _shtab_forged /usr/share/bash-completion/completions/forged")
    # The hourly index update: the timer runs, and its service succeeds as the daemon's
    # user in its sandbox (no index yet: nothing to do).
    assert box.run("systemctl is-enabled forged-index.timer").stdout.strip() == "enabled"
    assert box.run("systemctl is-active forged-index.timer").stdout.strip() == "active"
    box.run("systemctl start forged-index.service", timeout=120)
    assert box.run("systemctl show -p Result --value forged-index.service"
                   ).stdout.strip() == "success"


def test_2_first_connection_starts_the_service(box: BootedContainer) -> None:
    r = box.run(f"curl -sf --max-time 120 {API}/health", timeout=150)
    assert json.loads(r.stdout) == {"status": "ok"}
    assert box.run("systemctl is-active forged").stdout.strip() == "active"
    wait_until(lambda: "streams" in status_text(box), 30, "a STATUS= line")
    # Lines carry their syslog priority: the open-API warning is a warning, not info.
    warnings = box.run("journalctl -u forged -p warning -o cat --no-pager").stdout
    assert "no API keys" in warnings and "ready:" not in warnings, warnings


def test_3_completion_and_streamed_chat(box: BootedContainer) -> None:
    body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
    r = box.run(f"curl -sf --max-time 60 {API}/v1/completions "
                f"-H 'Content-Type: application/json' -d '{body}'")
    out = json.loads(r.stdout)
    assert out["usage"]["completion_tokens"] > 0 and out["choices"][0]["text"]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "stream": True})
    r = box.run(f"curl -sfN --max-time 60 {API}/v1/chat/completions "
                f"-H 'Content-Type: application/json' -d '{body}'")
    frames = [line for line in r.stdout.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]" and len(frames) >= 3


def test_3b_embeddings_from_the_model_package(box: BootedContainer) -> None:
    """The embedding model's package installs its [[models]] table in models.d/, so
    the daemon serves it from its first start: /v1/embeddings answers with its 384
    dimensions, and `forged index add` (as root, becoming the daemon's user) embeds a
    folder's chunks with it at nice 19."""
    assert "minilm" in box.run("cat /etc/forged/models.d/minilm.toml").stdout
    try:
        _embeddings_and_an_embedded_index(box)
    finally:
        box.run("forged index rm demo", check=False)


def test_3c_a_packaged_fim_model_comes_and_goes_under_load(
        box: BootedContainer, fim_model: Path) -> None:
    """The day-one path: `forged model package` on the appliance turns a GGUF into a
    .deb; installing it beside the running daemon adds the model (FIM naming no
    model goes to it, chat stays on the chat model), removing it withdraws it; chat
    requests all the while fail none."""
    box.copy_in(fim_model, "/root/models/coder.gguf")
    r = box.run("cd /root && forged model package models/coder.gguf --id coder "
                "--engine kv_cells=4096 --engine slots=4 --engine max_running=4 "
                "--engine max_context=1024 "
                "--out /root/pkgs", timeout=120)
    assert "coder (fim)" in r.stdout, r.stdout + r.stderr
    infill = json.dumps({"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 2})
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    post = f"curl -s --max-time 60 -H 'Content-Type: application/json' {API}"
    box.run("rm -f /root/load.*; (for i in $(seq 600); do test -f /root/load.stop && break; "
            f"{post}/v1/chat/completions -d '{chat}' -o /dev/null -w '%{{http_code}}\\n' "
            ">> /root/load.txt; done; touch /root/load.done) >/dev/null 2>&1 &")
    try:
        box.run("dpkg -i /root/pkgs/forged-model-coder_1.0_all.deb", timeout=120)
        wait_until(lambda: "coder" in _model_ids(box), 60, "coder listed")
        served = json.loads(box.run(f"{post}/infill -d '{infill}'").stdout)
        assert served["model"] == "coder", served
        served = json.loads(box.run(f"{post}/v1/chat/completions -d '{chat}'").stdout)
        assert served["model"] == "SmolLM2-135M-Instruct.Q4_1", served
        box.run("dpkg -r forged-model-coder", timeout=120)
        wait_until(lambda: "coder" not in _model_ids(box), 60, "coder withdrawn")
        # Removed, its drop-in (a conffile) stays until purged, skipped meanwhile.
        box.run("test -f /etc/forged/models.d/coder.toml")
    finally:
        box.run("touch /root/load.stop")
        wait_until(lambda: box.run("test -f /root/load.done", check=False).returncode == 0,
                   90, "the chat load to stop")
    codes = box.run("cat /root/load.txt").stdout.split()
    assert codes and set(codes) == {"200"}, codes
    box.run("dpkg -P forged-model-coder", timeout=120)
    box.run("test ! -e /etc/forged/models.d/coder.toml")


def _model_ids(box: BootedContainer) -> list[str]:
    r = box.run(f"curl -sf --max-time 30 {API}/v1/models", check=False)
    return [m["id"] for m in json.loads(r.stdout)["data"]] if r.returncode == 0 else []


def _embeddings_and_an_embedded_index(box: BootedContainer) -> None:
    body = json.dumps({"input": ["def add(a, b):", "a function that sums"]})
    r = box.run(f"curl -sf --max-time 60 {API}/v1/embeddings "
                f"-H 'Content-Type: application/json' -d '{body}'", timeout=90)
    out = json.loads(r.stdout)
    assert out["model"] == "minilm" and len(out["data"][1]["embedding"]) == 384
    box.run("mkdir -p /srv/demo && printf 'def add(a, b):\\n    return a + b\\n' "
            "> /srv/demo/maths.py && chmod -R a+rX /srv/demo")
    r = box.run("forged index add demo /srv/demo", timeout=120)
    assert "1 chunks embedded" in r.stderr and "nice 19" in r.stderr, r.stderr
    body = json.dumps({"repo": "demo", "query": "summing two numbers", "k": 1})
    r = box.run(f"curl -sf --max-time 60 {API}/v1/retrieve "
                f"-H 'Content-Type: application/json' -d '{body}'", timeout=90)
    assert json.loads(r.stdout)["data"][0]["path"] == "maths.py"  # found by meaning


def test_4_reload_applies_a_new_limit_and_keeps_streams(box: BootedContainer) -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True,
                       "stream": True})
    box.run(f"(curl -sN --max-time 120 {API}/v1/completions -d '{body}' > /root/stream.txt"
            " 2>&1; echo done > /root/stream.done) >/dev/null 2>&1 &")
    time.sleep(1.0)
    box.run("sed -i 's/^max_queued = 256/max_queued = 300/' /etc/forged/forged.toml")
    box.run("systemctl reload forged")
    admin = "curl -sf --unix-socket /run/forged/admin.sock http://admin/stats"
    wait_until(lambda: json.loads(box.run(admin).stdout)["limits"]["max_queued"] == 300, 30,
               "the reloaded limit")
    wait_until(lambda: box.run("test -f /root/stream.done", check=False).returncode == 0, 120,
               "the stream to end")
    assert box.run("tail -c 200 /root/stream.txt").stdout.rstrip().endswith("data: [DONE]")
    assert box.run("systemctl is-active forged").stdout.strip() == "active"


def test_5_restart_refuses_no_connection(box: BootedContainer) -> None:
    """10 connections a second for 12 seconds; curl exits 7 on a refused connection and
    28 on one unanswered within 10 s. With nothing in flight the restart is quick: it
    took 33 s, and 40 of 50 connections timed out, while hypercorn held idle
    keep-alive connections open through its graceful timeout."""
    box.run("(for i in $(seq 120); do curl -s -o /dev/null --max-time 10 "
            f"-w '%{{exitcode}} %{{http_code}}\\n' {API}/health >> /root/loop.txt & "
            "sleep 0.1; done; wait; echo done > /root/loop.done) >/dev/null 2>&1 &")
    # The restart also opens the read-only listener (README, "The status page").
    box.run("sed -i 's/^metrics_listen = \"\"/metrics_listen = \"127.0.0.1:9464\"/' "
            "/etc/forged/forged.toml")
    time.sleep(3)
    t0 = time.monotonic()
    box.run("systemctl restart forged", timeout=120)
    assert time.monotonic() - t0 < 20
    box.run("curl -sf --max-time 10 http://127.0.0.1:9464/ | grep -q '<title>forged status'")
    box.run("curl -sf --max-time 10 http://127.0.0.1:9464/metrics | grep -q "
            "'^forged_requests_total{'")
    wait_until(lambda: box.run("test -f /root/loop.done", check=False).returncode == 0, 120,
               "the client loop")
    results = box.run("cat /root/loop.txt").stdout.split("\n")
    results = [r for r in results if r]
    assert len(results) == 120
    refused = [r for r in results if r.split()[0] == "7"]
    assert not refused, results
    assert all(r.split()[0] == "0" for r in results), results
    assert {r.split()[1] for r in results} <= {"200", "503"}


def test_5b_a_session_survives_a_restart(box: BootedContainer) -> None:
    """The installed daemon writes a session's KV state under /var/lib/forged as its
    own user, in its sandbox, when it stops; the next turn after the restart restores
    it (issue 17)."""
    def turn(messages: list[dict[str, str]]) -> dict[str, object]:
        body = json.dumps({"messages": messages, "session": "pkg", "max_tokens": 8,
                           "temperature": 0}).replace("'", "'\\''")  # in '...' below
        r = box.run(f"curl -sf --max-time 60 {API}/v1/chat/completions "
                    f"-H 'Content-Type: application/json' -d '{body}'", timeout=90)
        return dict(json.loads(r.stdout))

    first = [{"role": "user", "content": "Review this code: " + "def f(x): return x * 2; "
              * 8}]
    one = turn(first)
    box.run("systemctl restart forged", timeout=120)
    owner = box.run("stat -c '%U' /var/lib/forged/kvcache/*/worker-0/*.kv").stdout.split()
    assert owner == ["forged"]
    reply = one["choices"][0]["message"]["content"]  # type: ignore[index]
    two = turn([*first, {"role": "assistant", "content": reply},
                {"role": "user", "content": "Why?"}])
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] > 32  # type: ignore[index]


def test_6_watchdog_restarts_a_stopped_daemon(box: BootedContainer) -> None:
    # A drop-in shortens the watchdog for the test; the shipped unit is unchanged.
    box.run("mkdir -p /etc/systemd/system/forged.service.d && printf "
            "'[Service]\\nWatchdogSec=4\\n' > /etc/systemd/system/forged.service.d/test.conf"
            " && systemctl daemon-reload && systemctl restart forged", timeout=120)
    box.run(f"curl -sf --max-time 60 {API}/health")
    before = n_restarts(box)
    pid = box.run("systemctl show -p MainPID --value forged").stdout.strip()
    box.run(f"kill -STOP {pid}")
    wait_until(lambda: n_restarts(box) > before, 60, "a watchdog restart")
    wait_until(lambda: box.run(f"curl -sf --max-time 5 {API}/health", check=False)
               .returncode == 0, 90, "the restarted daemon")
    assert "watchdog" in box.run("journalctl -u forged --no-pager").stdout.lower()
    box.run("rm -rf /etc/systemd/system/forged.service.d && systemctl daemon-reload")


def test_7_broken_config_fails_clearly_without_a_restart_loop(box: BootedContainer) -> None:
    box.run("cp /etc/forged/forged.toml /root/good.toml && "
            "sed -i 's/^\\[server\\]$/[server]\\nbogus = 1/' /etc/forged/forged.toml")
    box.run("systemctl restart forged", check=False, timeout=120)
    time.sleep(8)  # Restart=on-failure would have retried within RestartSec=2
    state = box.run("systemctl show -p ActiveState --value forged").stdout.strip()
    assert state == "failed", state
    status = box.run("systemctl show -p ExecMainStatus --value forged").stdout.strip()
    assert status == "78"
    assert n_restarts(box) == 0  # a manual restart resets the counter; none since
    # At priority err (journald reads each line's <3> prefix): `journalctl -p err` shows it.
    journal = box.run("journalctl -u forged -p err --no-pager").stdout
    assert re.search(r"/etc/forged/forged.toml: server.bogus: unknown key", journal), journal
    box.run("cp /root/good.toml /etc/forged/forged.toml && systemctl reset-failed forged")


def test_8_upgrade_restarts_once_and_keeps_the_admins_config(
        box: BootedContainer, tmp_path: Path) -> None:
    old = next(d for d in _debs() if d.name.startswith("forged_"))
    new = bump_version(old, "+upgrade1", tmp_path)
    box.copy_in(new, f"/root/next/{new.name}")
    # The admin edits the conffile and tightens its mode (the daemon's group still reads).
    box.run("echo '# edited by the admin' >> /etc/forged/forged.toml && "
            "chmod 0440 /etc/forged/forged.toml")
    # The held stream must still be open when postinst restarts the daemon (seconds into
    # the configure step) and end well within the 30 s drain: size it to about 12 s at
    # the speed this machine decodes right now.
    box.run(f"curl -sf --max-time 120 {API}/health", timeout=150)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True})
    r = box.run(f"curl -sf --max-time 120 -w '\\n%{{time_total}}' {API}/v1/completions "
                f"-d '{body}'", check=False, timeout=150)
    if r.returncode != 0:
        journal = box.run("journalctl -u forged --no-pager -n 80").stdout
        raise AssertionError(f"a 32-token completion failed (curl {r.returncode}):\n{journal}")
    reply, seconds = r.stdout.rsplit("\n", 1)
    per_second = json.loads(reply)["usage"]["completion_tokens"] / float(seconds)
    max_tokens = int(min(max(12 * per_second, 100), 4000))
    invocation = box.run("systemctl show -p InvocationID --value forged").stdout.strip()
    restarts, since = n_restarts(box), box.run("date +@%s.%N").stdout.strip()

    # 10 bounded connections a second for as long as the upgrade takes.
    box.run("(for i in $(seq 900); do test -f /root/up.done && break; curl -s -o /dev/null "
            f"--max-time 60 -w '%{{exitcode}} %{{http_code}}\\n' {API}/health "
            ">> /root/up-loop.txt & sleep 0.1; done; wait; echo done > /root/up-loop.done)"
            " >/dev/null 2>&1 &")
    # dpkg -i in its two steps, as apt runs them, to open the stream in between.
    box.run(f"dpkg --unpack /root/next/{new.name}", timeout=300)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True})
    box.run(f"(curl -sN --max-time 120 {API}/v1/completions -d '{body}' > /root/up-stream.txt"
            " 2>&1; echo done > /root/up-stream.done) >/dev/null 2>&1 &")
    time.sleep(0.5)
    box.run("dpkg --configure forged && touch /root/up.done", timeout=300)
    wait_until(lambda: box.run("test -f /root/up-loop.done -a -f /root/up-stream.done",
                               check=False).returncode == 0, 120, "the stream and the loop")

    journal = box.run(f"journalctl --no-pager -o cat --since {since} -u forged").stdout
    starting = "MESSAGE_ID=7d4958e842da4a758f6c1cdc7b36dcc5"  # systemd's "Starting ..."
    starts = box.run(f"journalctl --no-pager -o cat --since {since} UNIT=forged.service "
                     f"{starting}").stdout.splitlines()
    stream = box.run("cat /root/up-stream.txt").stdout
    loop = [line.split() for line in box.run("cat /root/up-loop.txt").stdout.splitlines()]
    observed = {
        "version": box.run("dpkg-query -W -f '${Version}' forged").stdout,
        "starts": len(starts),
        "new invocation": box.run("systemctl show -p InvocationID --value forged")
        .stdout.strip() != invocation,
        "crash restarts": n_restarts(box) - restarts,
        "a stream drained": bool(re.search(r"draining: [1-9]\d* streams open", journal)),
        "stream ran to its length": stream.count('"finish_reason":"length"') == 1
        and '"error"' not in stream and stream.rstrip().endswith("data: [DONE]"),
        "curl exit codes": {c for c, _ in loop},  # 7: refused, 56: reset
        "http codes": {h for _, h in loop} - {"503"},  # 503 while draining is fine
        "conffile edit kept": box.run("tail -n 1 /etc/forged/forged.toml").stdout.strip()
        == "# edited by the admin",
        "conffile owner and mode": box.run("stat -c '%U:%G %a' /etc/forged/forged.toml")
        .stdout.strip(),
        "units": box.run("systemctl is-active forged.socket forged").stdout.split(),
    }
    assert observed == {
        "version": old.name.split("_")[1] + "+upgrade1",
        "starts": 1,  # one restart, not one per unit touched
        "new invocation": True,
        "crash restarts": 0,
        "a stream drained": True,
        "stream ran to its length": True,
        "curl exit codes": {"0"},
        "http codes": {"200"},
        "conffile edit kept": True,
        "conffile owner and mode": "root:forged 440",
        "units": ["active", "active"],
    }, journal
    assert len(loop) >= 30, loop


def test_9_remove_keeps_the_conffile_and_purge_removes_it(box: BootedContainer) -> None:
    box.run("mkdir -p /var/lib/forged && echo x > /var/lib/forged/state")
    box.run("systemctl stop forged.socket forged", timeout=120)
    box.run("dpkg -r forged forged-model-smollm2 forged-model-minilm", timeout=300)
    assert box.run("test -f /etc/forged/forged.toml", check=False).returncode == 0
    assert box.run("test -e /usr/lib/forged", check=False).returncode != 0
    assert box.run("test -e /usr/bin/forged", check=False).returncode != 0
    assert box.run("test -e /usr/share/forged/models", check=False).returncode != 0
    box.run("dpkg -P forged forged-model-smollm2 forged-model-minilm", timeout=300)
    assert box.run("test -e /etc/forged", check=False).returncode != 0
    assert box.run("test -e /var/lib/forged", check=False).returncode != 0
    # Debian policy: the system user stays, so files it owned elsewhere keep an owner.
    assert box.run("getent passwd forged", check=False).returncode == 0
