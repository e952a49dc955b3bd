"""A real nginx running the shipped config (deploy/nginx) in front of real replicas."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "deploy" / "nginx" / "generate.py"
SHIPPED = ROOT / "deploy" / "nginx" / "sandbox-runtime.conf"
COMPOSE_REPLICAS = ["r1=replica1:8080", "r2=replica2:8080", "r3=replica3:8080"]


def nginx_binary() -> str:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        raise RuntimeError("nginx is not installed: apt-get install nginx")
    return binary


def generate(listen: str, replicas: list[str], output: Path) -> str:
    """Run the shipped generator, as an operator would; returns the config text."""
    subprocess.run(
        [sys.executable, str(GENERATOR), "--listen", listen, "-o", str(output), *replicas],
        check=True,
    )
    return output.read_text()


def main_config(directory: Path, site: Path) -> Path:
    """The nginx.conf around the site config: only paths differ from a packaged nginx."""
    for sub in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
        (directory / sub).chmod(0o777)
    conf = directory / "nginx.conf"
    conf.write_text(
        f"""
daemon off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log {directory}/access.log;
    client_body_temp_path {directory}/client_body;
    proxy_temp_path {directory}/proxy;
    fastcgi_temp_path {directory}/fastcgi;
    uwsgi_temp_path {directory}/uwsgi;
    scgi_temp_path {directory}/scgi;
    include {site};
}}
"""
    )
    return conf


def check_config(conf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [nginx_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, check=False
    )


class Nginx:
    """nginx in the foreground with a config of its own; `stop()` ends it."""

    def __init__(self, directory: Path, port: int, replicas: list[str]) -> None:
        self.directory = directory
        self.port = port
        directory.mkdir(parents=True, exist_ok=True)
        self.site = directory / "sandbox-runtime.conf"
        generate(f"127.0.0.1:{port}", replicas, self.site)
        self.conf = main_config(directory, self.site)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> Nginx:
        result = check_config(self.conf)
        if result.returncode != 0:
            raise AssertionError(f"nginx -t failed:\n{result.stderr}")
        self.proc = subprocess.Popen(
            [nginx_binary(), "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.directory / "stderr.log", "wb"),
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx2.get(f"http://127.0.0.1:{self.port}/nginx-health").status_code == 200:
                    return self
            except httpx2.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("nginx did not start:\n" + self.error_log())

    def error_log(self) -> str:
        path = self.directory / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
