"""`srt-mcp-server doctor`: checks each sandbox layer on this host and says how to fix it.

host.py: what the host offers, checked without starting anything; sandboxes.py: checks that
start a real sandbox, workspace store, interpreter and egress proxy.
"""

from __future__ import annotations

import asyncio

from sandbox_runtime.config import Settings
from sandbox_runtime.doctor.host import Check as Check
from sandbox_runtime.doctor.host import check_static as check_static
from sandbox_runtime.doctor.host import in_container as in_container
from sandbox_runtime.doctor.sandboxes import check_egress as check_egress
from sandbox_runtime.doctor.sandboxes import check_languages as check_languages
from sandbox_runtime.doctor.sandboxes import check_live as check_live
from sandbox_runtime.doctor.sandboxes import check_workspaces as check_workspaces


def run_doctor(settings: Settings) -> int:
    """Print OK/FAIL/WARN per layer; 0 only when every required layer works."""
    checks = check_static(settings)
    if all(c.ok or not c.required for c in checks):
        checks += asyncio.run(check_live(settings))
    if all(c.ok or not c.required for c in checks):
        checks += check_workspaces(settings)
    if all(c.ok or not c.required for c in checks):
        checks += asyncio.run(check_languages(settings))
    if all(c.ok or not c.required for c in checks):
        checks += asyncio.run(check_egress(settings))
    if in_container():
        checks.append(
            Check("container", True, "inside a container (if bwrap fails there: DEPLOYMENT.md)")
        )
    width = max(len(c.layer) for c in checks)
    for c in checks:
        print(f"{c.label:<4}  {c.layer:<{width}}  {c.detail}")
        if not c.ok and c.fix:
            print(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    failed = [c for c in checks if not c.ok and c.required]
    print()
    if failed:
        print(f"executions cannot run: {len(failed)} required layer(s) failed")
        return 1
    print("all required sandbox layers work: executions can run")
    return 0
