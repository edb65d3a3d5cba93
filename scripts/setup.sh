#!/usr/bin/env bash
# Installs everything mixlens needs on a fresh Debian machine: the C++ libraries from Debian's
# packages and a project-local virtual environment (.venv) with the Python side:
# requirements-build.txt (building, `make demo`), and with --dev requirements-dev.txt too (tests).
set -euo pipefail
cd "$(dirname "$0")/.."

# clang + its runtime libraries: the ASan/UBSan/TSan builds and the libFuzzer harnesses (make test).
APT_PACKAGES=(build-essential cmake pkg-config libopenblas-dev nlohmann-json3-dev libpcre2-dev
              libutf8proc-dev libgtest-dev python3-venv clang libclang-rt-dev)
# Headless Chromium: tests/python/test_plot.py opens the HTML plots offline and screenshots them.
APT_PACKAGES+=(chromium)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-build.txt
if [ "${1:-}" = "--dev" ]; then
  # sae-lens (the SAELens recipe's test) resolved together with the pins, so it cannot move them.
  .venv/bin/python -m pip install -q -r requirements-dev.txt -r requirements-sae.txt
  # The dev package (dev/mixlens_dev: oracles, fixture generator, bench timer) for scripts/ and bench/:
  # a .pth naming this checkout's dev/ (pytest finds it through pyproject.toml's pythonpath).
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$PWD/dev" > "$site/mixlens_dev.pth"
fi
