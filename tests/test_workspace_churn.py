"""Thousands of new sessions on one replica, each mounting a workspace image past the mount
caps (so each unmounts an idle one): every call answers, none with an unmapped error.

The store's bookkeeping (which images are mounted, whose) is changed in worker threads (mkfs,
mount) while the event loop looks for an idle workspace to unmount; iterating it there failed
a call now and then with "Set changed size during iteration", an unmapped error ("Error calling
tool 'write_file'", after ~3,800 sessions in bench/bench_workspaces.py). The server here runs
with a tiny thread switch interval (a sitecustomize on its PYTHONPATH) so that the race shows
within a few hundred sessions (measured: after 286 without the fix) rather than thousands.
Real server, real images, the official client.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
from mcp_harness import open_client, running_server

pytestmark = pytest.mark.e2e

TOKEN = "churn-token-0123456789"
CLIENTS = 8
SESSIONS = 600
CAP = 8


async def test_new_sessions_past_the_mount_caps_never_meet_an_unmapped_error(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.setswitchinterval(1e-6)\n")
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(site)) if p)
    with running_server(
        tmp_path / "server",
        SANDBOX_AUTH_TOKEN=TOKEN,
        SANDBOX_WORKSPACE_QUOTA="image",
        SANDBOX_WORKSPACE_MB="16",
        SANDBOX_MAX_MOUNTED_WORKSPACES_PER_PRINCIPAL=str(CAP),
        SANDBOX_INTERPRETER_WARM="python=0",
        SANDBOX_ACCESS_LOG="false",
        PYTHONPATH=path,
    ) as server:
        failures: list[str] = []
        prefix = uuid.uuid4().hex[:6]

        async def client(k: int) -> None:
            async with open_client(server.url, TOKEN, "auto") as conn:
                for i in range(k, SESSIONS, CLIENTS):
                    result = await conn.call(
                        "write_file", path="f.txt", content="x", session=f"{prefix}-{i}"
                    )
                    if result.is_error:
                        failures.append("".join(getattr(c, "text", "") for c in result.content))
                        return

        await asyncio.gather(*(client(k) for k in range(CLIENTS)))
        assert not failures, f"{failures}\n{server.log_since(0, 80)}"
        assert "Set changed size" not in server.stderr_text()
        assert server.health()["status"] == "ok"
        assert server.metric(TOKEN, "srt_workspaces_mounted{", 'kind="session"') <= CAP
