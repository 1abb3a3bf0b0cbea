#!/usr/bin/env bash
# Issue 22 on a lent GPU machine (the session's `device` tool; docs/reproducing.md), one call per step:
#   pool:    train the public OrganAMNIST diffusion generator of configs/aegis_generator_utility_6000.toml
#            and sample its pool (benchmarks/public_generators.py); back under $OUT: the result JSON, the
#            generator, and the pool xz-compressed in 15 MiB parts (the tool returns files of at most 16 MiB,
#            64 MiB in all); scripts/device_generators_unpack.sh puts them into benchmarks/.state/generators;
#   quality: benchmarks/generator_quality.py at paper scale with the diffusion generators on the GPU.
# Measured on an H200 (2026-12-04): 6,000 training steps take 193 s (32 ms a step: launch-bound, a 0.76 M
# parameter UNet), so each step needs a call of its own within the tool's 600 s.
# Carried: .whl (diffusers, absent there) and .devdata/medmnist/organamnist.npz (the data set).
# SCALE, DEVICE, PY (the python) and STORE may be set to try it elsewhere:
#   SCALE=smoke DEVICE=cpu PY=.venv/bin/python OUT=/tmp/out scripts/device_generators.sh pool
# quality retrains the public generator unless STORE holds it: carry benchmarks/.state/generators after
# unpacking the pool step's files and set STORE=benchmarks/.state/generators.
# Exits with the Python step's status (124: cut by its timeout).
set -uo pipefail
case "${1:-}" in pool | quality) ;; *) echo "usage: $0 pool|quality" >&2; exit 2 ;; esac
SCALE=${SCALE:-paper}; DEVICE=${DEVICE:-cuda}; PY=${PY:-python3}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/src GRADLEAK_DATA=$PWD/.devdata PYTHONUNBUFFERED=1 TQDM_DISABLE=1
STORE=${STORE:-/tmp/store}
nvidia-smi -L
case "${1:-}" in
pool)
    timeout 500 $PY benchmarks/public_generators.py --config benchmarks/configs/aegis_generator_utility_6000.toml \
        --scale "$SCALE" --device "$DEVICE" --threads 16 --store "$STORE" --out "$OUT" 2>&1 | tail -n 20
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "public_generators.py failed ($rc)" >&2; exit "$rc"; }
    cp "$STORE"/diffusion-[0-9a-f]*.safetensors "$OUT"/ || exit 4
    $PY - "$STORE" "$OUT" <<'PY'
import lzma, pathlib, sys
store, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for pool in sorted(store.glob("diffusion-pool-*.safetensors")):
    packed = lzma.compress(pool.read_bytes(), preset=6)
    if len(packed) > 55 * 2**20:  # 64 MiB come back in all: keep the generator; the CPU run resamples it
        print(pool.name, "packs to", len(packed), "bytes: too large to come back, left out", flush=True)
        continue
    part = 15 * 2**20
    for i in range(0, len(packed), part):
        (out / f"{pool.name}.xz.{i // part}").write_bytes(packed[i : i + part])
    print(pool.name, pool.stat().st_size, "->", len(packed), flush=True)
PY
    ;;
quality)
    timeout 560 $PY benchmarks/generator_quality.py --scale "$SCALE" --device "$DEVICE" --threads 16 \
        --store "$STORE" --out "$OUT" 2>&1 | tail -n 60
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "generator_quality.py failed ($rc)" >&2; exit "$rc"; }
    ;;
esac
ls -la "$OUT"
