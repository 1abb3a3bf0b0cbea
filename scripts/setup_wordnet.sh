#!/usr/bin/env bash
# Prepare WordNet 3.0 for NLTK's METEOR offline (idempotent).
# 1. If Debian's dict files are missing and we are root, `apt-get install -y wordnet-base`
#    (and wordnet-sense-index when available; optional).
# 2. Build the NLTK data folder (<venv>/nltk_data/corpora/wordnet) from the dict files plus
#    ../shared/data/wordnet/lexnames, via gradleak.data.wordnet.ensure_wordnet.
# Usage: scripts/setup_wordnet.sh [PYTHON]   (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
DICT="${GRADLEAK_WORDNET_DICT:-/usr/share/wordnet}"
if [ ! -f "$DICT/data.noun" ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
    apt-get install -y -q wordnet-base >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q wordnet-base >/dev/null; }
    apt-get install -y -q wordnet-sense-index >/dev/null 2>&1 || true
  else
    echo "WordNet dict files missing in $DICT: run 'sudo apt-get install wordnet-base' (or set GRADLEAK_WORDNET_DICT)" >&2
    exit 1
  fi
fi
"$PY" -c "from gradleak.data.wordnet import ensure_wordnet; print('WordNet for NLTK:', ensure_wordnet())"
