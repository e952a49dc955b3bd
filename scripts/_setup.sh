# Shared by scripts/serve and scripts/test: install what the project needs, idempotently.
# Sourced, not run. Sets VENV and PY.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SRT_VENV:-$ROOT/.venv}"

log() { printf '[setup] %s\n' "$*" >&2; }

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
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
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
        log "installing sandbox_runtime$extras into $VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
        "$VENV/bin/python" -m pip install -q -e "$ROOT$extras"
        touch "$stamp"
    fi
    PY="$VENV/bin/python"
}
