#!/bin/sh
# `pip install` in the image builds, with the package index settings of the machine that builds
# (build arguments of deploy/*.Dockerfile; docker-compose.yml passes them from the environment):
#
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_TRUSTED_HOST   pip's own settings
#   PIP_CA_CERTS   PEM text of certificates to trust besides pip's own bundle (a proxy's CA)
#
# Unset or empty ones are left out. They live in the build stages only, never in the final images
# (build arguments show in the build stage's history: put no credentials in an index URL there).
# PIP (default /opt/venv/bin/pip) is the pip to run; the arguments are those of `pip install`.
set -eu
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST PIP_CA_CERTS; do
  eval "value=\${$name:-}"
  if [ -z "$value" ]; then unset "$name"; fi
done
pip="${PIP:-/opt/venv/bin/pip}"
if [ -n "${PIP_CA_CERTS:-}" ]; then
  bundle="$(mktemp)"
  "$(dirname "$pip")/python" -c "import pip._vendor.certifi as c; print(open(c.where()).read())" > "$bundle"
  printf '%s\n' "$PIP_CA_CERTS" >> "$bundle"
  export PIP_CERT="$bundle"
  unset PIP_CA_CERTS
fi
"$pip" install --no-cache-dir --disable-pip-version-check "$@"
rm -f "${bundle:-}"
