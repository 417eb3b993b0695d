#!/usr/bin/env bash
# An S3-compatible server for the tests, on 127.0.0.1:PORT, in the
# foreground: moto's standalone server (PyPI `moto`, installed into the
# project's .venv if missing), IAM authentication on, fixed test
# credentials, bucket `ckpt-test`. Before serving it prints the environment
# a client needs, as `export` lines:
#   export AWS_ENDPOINT_URL=http://127.0.0.1:PORT
#   export AWS_ACCESS_KEY_ID=...   AWS_SECRET_ACCESS_KEY=...
#   export AWS_REGION=us-east-1    AWS_ALLOW_HTTP=true
# Usage: tests/s3/serve.sh PORT        (Ctrl-C or SIGTERM stops it)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
port="${1:?usage: tests/s3/serve.sh PORT}"
py="$root/.venv/bin/python"
# Pinned, so a new release cannot change the tests.
MOTO_VERSION=5.2.5
if ! "$py" -c 'import moto, flask, flask_cors' 2>/dev/null; then
    if [ ! -x "$py" ]; then
        echo "serve.sh: no $py; run .ci/setup.sh first" >&2
        exit 1
    fi
    echo "serve.sh: installing moto $MOTO_VERSION into .venv" >&2
    "$py" -m pip install -q --disable-pip-version-check "moto[s3]==$MOTO_VERSION" flask flask-cors >&2
fi
exec "$py" -u "$root/tests/s3/serve.py" "$port"
