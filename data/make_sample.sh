#!/usr/bin/env bash
# Regenerate data/sample.h5, the bundled input of scripts/main.sh (same bytes every time):
# N=1024 tokens, H=4 query heads sharing H_kv=2 K/V heads, D=32, float32, with do.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$here/jobs/local.sh" -n 2 make-data "$here/data/sample.h5" --n 1024 --heads 4 --kv-heads 2 --dim 32 \
    --dtype float32 --seed 2024 --with-do --overwrite
