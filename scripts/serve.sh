#!/usr/bin/env bash
# Serve the default model (or the MODEL and flags given) on http://127.0.0.1:8000/v1.
source "$(dirname "$0")/env.sh"
exec jaxserve serve "$@"
