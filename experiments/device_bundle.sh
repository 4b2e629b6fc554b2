#!/usr/bin/env bash
# Build a self-contained bundle for the GPU machine (no network there, 64 MiB carried
# per call) from THIS working tree: the code (prism_select/ + experiments/ + pyproject),
# GSM8K and BBH (compressed), the peft/gguf wheels and the embedded GGUF split in two parts.
#
#   bash experiments/device_bundle.sh DEST      # DEST: an ignored folder of the repository
#                                               # the device calls send (e.g. .cache/bundle)
# Gives DEST/part1/ (first 48 MiB of the GGUF, carried by a first call) and DEST/run/
# (everything else, carried by the calls that run experiments/device_experiment.sh).
# PRIOR="runs/x/NAME [runs/y/OTHER ...]" packs earlier experiment folders (adapters and weights
# left out) as DEST/run/prior.tar.gz: device_experiment.sh unpacks them into
# /tmp/prism-runs/NAME ..., so a fresh machine resumes those runs (finished steps, judged
# responses) instead of starting over; a start model is trained again (on the same GPU kind,
# to the same weights: two H200 runs of one recipe gave one fingerprint), its scores are reused.
set -euo pipefail
DEST="${1:?usage: device_bundle.sh DEST}"
SRC="$(cd "$(dirname "$0")/.." && pwd)"
DATA="${PRISM_DATA_ROOT:-$SRC/../shared/data}"
PY="${PYTHON:-python3}"
for p in ${PRIOR:-}; do  # the experiment refuses a non-empty --out without its marker
  [ -f "$p/experiment.json" ] || { echo "PRIOR $p has no experiment.json: copy the whole run folder" >&2; exit 1; }
done
rm -rf "$DEST"
mkdir -p "$DEST/part1" "$DEST/run/part2" "$DEST/run/wheels" "$DEST/run/tree"
(cd "$SRC" && tar cf - --exclude=__pycache__ prism_select experiments pyproject.toml) | tar xf - -C "$DEST/run/tree"
# compressed (7.6 MB -> about 1.5 MB): the carried total stays under 64 MiB as the repository grows
tar czf "$DEST/run/data.tar.gz" -C "$DATA" gsm8k bbh
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST/run/wheels" \
    "peft==$("$PY" -c 'import peft; print(peft.__version__)')" \
    "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
GGUF="$("$PY" -c 'from prism_select.model import resolve_default_gguf; print(resolve_default_gguf())')"
split -b 48M -a 1 -d "$GGUF" "$DEST/part."
mv "$DEST/part.0" "$DEST/part1/part.0"
mv "$DEST/part.1" "$DEST/run/part2/part.1"
if ls "$DEST"/part.* >/dev/null 2>&1; then echo "the GGUF file needs more than two parts" >&2; exit 1; fi
sha256sum "$GGUF" | cut -d' ' -f1 > "$DEST/run/part2/sha256"
if [ -n "${PRIOR:-}" ]; then
  args=()
  for p in $PRIOR; do args+=(-C "$(cd "$(dirname "$p")" && pwd)" "$(basename "$p")"); done
  tar --exclude=adapter --exclude=.partial --exclude=checkpoints --exclude='*.safetensors' \
      -czf "$DEST/run/prior.tar.gz" "${args[@]}"
fi
du -sh "$DEST"/part1 "$DEST"/run
