#!/usr/bin/env bash
# Put what scripts/device_generators.sh returned (folder $1) into the generator store (default
# benchmarks/.state/generators): the generators as they are, each pool's xz parts joined and unpacked.
set -euo pipefail
from=$1; store=${2:-benchmarks/.state/generators}
mkdir -p "$store"
install -m 0644 "$from"/diffusion-[0-9a-f]*.safetensors "$store"/  # the returned files are read-only
for first in "$from"/diffusion-pool-*.safetensors.xz.0; do
    [ -e "$first" ] || continue
    name=$(basename "$first" .xz.0)
    i=0; parts=()
    while [ -e "$from/$name.xz.$i" ]; do parts+=("$from/$name.xz.$i"); i=$((i + 1)); done
    cat "${parts[@]}" | xz -d > "$store/$name.tmp"
    mv "$store/$name.tmp" "$store/$name"
done
ls -la "$store"
