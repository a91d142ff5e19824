"""The OTLP backends over TLS to real receivers on loopback, and exporter headers kept out of every log.

Certificates (a throwaway CA and a server certificate for 127.0.0.1 and
localhost) are made at test time with the ``openssl`` command.
"""

from __future__ import annotations

import logging
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("grpc")

import traintrace as tt

sys.path.insert(0, str(Path(__file__).parent))
from otlp_receivers import GrpcReceiver, HttpReceiver

SECRET = "s3cr3t-token"
ENV_SECRET = "s3cr3t-env-token"


class Certs:
    """PEM files: the CA (``ca``), the server's certificate and key, and a CA nobody signed with."""

    def __init__(self, folder: Path) -> None:
        self.ca = folder / "ca.pem"
        self.server_cert = folder / "server.pem"
        self.server_key = folder / "server.key"
        self.other_ca = folder / "other-ca.pem"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(folder: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=traintrace test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    folder = tmp_path_factory.mktemp("certs")
    _make_ca(folder, "ca")
    _make_ca(folder, "other-ca")
    (folder / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost",
        cwd=folder,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "server.ext",
        cwd=folder,
    )  # fmt: skip
    return Certs(folder)


@pytest.fixture
def tls_grpc(certs: Certs) -> Iterator[GrpcReceiver]:
    import grpc

    credentials = grpc.ssl_server_credentials([(certs.server_key.read_bytes(), certs.server_cert.read_bytes())])
    receiver = GrpcReceiver(credentials=credentials)
    yield receiver
    receiver.stop()


@pytest.fixture
def tls_http(certs: Certs) -> Iterator[HttpReceiver]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.server_cert, certs.server_key)
    receiver = HttpReceiver(ssl_context=context)
    yield receiver
    receiver.stop()


def _configure(backends: dict[str, Any], **settings: Any) -> tt.Recorder:
    settings.setdefault("job_id", "tls-test")
    return tt.configure(backends={"file": False, "log": False, **backends}, **settings)


def _run(steps: int = 3) -> None:
    with tt.training_loop():
        for step in range(steps):
            with tt.training_iteration(step):
                tt.event("batch_ready", {"size": 8})


def _names(receiver: GrpcReceiver | HttpReceiver) -> list[str]:
    return sorted(span.name for _, span in receiver.spans())


EXPECTED = sorted(["training_loop"] + ["iteration"] * 3)


def test_grpc_over_tls_with_the_certificate_setting(tls_grpc: GrpcReceiver, certs: Certs) -> None:
    """An https endpoint and ``certificate`` (the CA): spans reach a TLS-only gRPC receiver."""
    assert tls_grpc.endpoint.startswith("https://")
    rec = _configure({"otlp_traces": {"endpoint": tls_grpc.endpoint, "protocol": "grpc", "certificate": str(certs.ca)}})
    backend = rec.backend("otlp_traces")
    assert backend.fast  # our encoder's bytes go through the official exporter's TLS channel
    _run()
    tt.close()
    assert _names(tls_grpc) == EXPECTED
    assert backend.stats()["failed"] == 0


