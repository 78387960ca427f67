#!/bin/sh
# Regenerate the committed stubs from kvflow.proto (see regenerate.py).
set -e
cd "$(dirname "$0")/../../.."
exec python -m ciuicflow.kvflow.proto.regenerate
