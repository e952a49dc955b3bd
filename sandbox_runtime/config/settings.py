"""The `Settings` model: every setting, its default, bounds and description; the checks across
settings; the server's parts' settings derived from it (parsing.py parses the small
languages). Long because the settings are many: one field each, in one place."""

from __future__ import annotations

import re
import secrets
import socket
from pathlib import Path
from typing import Literal

from loguru import logger
from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sandbox_runtime.config import parsing
from sandbox_runtime.domain.egress import EgressDenied, EgressPolicy, EgressSettings
from sandbox_runtime.domain.limits import SandboxLimits

REPLICA_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Settings(BaseSettings):
    """Server settings. Environment variables are `SANDBOX_<NAME>` unless noted."""

    model_config = SettingsConfigDict(
        env_prefix="SANDBOX_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_default=True,
    )

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="Port to listen on (0: any free port).")
    auth_token: SecretStr | None = Field(
        None, description="Bearer token clients must send (principal `default`)."
    )
    auth_tokens: SecretStr | None = Field(
        None,
        description="More tokens as `principal:token,principal2:token2`; each principal sees "
        "only its own executions.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Allow serving without any token on a non-loopback address (not advised).",
    )
    oauth_issuer: str | None = Field(
        None,
        description="OAuth sign-in: the authorization server(s) whose access tokens this server "
        "accepts (issuer URLs, comma-separated); their metadata is read from "
        "`<issuer>/.well-known/openid-configuration` (else `oauth-authorization-server`). "
        "Static tokens keep working alongside. Needs SANDBOX_OAUTH_RESOURCE.",
    )
    oauth_resource: str | None = Field(
        None,
        description="This server's resource URI as clients reach it (e.g. "
        "`https://sandbox.example.com/mcp`): named in the protected resource metadata and "
        "required as the tokens' audience.",
    )
    oauth_audience: str | None = Field(
        None,
        description="More audiences accepted besides SANDBOX_OAUTH_RESOURCE (comma-separated), "
        "for identity providers that set their own (Entra: `api://<application id>`).",
    )
    oauth_scopes: str | None = Field(
        None,
        description="The scopes clients are told to ask the identity provider for (the "
        "metadata's scopes_supported and the 401's `scope`), space- or comma-separated; "
        "default: this server's own (`sandbox:execute sandbox:files snapshots`); `none`: none, "
        "for providers that refuse scopes they do not define (Entra: `api://<id>/.default`).",
    )
    oauth_principal_claim: str = Field(
        "sub", description="The token claim that names the principal (`sub`, `email`, ...)."
    )
    oauth_groups_claim: str = Field(
        "groups", description="The token claim listing the caller's groups or roles."
    )
    oauth_introspection_client_id: str | None = Field(
        None,
        description="Client id for token introspection (RFC 7662), for identity providers that "
        "issue opaque access tokens; the endpoint is the issuer's `introspection_endpoint`.",
    )
    oauth_introspection_client_secret: SecretStr | None = Field(
        None, description="Client secret for token introspection."
    )
    oauth_jwks_cache_seconds: int = Field(
        300,
        ge=10,
        le=86_400,
        description="How long an issuer's signing keys (JWKS) are kept; a token signed by an "
        "unknown key refreshes them at once (at most every 10 s).",
    )
    oauth_console_client_id: str | None = Field(
        None,
        description="The OAuth client (public, with PKCE) the web console signs in with when "
        "OAuth is configured.",
    )
    oauth_console_scope: str | None = Field(
        None,
        description="The scopes the console asks for (space-separated); default: `openid` and "
        "SANDBOX_OAUTH_SCOPES (this server's own unless set).",
    )
    policy_file: Path | None = Field(
        None,
        description="Who may do what (TOML): the scopes each group, principal and every "
        "signed-in caller gets. None: every principal may use every tool.",
    )
    allowed_hosts: str = Field(
        "auto",
        description="DNS-rebinding protection. `auto`: Host and Origin must be local when the "
        "server listens on loopback (a web page cannot drive a local server); a comma-separated "
        "list: only those Host values (plus local ones) anywhere; `*`: no check.",
    )
    replica_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{secrets.token_hex(3)}",
        description="This replica's id (Redis keys, session tags, /health).",
    )
    redis_url: str | None = Field(
        None,
        validation_alias=AliasChoices("REDIS_URL", "SANDBOX_REDIS_URL"),
        description="Redis to mirror executions into (env REDIS_URL); none: in-memory only.",
    )

    cluster_secret: SecretStr | None = Field(
        None,
        description="Shared secret of the replicas of one deployment (at least 16 characters): "
        "signs every replica-to-replica call and its answer. Required when several replicas "
        "share a Redis.",
    )
    cluster_host: str | None = Field(
        None,
        description="Address of the cluster listener (calls from other replicas); default: "
        "SANDBOX_HOST. Never expose it through the public proxy.",
    )
    cluster_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the cluster listener; default SANDBOX_PORT + 1 (0: any free port).",
    )
    cluster_advertise: str | None = Field(
        None,
        description="host:port other replicas use to reach this replica's cluster listener; "
        "default: the cluster host (the machine's hostname when it listens on every "
        "address) and port.",
    )
    max_sessions_per_principal: int = Field(
        10_000,
        ge=1,
        description="Live sessions per token principal, across every replica.",
    )
    max_running_per_principal: int = Field(
        64,
        ge=1,
        description="Executions running at once per token principal, across every replica.",
    )

    runtime_dir: Path | None = Field(
        None,
        description="Where the sandbox runtime (Python data stack, Deno, Jupyter kernels) is "
        "installed; default `<state_dir>/runtime`. Bound read-only at /opt/srt-runtime.",
    )
    servers_file: Path | None = Field(
        None,
        description="The catalog of hosted MCP servers (TOML; `srt-mcp-server servers ...` "
        "edits it); default `<state_dir>/servers.toml`.",
    )
    max_server_instances: int = Field(
        32,
        ge=0,
        description="Hosted MCP server instances running at once on this replica (each is a "
        "sandbox); a start past it stops the least recently used idle one, or is refused.",
    )
    max_server_instances_per_principal: int = Field(
        8,
        ge=1,
        description="Hosted MCP server instances one principal's calls may keep running on "
        "this replica (shared instances are no one's).",
    )
    runtime_requirements: Path | None = Field(
        None,
        description="A pip requirements file of extra packages for the runtime (installed by "
        "`srt-mcp-server runtime install`).",
    )
    max_interpreters: int = Field(
        16, ge=1, le=4096, description="Interpreters running at once on this replica."
    )
    max_interpreters_per_principal: int = Field(
        8, ge=1, le=4096, description="Interpreters running at once per token principal."
    )
    interpreter_idle_seconds: float = Field(
        900, gt=0, description="An interpreter unused this long is stopped (its state lost)."
    )
    interpreter_warm: str = Field(
        "python=1",
        description="Interpreters started ahead of need, per language: `python=1,bash=0`, "
        "or a language on an environment: `r@r=1`; a new session's first call takes one "
        "instead of starting a kernel.",
    )

    pool_size: int = Field(
        8,
        ge=0,
        le=256,
        description="Sandboxes started ahead of need, per replica: one waits in each of up to "
        "this many active workspaces for the session's next command (0: none).",
    )
    workspace_pool: int = Field(
        2,
        ge=0,
        le=64,
        description="Empty workspaces made ahead of need, per replica (with workspace images): "
        "a new session's first call takes one instead of making its image. Each counts "
        "against SANDBOX_MAX_MOUNTED_WORKSPACES and takes ~60 KiB of disk (thin; with "
        "SANDBOX_WORKSPACE_RESERVE=allocate, SANDBOX_WORKSPACE_MB) (0: none).",
    )
    workspace_pool_max: int = Field(
        64,
        ge=0,
        le=1024,
        description="Most empty workspaces made ahead of need when new sessions come in bursts: "
        "SANDBOX_WORKSPACE_POOL plus the most new sessions seen within a quarter second in the "
        "last 5 minutes, up to this; back to SANDBOX_WORKSPACE_POOL after. Each also holds a "
        "sandbox started ahead (with SANDBOX_POOL_SIZE > 0) (at most SANDBOX_WORKSPACE_POOL: "
        "no growth).",
    )
    pool_idle_seconds: float = Field(
        60, gt=0, le=240, description="A sandbox started ahead and unused this long is ended."
    )

    heartbeat_ttl: int = Field(
        10,
        ge=2,
        le=300,
        description="Seconds a replica's Redis heartbeat lives; its running executions are "
        "marked lost this long after it dies.",
    )

    max_concurrent: int = Field(16, ge=1, le=4096, description="Executions running at once.")
    max_per_session: int = Field(
        4,
        ge=1,
        le=4096,
        description="Executions running at once per (principal, session). The default "
        "session (calls that name none) has the token's limit instead "
        "(SANDBOX_MAX_RUNNING_PER_PRINCIPAL).",
    )
    timeout: float = Field(
        300, gt=0, description="Default execution timeout in seconds (wall clock)."
    )
    max_timeout: float = Field(3600, gt=0, description="Largest timeout a caller may ask for.")
    max_wait: float = Field(
        60, gt=0, le=600, description="Longest a long-poll or a waiting execute_code call blocks."
    )
    result_text: Literal["concise", "json"] = Field(
        "concise",
        description="The text block of tool results: concise (a screen a model reads; "
        "structured content unchanged) or json (the result's JSON, as 0.2 sent it, for "
        "programs that parse the text of the legacy era).",
    )
    result_max_chars: int = Field(
        100_000,
        ge=2_000,
        le=400_000,
        description="Characters of text per tool result (about 25,000 tokens); output past it "
        "is cut head and tail and kept whole in /workspace/.outputs/. Per call: max_chars.",
    )
    progress_interval: float = Field(
        3,
        gt=0,
        le=10,
        description="While a call waits for an execution, a progress notification at least "
        "this often (seconds), output or not, for callers that sent a progressToken.",
    )
    fast_dispatch: bool = Field(
        True,
        description="Answer tools/call for the built-in tools without the MCP library's "
        "per-call tool lookup (same results; ~0.3 ms less CPU a call). false: the library's.",
    )
    retention_seconds: int = Field(
        3600, ge=1, description="How long finished executions are kept (also the Redis TTL)."
    )
    max_retained: int = Field(
        2000, ge=1, description="Most finished executions kept in memory; oldest evicted first."
    )
    retained_output_mb: int = Field(
        1024,
        ge=1,
        description="Output of finished executions kept in memory, MiB in all (a principal "
        "may hold at most half of it); past it the oldest executions of the principal holding "
        "the most are evicted (their output stays readable from Redis while it keeps them).",
    )
    cancel_grace: float = Field(
        2.0, ge=0, le=60, description="Seconds between SIGTERM and SIGKILL on a cancel."
    )
    shutdown_grace: float = Field(
        5.0, ge=0, le=300, description="Seconds running executions get on shutdown."
    )

    memory_mb: int = Field(512, ge=16, description="Memory per execution (cgroup), MiB.")
    pids_limit: int = Field(128, ge=8, description="Processes+threads per execution.")
    cpu_cores: float = Field(1.0, gt=0, description="CPU bandwidth per execution, in cores.")
    cpu_time_seconds: int = Field(600, ge=1, description="CPU seconds per process (RLIMIT_CPU).")
    file_size_mb: int = Field(256, ge=1, description="Largest file a process may write, MiB.")
    tmp_size_mb: int = Field(
        64, ge=1, description="Size of the private /tmp tmpfs (and of /dev/shm), MiB."
    )
    open_files: int = Field(1024, ge=64, description="Open files per process (RLIMIT_NOFILE).")
    output_limit_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, description="Output kept per execution; the rest is dropped."
    )
    pseudo_terminals: bool = Field(
        False,
        description="Give sandboxes pseudo-terminals (/dev/pts); a caller may turn them off.",
    )
    console: bool = Field(
        True,
        description="Serve the web console at `/` (a page that is an MCP client of /mcp with "
        "the user's token); false: `/` is not served.",
    )
    e2b: bool = Field(
        False,
        description="Serve the E2B-compatible API under `/e2b` on this listener (point the E2B "
        "SDKs' E2B_API_URL and E2B_SANDBOX_URL at http://HOST:PORT/e2b; docs/e2b.md).",
    )
    e2b_max_sandboxes: int = Field(
        100,
        ge=1,
        description="Live (running or paused) E2B sandboxes per principal, across every replica.",
    )
    egress_allow: str = Field(
        "",
        description="Names sandboxes may reach through the egress proxy, comma-separated: "
        "`pypi.org`, `*.example.com` (strict subdomains), an optional `:port` (default 80 and "
        "443). Empty (with no SANDBOX_EGRESS_ALLOW_CIDRS): no network at all.",
    )
    egress_deny: str = Field(
        "", description="Names refused even when allowed (same syntax; deny wins)."
    )
    egress_allow_cidrs: str = Field(
        "",
        description="Address ranges sandboxes may reach (an internal mirror: `10.0.5.0/24`); "
        "private, loopback, link-local and the host's own addresses are refused otherwise, "
        "metadata addresses unless named exactly.",
    )
    environments_dir: Path | None = Field(
        None,
        description="Where environments are kept (roots by digest, names as pointers; "
        "docs/environments-build.md); default `<state_dir>/environments`.",
    )
    environment_max_mb: int = Field(
        4096,
        ge=16,
        description="Largest environment (root filesystem) a build or an import may make, in "
        "MiB; past it the build stops and the previous environment of that name stays.",
    )
    environments_allow: str = Field(
        "",
        description="Which environments each principal may name in `image` (execute_code, "
        "run_code): `PRINCIPAL=NAME,NAME` entries separated by `;`, `*` for every other "
        "principal or every environment (e.g. `alice=r,go;*=default`); `default` is always "
        "allowed. Empty: everyone may use every environment.",
    )
    environment_build_allow: str = Field(
        "deb.debian.org,security.debian.org,pypi.org,files.pythonhosted.org,proxy.golang.org,"
        "sum.golang.org,cloud.r-project.org",
        description="Names a Dockerfile's RUN steps may reach through the egress proxy (same "
        "syntax as SANDBOX_EGRESS_ALLOW): the package registries; empty: RUN has no network.",
    )
    environment_build_allow_cidrs: str = Field(
        "",
        description="Address ranges RUN steps may reach besides those names (a private "
        "mirror: `10.0.5.0/24`; same syntax as SANDBOX_EGRESS_ALLOW_CIDRS).",
    )
    environment_build_timeout: int = Field(
        1800,
        ge=10,
        le=86400,
        description="Seconds one RUN step (or one `FROM debian:` bootstrap) may take.",
    )
    egress_resolver: str = Field(
        "",
        description="DNS servers the proxy asks, `host[:port]` comma-separated; default the "
        "host's resolver (/etc/hosts, /etc/resolv.conf).",
    )
    egress_max_connections: int = Field(
        64, ge=1, le=4096, description="Connections through the proxy per sandbox at once."
    )
    egress_max_mb: int = Field(
        1024,
        ge=0,
        description="Bytes through the proxy per sandbox (execution or interpreter), both ways, "
        "MiB; 0: unbounded.",
    )
    egress_connect_timeout: float = Field(
        10, gt=0, le=300, description="Seconds the proxy waits to connect to an origin."
    )
    egress_idle_timeout: float = Field(
        120, gt=0, le=86400, description="Seconds a proxied connection may carry nothing."
    )
    secrets_rules: Path | None = Field(
        None,
        description="Secret rules (TOML `[[rule]]`: a stored secret, the hosts it may go to, "
        "the headers the egress proxy sets; docs/secrets.md); default `<state_dir>/secrets.toml`.",
    )
    secrets_store: Path | None = Field(
        None,
        description="The secrets store (values encrypted with the secrets key; may be on a "
        "filesystem replicas share); default `<state_dir>/secrets.store.json`.",
    )
    secrets_key: SecretStr | None = Field(
        None,
        description="The key the secrets store is encrypted with (32+ characters; "
        "`srt-mcp-server secrets keygen`).",
    )
    secrets_key_file: Path | None = Field(
        None, description="A file holding the secrets key (instead of SANDBOX_SECRETS_KEY)."
    )
    egress_ca_dir: Path | None = Field(
        None,
        description="The deployment CA the proxy terminates TLS to secret-bound hosts with "
        "(made at first start; the key never enters a sandbox); default `<state_dir>/egress-ca`.",
    )
    egress_upstream_ca_file: Path | None = Field(
        None,
        description="More CAs (PEM) the proxy trusts for real hosts it re-encrypts to, besides "
        "the system's (an internal service's CA).",
    )
    sandbox_user: str | None = Field(
        None,
        description="Unprivileged host user sandboxes run as (never root); default: "
        "`srt-sandbox`, a system user the server creates when it runs as root, else the "
        "server's own user.",
    )
    workspace_mb: int = Field(
        1024,
        ge=16,
        le=16 * 1024 * 1024,
        description="Size of each workspace, MiB: writes past it fail with ENOSPC inside the "
        "sandbox and uploads are refused (a thin filesystem image per workspace: it takes "
        "what it holds; with SANDBOX_WORKSPACE_RESERVE=allocate each one takes this much of "
        "the state filesystem from its creation until it is removed).",
    )
    workspace_reserve: str = Field(
        "thin",
        description="`thin`: workspace images take what they hold (plus ~80 KiB of ext4 "
        "metadata and journal) and give deleted files' blocks back; a new session is refused "
        "when the state filesystem has no room above SANDBOX_MIN_FREE_DISK_MB for a margin per "
        "mounted workspace (SANDBOX_WORKSPACE_HEADROOM_MB), and under that line writes inside "
        "workspaces fail with ENOSPC before any accepted one could be lost. `allocate`: each "
        "image is allocated in full when made (fallocate), so nothing filling the state "
        "filesystem can fail a write a workspace accepted; it costs SANDBOX_WORKSPACE_MB of "
        "disk per workspace (kept ones, pooled blanks and warm slots included). `sparse` is "
        "the old name of `thin`.",
    )
    workspace_headroom_mb: int = Field(
        64,
        ge=8,
        le=1024 * 1024,
        description="Free space, MiB, kept on the state filesystem for each mounted thin "
        "workspace above SANDBOX_MIN_FREE_DISK_MB: half is what it may hold written but not "
        "yet flushed (its loop device's dirty-page limit), half what its journal and inode "
        "tables may still take. New sessions are refused, and writes inside workspaces stop "
        "with ENOSPC, before this room is gone.",
    )
    min_free_disk_mb: int = Field(
        1024,
        ge=0,
        description="Free space, MiB, kept on the state filesystem (SANDBOX_STATE_DIR): below "
        "it /ready answers 503, /health says `disk: low`, no new workspace is made and thin "
        "workspaces take no new data (writes fail with ENOSPC; what they accepted is flushed "
        "into this room, so it must exceed what the kernel holds unflushed: see "
        "DEPLOYMENT.md); 0: no floor.",
    )
    workspace_inodes: int | None = Field(
        None,
        ge=256,
        le=2**31,
        description="Files and directories each workspace may hold; default one per 16 KiB "
        "of SANDBOX_WORKSPACE_MB (65536 for 1 GiB). At most one per KiB (the inode table "
        "comes out of the workspace's bytes).",
    )
    workspace_quota: str = Field(
        "auto",
        description="`auto`: a directory with a project quota per workspace where the state "
        "filesystem allows (ext4 `prjquota`, XFS `pquota`, btrfs with quotas enabled), else a "
        "quota'd filesystem image per workspace where the host allows (root, loop devices, "
        "mkfs.ext4), else plain directories without a quota; `project`: refuse to run without "
        "project quotas; `image`: refuse to run without images; `none`: plain directories.",
    )
    max_mounted_workspaces: int = Field(
        1024,
        ge=1,
        le=65536,
        description="Workspace images mounted at once on this replica (images only: project-"
        "quota directories mount nothing and are not counted; each image holds a loop "
        "device and a kernel journal thread); warm interpreters' workspaces count too. Past "
        "it, the least recently used idle workspace is unmounted (its files stay in its image "
        "and come back on next use); when every one is in use, the call is refused.",
    )
    max_mounted_workspaces_per_principal: int = Field(
        64,
        ge=1,
        le=65536,
        description="Session workspace images one token principal has mounted at once on "
        "this replica (images only, like SANDBOX_MAX_MOUNTED_WORKSPACES); past it, that "
        "principal's least recently used idle workspace is unmounted, and the call is "
        "refused when every one is in use.",
    )
    workspace_retention_seconds: int = Field(
        86400,
        ge=60,
        description="A workspace unused this long (no execution, interpreter or file tool) is "
        "removed with its files; the session's next call reports `session_reset`.",
    )
    idle_workspaces_mb: int = Field(
        51200,
        ge=0,
        description="What the idle workspaces of this replica may hold on disk (MiB; 0: no "
        "budget): past it the least recently used are removed first (after a snapshot where "
        "a store is set), besides the age limit; the session's next call reports "
        "`session_reset: workspace_removed`.",
    )
    idle_workspaces_mb_per_principal: int = Field(
        10240,
        ge=0,
        description="What one token principal's idle workspaces on this replica may hold "
        "(MiB; 0: no budget); its least recently used are removed first.",
    )
    idle_workspace_seconds: int = Field(
        300,
        ge=1,
        description="A workspace unused this long (and not in use) is idle: the budgets above "
        "may remove it.",
    )
    max_inline_bytes: int = Field(
        2 * 1024 * 1024,
        ge=1024,
        le=3 * 1024 * 1024,
        description="Largest content one write_file or read_file call carries inline, bytes "
        "(MCP requests are capped at 4 MiB); larger files go through create_file_url.",
    )
    max_upload_mb: int | None = Field(
        None,
        ge=1,
        description="Largest body of a PUT to a file URL, MiB; default: the workspace size.",
    )
    file_url_max_seconds: int = Field(
        86400, ge=60, description="Longest life a caller may give a file URL, seconds."
    )
    file_url_secret: SecretStr | None = Field(
        None,
        description="Key of file URL signatures on a replica without SANDBOX_CLUSTER_SECRET "
        "(which is used when set); default: a random key kept in the state directory.",
    )
    public_url: str | None = Field(
        None,
        description="Base of the file URLs this server hands out, e.g. https://sandbox.example"
        "; default: from the request (Host, or X-Forwarded-Host/-Proto from a proxy).",
    )
    state_dir: Path = Field(
        Path("/var/lib/sandbox-runtime"),
        description="Server state: workspaces live in `<state_dir>/workspaces`.",
    )
    role: str = Field(
        "all",
        pattern=r"^(all|api|worker)$",
        description="all: serve MCP and run sandboxes (one process does both); api: serve MCP, "
        "the console and file URLs, and run nothing (sessions are placed on workers); worker: "
        "run sandboxes, interpreters and hosted servers for api replicas, on the cluster port "
        "only. api and worker need REDIS_URL and SANDBOX_CLUSTER_SECRET.",
    )
    worker_max_sessions: int = Field(
        200, ge=1, description="A worker takes no new session past this many homed on it."
    )
    worker_drain_seconds: int = Field(
        60,
        ge=0,
        le=86400,
        description="On SIGTERM, how long a worker lets its running executions finish before "
        "it stops them (it takes no new session meanwhile).",
    )
    placement_wait_seconds: float = Field(
        10.0,
        gt=0,
        le=300,
        description="How long an api replica waits for a worker to take a new session before "
        "the call fails with 'no worker capacity'.",
    )
    snapshot_store: str = Field(
        "",
        description="Where session snapshots are kept: a directory (any shared filesystem, for "
        "a cluster), `s3://bucket/prefix` (S3 or any S3-compatible server; credentials from "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN), or `none`; default "
        "`<state_dir>/snapshots` (one machine).",
    )
    snapshot_s3_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("SANDBOX_SNAPSHOT_S3_ENDPOINT", "AWS_ENDPOINT_URL"),
        description="The S3 endpoint of an S3-compatible server, e.g. http://minio:9000 "
        "(env SANDBOX_SNAPSHOT_S3_ENDPOINT or AWS_ENDPOINT_URL); default: AWS.",
    )
    snapshot_s3_region: str = Field(
        "us-east-1",
        validation_alias=AliasChoices("SANDBOX_SNAPSHOT_S3_REGION", "AWS_REGION"),
        description="The bucket's region (env SANDBOX_SNAPSHOT_S3_REGION or AWS_REGION).",
    )
    snapshot_store_timeout: float = Field(
        30.0,
        gt=0,
        le=600,
        description="Seconds one request to the snapshot store may take before it counts as "
        "down (snapshots are then delayed; a restore starts the session empty).",
    )
    snapshot_idle_seconds: int = Field(
        120,
        ge=0,
        description="Snapshot a session this long after its last use, if it changed since its "
        "last snapshot (0: only on demand and on stop).",
    )
    snapshot_drain_seconds: int = Field(
        30,
        ge=0,
        le=3600,
        description="On SIGTERM, with Redis: time to snapshot the sessions changed since their "
        "last snapshot before they are released to other replicas (0: none).",
    )
    snapshot_keep: int = Field(
        5, ge=1, le=1000, description="Snapshots kept per session (the newest)."
    )
    snapshot_ttl_seconds: int = Field(
        7 * 86400, ge=60, description="Snapshots older than this are removed."
    )
    snapshot_quota_mb: int = Field(
        10240,
        ge=1,
        description="Bytes of snapshots a token (principal) may keep, in MiB (stored, after "
        "deduplication and compression); the oldest go first.",
    )
    snapshot_max_per_principal: int = Field(
        100, ge=1, le=10000, description="Snapshots a token (principal) may keep."
    )
    bwrap_path: str | None = Field(None, description="bubblewrap binary (default: from PATH).")
    cgroup_favordynmods: bool = Field(
        True,
        description="Turn on the kernel's cgroup `favordynmods` at start (root only): moving a "
        "sandbox into its cgroup then costs microseconds instead of an RCU grace period.",
    )

    log_file: Path | None = Field(
        None, description="Log file (rotated at 10 MB, kept 7 days); none: stderr only."
    )
    log_level: str = Field("INFO", description="Log level: DEBUG, INFO, WARNING, ERROR.")
    log_format: str = Field(
        "text", description="`text`, or `json` for one JSON object per line (log shippers)."
    )
    access_log: bool = Field(True, description="Log each HTTP request (method, path, status).")
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token for GET /metrics; default: any static client token is "
        "accepted (none configured: open, or closed when OAuth is on).",
    )
    audit_log: str = Field(
        "",
        description="The audit log: one JSON line per tool call, signed file URL use and hosted "
        "server call (time, principal, token id, tool, session, outcome, duration, argument "
        "sizes; never a token or contents). A file path (one per replica), `-` for stdout, "
        "empty: off. Read it with `srt-mcp-server audit`.",
    )
    audit_log_max_mb: int = Field(
        100, ge=1, le=1_000_000, description="Rotate the audit log file at this size (MiB)."
    )
    audit_log_backups: int = Field(
        10,
        ge=0,
        le=10_000,
        description="Rotated audit log files kept beside it (FILE.1 newest … FILE.N oldest).",
    )
    audit_log_queue_mb: float = Field(
        4.0,
        gt=0,
        le=1024,
        description="Audit lines waiting for a slow disk, at most (MiB): past it a call's line "
        "is dropped (counted in srt_audit_dropped_lines_total, said in the log), never waited for.",
    )

    @field_validator("environments_allow")
    @classmethod
    def _environments_allow(cls, value: str) -> str:
        parsing.environments_allow(value)  # (ValueError naming the entry)
        return value

    @field_validator("log_format")
    @classmethod
    def _format(cls, value: str) -> str:
        return parsing.choice(value, ("text", "json"), "log_format must be `text` or `json`")

    @field_validator("workspace_quota")
    @classmethod
    def _quota(cls, value: str) -> str:
        allowed = ("auto", "project", "image", "none")
        return parsing.choice(
            value, allowed, "workspace_quota must be `auto`, `project`, `image` or `none`"
        )

    @field_validator("workspace_reserve")
    @classmethod
    def _reserve(cls, value: str) -> str:
        allowed = ("thin", "allocate", "sparse")
        chosen = parsing.choice(value, allowed, "workspace_reserve must be `thin` or `allocate`")
        if chosen == "sparse":
            logger.info("SANDBOX_WORKSPACE_RESERVE=sparse is now called `thin`")
            return "thin"
        return chosen

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        value = value.upper()
        if value not in {"TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"unknown log level {value!r}")
        return value

    @field_validator("replica_id")
    @classmethod
    def _replica(cls, value: str) -> str:
        # ASCII only (str.isalnum takes any script's letters and digits): it names cgroups,
        # Redis keys and the Mcp-Session-Id tag.
        if not REPLICA_ID.fullmatch(value):
            raise ValueError("replica_id: letters, digits, '-' and '_' only, at most 64")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.timeout > self.max_timeout:
            raise ValueError(
                f"SANDBOX_TIMEOUT ({self.timeout}) exceeds SANDBOX_MAX_TIMEOUT ({self.max_timeout})"
            )
        self.tokens()  # parse now so a bad SANDBOX_AUTH_TOKENS fails at start
        parsing.oauth(self.oauth_issuers(), self.oauth_resource)
        try:
            warm = self.warm_interpreters()
        except ValueError:
            raise ValueError("SANDBOX_INTERPRETER_WARM must look like python=1,bash=0") from None
        if any(n < 0 or n > 16 for n in warm.values()):
            raise ValueError("SANDBOX_INTERPRETER_WARM: between 0 and 16 per language")
        try:
            self.egress_policy()
            self.egress_resolvers()
        except (ValueError, EgressDenied) as exc:
            raise ValueError(f"egress settings: {exc}") from None
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise ValueError("SANDBOX_PUBLIC_URL must start with http:// or https://")
        secret = self.cluster_secret.get_secret_value() if self.cluster_secret else ""
        if secret and len(secret) < 16:
            raise ValueError("SANDBOX_CLUSTER_SECRET must be at least 16 characters")
        if self.role != "all" and (not self.redis_url or not secret):
            raise ValueError(
                f"SANDBOX_ROLE={self.role} needs REDIS_URL and SANDBOX_CLUSTER_SECRET (api and "
                "worker replicas find each other through Redis)"
            )
        if self.redis_url and self.cluster_port is not None and self.cluster_port != 0:
            if self.cluster_port == self.port:
                raise ValueError("SANDBOX_CLUSTER_PORT must differ from SANDBOX_PORT")
        return self

    def tokens(self) -> dict[str, str]:
        """token -> principal for every configured token."""
        return parsing.tokens(
            self.auth_token.get_secret_value() if self.auth_token is not None else "",
            self.auth_tokens.get_secret_value() if self.auth_tokens is not None else "",
        )

    def oauth_issuers(self) -> list[str]:
        """The accepted issuers (empty: OAuth off)."""
        return parsing.comma_list(self.oauth_issuer)

    def oauth_advertised_scopes(self) -> list[str] | None:
        """SANDBOX_OAUTH_SCOPES as a list (None: this server's own; empty: none)."""
        if self.oauth_scopes is None or not self.oauth_scopes.strip():
            return None
        if self.oauth_scopes.strip().lower() == "none":
            return []
        return parsing.comma_list(self.oauth_scopes.replace(" ", ","))

    def oauth_audiences(self) -> list[str]:
        """Every accepted audience: the resource first, then SANDBOX_OAUTH_AUDIENCE's."""
        first = [self.oauth_resource] if self.oauth_resource else []
        return first + parsing.comma_list(self.oauth_audience)

    def workspace_inode_count(self) -> int:
        """Inodes per workspace image: the setting (or one per 16 KiB), at most one per KiB."""
        return parsing.inode_count(self.workspace_mb, self.workspace_inodes)

    def upload_limit_bytes(self) -> int:
        return (self.max_upload_mb or self.workspace_mb) * 1024 * 1024

    def runtime_path(self) -> Path:
        return self.runtime_dir or self.state_dir / "runtime"

    def servers_path(self) -> Path:
        return self.servers_file or self.state_dir / "servers.toml"

    def environments_path(self) -> Path:
        """Environments: roots by digest, names as pointers (environments/store.py)."""
        return self.environments_dir or self.state_dir / "environments"

    def servers_dir(self) -> Path:
        """Hosted servers' installs (`install/<name>`) and logs (`logs/<name>.log`)."""
        return self.state_dir / "servers"

    def warm_interpreters(self) -> dict[str, int]:
        """language -> interpreters to keep started ahead."""
        return parsing.warm_interpreters(self.interpreter_warm)

    def cluster_bind(self) -> tuple[str, int]:
        """(host, port) of the cluster listener."""
        return parsing.cluster_bind(self.host, self.port, self.cluster_host, self.cluster_port)

    def egress_policy(self) -> EgressPolicy:
        """The server's egress policy (the ceiling of every sandbox's). Raises ValueError."""
        return EgressPolicy(self.egress_allow, self.egress_deny, self.egress_allow_cidrs)

    def secrets_rules_path(self) -> Path:
        return self.secrets_rules or self.state_dir / "secrets.toml"

    def secrets_store_path(self) -> Path:
        return self.secrets_store or self.state_dir / "secrets.store.json"

    def secrets_key_bytes(self) -> str | None:
        """The secrets key as given (SANDBOX_SECRETS_KEY; the file is read by the store)."""
        return self.secrets_key.get_secret_value() if self.secrets_key is not None else None

    def egress_ca_path(self) -> Path:
        return self.egress_ca_dir or self.state_dir / "egress-ca"

    def egress_resolvers(self) -> list[tuple[str, int]]:
        """(address, port) of each DNS server SANDBOX_EGRESS_RESOLVER names."""
        return parsing.resolvers(self.egress_resolver)

    def egress_settings(self) -> EgressSettings:
        """What the egress proxy's supervisor needs (the server and `doctor` start one)."""
        return EgressSettings(
            connect_timeout=self.egress_connect_timeout,
            idle_timeout=self.egress_idle_timeout,
            max_connections=self.egress_max_connections,
            max_bytes=self.egress_max_mb * 1024 * 1024,
            resolvers=self.egress_resolvers(),
        )

    def limits(self) -> SandboxLimits:
        """The sandbox policy: defaults and ceilings for every execution."""
        return SandboxLimits(
            memory_mb=self.memory_mb,
            pids=self.pids_limit,
            cpu_cores=self.cpu_cores,
            cpu_time_seconds=self.cpu_time_seconds,
            file_size_mb=self.file_size_mb,
            tmp_size_mb=self.tmp_size_mb,
            open_files=self.open_files,
            output_bytes=self.output_limit_bytes,
            pseudo_terminals=self.pseudo_terminals,
            network=self.egress_policy().enabled,
        )