def test_grpc_over_tls_with_the_standard_certificate_variable(
    tls_grpc: GrpcReceiver, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE, read by the official exporter, works the same."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(certs.ca))
    _configure({"otlp_traces": {"endpoint": tls_grpc.endpoint, "protocol": "grpc"}})
    _run()
    tt.close()
    assert _names(tls_grpc) == EXPECTED


def test_a_ca_without_https_in_the_url_still_means_tls(tls_grpc: GrpcReceiver, certs: Certs) -> None:
    """With ``certificate`` set, an http:// gRPC URL does not fall back to plain text."""
    _configure(
        {
            "otlp_traces": {
                "endpoint": f"http://127.0.0.1:{tls_grpc.port}",
                "protocol": "grpc",
                "certificate": str(certs.ca),
            }
        }
    )
    _run()
    tt.close()
    assert _names(tls_grpc) == EXPECTED


def test_http_protobuf_over_tls(tls_http: HttpReceiver, certs: Certs, monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP/protobuf to an HTTPS receiver, checked against ``certificate``.

    REQUESTS_CA_BUNDLE (set in many containers) must not replace the configured CA.
    """
    assert tls_http.endpoint.startswith("https://")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(certs.other_ca))
    _configure(
        {"otlp_traces": {"endpoint": tls_http.endpoint, "protocol": "http/protobuf", "certificate": str(certs.ca)}}
    )
    _run()
    tt.close()
    assert _names(tls_http) == EXPECTED


def test_http_protobuf_over_tls_with_the_standard_certificate_variable(
    tls_http: HttpReceiver, certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OTEL_EXPORTER_OTLP_CERTIFICATE works for HTTP too, whatever REQUESTS_CA_BUNDLE says."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(certs.ca))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(certs.other_ca))
    _configure({"otlp_traces": {"endpoint": tls_http.endpoint, "protocol": "http/protobuf"}})
    _run()
    tt.close()
    assert _names(tls_http) == EXPECTED


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_an_untrusted_server_gets_nothing(
    protocol: str, tls_grpc: GrpcReceiver, tls_http: HttpReceiver, certs: Certs
) -> None:
    """A server whose certificate the configured CA did not sign receives no span; training goes on."""
    receiver = tls_grpc if protocol == "grpc" else tls_http
    rec = _configure(
        {
            "otlp_traces": {
                "endpoint": receiver.endpoint,
                "protocol": protocol,
                "certificate": str(certs.other_ca),
                "timeout": 1.0,
                "close_timeout": 1.0,
            }
        }
    )
    backend = rec.backend("otlp_traces")
    _run()
    tt.close()
    assert receiver.spans() == []
    stats = backend.stats()
    assert stats["exported"] == 0
    assert stats["failed"] + stats["abandoned"] + stats["dropped"] == len(EXPECTED)


def test_certificate_setting_errors_name_the_field(certs: Certs, tmp_path: Path) -> None:
    """A missing CA file, or a CA together with insecure=true, is a ConfigError naming ``certificate``."""
    with pytest.raises(tt.ConfigError, match=r"backends\.otlp_traces\.certificate: no such file"):
        _configure({"otlp_traces": {"certificate": str(tmp_path / "missing.pem")}})
    with pytest.raises(tt.ConfigError, match=r"backends\.otlp_logs\.certificate: .*insecure"):
        _configure({"otlp_logs": {"certificate": str(certs.ca), "insecure": True}})


def test_malformed_headers_error_does_not_echo_them() -> None:
    """A headers value that is not key=value raises a ConfigError that does not repeat the token."""
    with pytest.raises(tt.ConfigError) as caught:
        _configure({"otlp_traces": {"headers": f"x-tenant=ml,authorization Bearer {SECRET}"}})
    assert "backends.otlp_traces.headers" in str(caught.value)
    assert "entry 2" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_headers_are_sent_but_never_logged_or_written(
    tls_grpc: GrpcReceiver,
    certs: Certs,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Secret headers (config and OTEL_EXPORTER_OTLP_HEADERS) reach the collector and nothing else.

    Everything logs at DEBUG; two backends point at a closed port so the failure
    and warning paths run; the file backend's stream, the log backend's lines,
    and the captured stdout/stderr are searched for the token.
    """
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{ENV_SECRET}")
    caplog.set_level(logging.DEBUG)
    for name in ("traintrace", "opentelemetry", "grpc", "urllib3"):
        caplog.set_level(logging.DEBUG, logger=name)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    tt.configure(
        job_id="tls-secret",
        log_dir="logs",  # in tmp_path, the working directory
        metadata={"authorization": f"Bearer {SECRET}", "team": "ml"},
        backends={
            "file": {},
            "log": {"verbosity": "profiling"},
            "otlp_traces": {
                "endpoint": tls_grpc.endpoint,
                "protocol": "grpc",
                "certificate": str(certs.ca),
                "headers": {"authorization": f"Bearer {SECRET}", "x-tenant": "ml"},
            },
            # Unreachable: export failures, retries and the loss warning at close.
            "otlp_logs": {
                "endpoint": f"http://127.0.0.1:{closed}",
                "protocol": "http/protobuf",
                "timeout": 0.5,
                "close_timeout": 0.5,
                "export_interval": 0.05,
            },
            "otlp_metrics": {
                "endpoint": f"https://127.0.0.1:{closed}",
                "protocol": "grpc",
                "certificate": str(certs.ca),
                "headers": f"authorization=Bearer%20{SECRET}",
                "timeout": 0.5,
                "close_timeout": 0.5,
            },
        },
    )
    _run(5)
    tt.flush()
    tt.close()

    # The collector did get the header: the test would prove nothing otherwise.
    assert tls_grpc.metadata_seen and tls_grpc.metadata_seen[0].get("authorization") == f"Bearer {SECRET}"
    assert _names(tls_grpc) == sorted(["training_loop"] + ["iteration"] * 5)

    messages = [record.getMessage() for record in caplog.records]
    messages += [str(record.args) for record in caplog.records]
    messages += [caplog.text]
    assert any("otlp_logs" in m and "lost" in m for m in messages)  # the failure path did run
    for secret in (SECRET, ENV_SECRET):
        assert not [m for m in messages if secret in m]
    streams = list(Path("logs").rglob("*.jsonl"))
    assert streams
    for stream in streams:
        text = stream.read_text()
        assert '"kind":"header"' in text.replace(" ", "")
        assert SECRET not in text and ENV_SECRET not in text
    out, err = capfd.readouterr()
    assert SECRET not in out + err and ENV_SECRET not in out + err


def test_settings_repr_hides_headers() -> None:
    """The settings' repr (as a traceback or a debugger shows it) leaves OTLP headers out."""
    from traintrace._config import build_config

    config = build_config(env={}, backends={"otlp_traces": {"headers": {"authorization": f"Bearer {SECRET}"}}})
    assert "otlp_traces" in repr(config) and SECRET not in repr(config)
    options = config.backends["otlp_traces"].exporter_options()  # type: ignore[attr-defined]
    assert options["headers"] == {"authorization": f"Bearer {SECRET}"}
