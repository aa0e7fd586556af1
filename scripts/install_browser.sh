#!/usr/bin/env bash
# Installs the headless browser the dashboard test drives: Debian's `chromium` and its matching
# `chromium-driver` (/usr/bin/chromium, /usr/bin/chromedriver). Needs root (or sudo) and apt.
# The browser always comes from the distribution's packages; no tool downloads one of its own.
set -euo pipefail

if [[ -x /usr/bin/chromium && -x /usr/bin/chromedriver ]]; then
    echo "chromium and chromedriver are already installed"
    exit 0
fi

SUDO=""
if [[ "$(id -u)" != "0" ]]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "error: installing chromium needs root (or sudo)" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: apt-get is not available; install chromium and chromium-driver by hand" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium chromium-driver fonts-dejavu-core

/usr/bin/chromium --version
/usr/bin/chromedriver --version
