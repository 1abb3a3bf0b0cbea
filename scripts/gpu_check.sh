#!/usr/bin/env bash
# Issue 55's GPU check: one call of the session's `device` tool on a lent GPU machine (docs/reproducing.md).
#   1. the device tests with the GPU added (tests/federation/test_device.py, GRADLEAK_TEST_DEVICES=cuda): client
#      training, the defenses and every device-ready attack on the GPU against the CPU, and a whole run;
#   2. one cell of the image map at paper scale on the GPU (CELL, default resnet18_train-b8-fedsgd:
#      ResNet-18 at width 64, batch 8, IG and GradInversion at their default 2,000 iterations; 2 audited
#      clients so that the call fits) -> $OUT/gpu/image_map_paper.json;
#   3. the same cell on that machine's CPU at CPU_ITERS iterations (default 20) -> $OUT/cpu/, and
#      $OUT/summary.json: each attack's seconds per iteration on the GPU and the CPU, and their ratio.
# Prepare here once (both paths are git-ignored through .git/info/exclude and travel with `carry`):
#   echo /.whl/ >> .git/info/exclude; echo /.devdata/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl opacus==1.6.0      # the one package the image lacks
#   mkdir -p .devdata && cp -r ../shared/data/cifar10-test-jpeg .devdata/
# Then: run(command="bash scripts/gpu_check.sh", carry=[".whl", ".devdata"], timeout_s=580).
# Commit what comes back under benchmarks/results/device/ with the card named (summary.json holds it).
# Here, without a GPU, the same steps run on the CPU alone: DEVICE=cpu OUT=/tmp/gc PY=.venv/bin/python
# CPU_ITERS=2 GPU_ITERS=2 bash scripts/gpu_check.sh   (GPU_ITERS shortens step 2; unset on the GPU).
set -uo pipefail
DEVICE=${DEVICE:-cuda}; PY=${PY:-python3}; CELL=${CELL:-resnet18_train-b8-fedsgd}; CPU_ITERS=${CPU_ITERS:-20}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests GRADLEAK_DATA=$PWD/.devdata PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi -L | tee "$OUT/gpu.txt"
extra=()
[ "$DEVICE" = cpu ] || extra=(GRADLEAK_TEST_DEVICES="$DEVICE")
env "${extra[@]}" timeout 240 $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/federation/test_device.py 2>&1 \
    | tee "$OUT/device_tests.log" | tail -n 15
tests=${PIPESTATUS[0]}
iters=()
[ -n "${GPU_ITERS:-}" ] && iters=(--set "audit.attacks.0.max_iterations=$GPU_ITERS" --set "audit.attacks.1.max_iterations=$GPU_ITERS")
timeout 200 $PY -m gradleak -q bench benchmarks/configs/image_map.toml --scale paper --cells "$CELL" \
    --set "experiment.device=$DEVICE" --set audit.clients=2 "${iters[@]}" --out "$OUT/gpu" --store /tmp/gpu.sqlite 2>&1 | tail -n 3
timeout 200 $PY -m gradleak -q bench benchmarks/configs/image_map.toml --scale paper --cells "$CELL" \
    --set experiment.device=cpu --set audit.clients=2 --set "audit.attacks.0.max_iterations=$CPU_ITERS" \
    --set "audit.attacks.1.max_iterations=$CPU_ITERS" --out "$OUT/cpu" --store /tmp/cpu.sqlite 2>&1 | tail -n 3
$PY - "$OUT" "$tests" <<'PY'
import json, pathlib, sys
out, tests = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def per_iteration(folder):
    path = out / folder / "image_map_paper.json"
    if not path.exists():
        return None, {}
    result = json.loads(path.read_text())
    rows = {r["attack"]: r["attack_seconds"] / r["options"].get("max_iterations", 2000) for r in result["rows"]}
    return result["machine"], rows
gpu_machine, gpu = per_iteration("gpu")
_, cpu = per_iteration("cpu")
card = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else "no GPU"
summary = {"card": card, "device_tests_exit": tests, "machine": gpu_machine,
           "seconds_per_iteration": {"gpu": gpu, "cpu": cpu},
           "cpu_over_gpu": {a: cpu[a] / gpu[a] for a in gpu if a in cpu and gpu[a] > 0}}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
ls -la "$OUT" "$OUT"/gpu "$OUT"/cpu 2>/dev/null
exit "$tests"
