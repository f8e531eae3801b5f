#!/usr/bin/env bash
# Device side of a drafter slot (scripts/slot_plan.md). Every call runs, in the repository root:
#
#   bash scripts/gpu_slot.sh recv build/slot/send/NN   stage one part (scripts/slot_prepare.sh); the last one joins
#                                                     them: MLX CUDA into $HOME/mlx-site, the target into $HOME/target
#   bash scripts/gpu_slot.sh data SECONDS             generate this slot's data (SECONDS of generation), pack it back
#   bash scripts/gpu_slot.sh unpack DATA.npz           train on an earlier call's data (carried back in)
#   bash scripts/gpu_slot.sh profile VARIANTS         each variant alone, float32 and bfloat16 compute (~1 min)
#   bash scripts/gpu_slot.sh train CALL TOTAL VARIANTS  train side by side for CALL seconds of a TOTAL-second
#                                                     schedule (resumes what an earlier call left), pack curve + logs
#   bash scripts/gpu_slot.sh pack NAME...             checkpoints back (<= 15 MiB pieces) with the curve and logs;
#                                                     PIECES=0-3 sends only those pieces (a 1.5B drafter: ~8)
#   bash scripts/gpu_slot.sh gen-profile [--batches 1024,2048]  a generation step's parts (forward, sampler)
#   bash scripts/gpu_slot.sh status                   what is staged and trained
#
# $HOME persists between calls while the machine stays warm; results go to $OUT. Environment overrides for a CPU dry
# run: SLOT_HOME (instead of $HOME), SLOT_PYTHON (python3), SLOT_ARGS (extra gpu_distill arguments, e.g. --smoke).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
H=${SLOT_HOME:-$HOME}
W=$H/work
PY=${SLOT_PYTHON:-python3}
EXTRA=${SLOT_ARGS:-}
export PYTHONUNBUFFERED=1
mkdir -p "$W" "${OUT:?OUT must name the folder that comes back}"

# mlx_dspark.<layer> from this checkout (setup.py's mapping), MLX CUDA from the staged site.
mkdir -p "$H/pkg/mlx_dspark"
for d in domain adapters application entrypoints; do ln -sfn "$REPO/$d" "$H/pkg/mlx_dspark/$d"; done
export PYTHONPATH=$H/pkg${PYTHONPATH:+:$PYTHONPATH}
[ -f "$H/mlx-site/.ok" ] && export PYTHONPATH=$H/mlx-site:$PYTHONPATH
# A target staged as its GGUF brings the `gguf` package that converts it (slot_prepare.sh TARGET=...).
[ -d "$H/bundle/pylib" ] && export PYTHONPATH=$H/bundle/pylib:$PYTHONPATH
# MLX CUDA's JIT-compiled kernels on disk, shared by every call of the slot, so a later call reuses what an earlier
# one compiled (the 2026-12-05 train call spent ~170 s before its first steps; how much is JIT is not yet measured).
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$H/ptx-cache}
mkdir -p "$MLX_PTX_CACHE_DIR"
distill() { "$PY" "$REPO/scripts/gpu_distill.py" "$@" --model "$H/target" --work "$W" $EXTRA; }

pack_small() {  # the curve, the data summary and every log: always, first
  [ -f "$W/curve.json" ] && cp "$W/curve.json" "$OUT/"
  tar -czf "$OUT/logs.tgz" -C "$W" $(cd "$W" && ls log.txt ./*.log ./*.json 2>/dev/null | sed 's|^\./||') 2>/dev/null
}

pack_ckpt() {  # NAME: its published checkpoint, card and facts as <= 15 MiB pieces (PIECES=a-b: only those)
  local n=$1 range=${PIECES:-0-99} f i
  [ -f "$W/$n/model.safetensors" ] || { echo "pack: no checkpoint $n" >&2; return 0; }
  rm -rf "$W/pieces/$n" && mkdir -p "$W/pieces/$n"
  tar -cf - -C "$W" "$n/config.json" "$n/model.safetensors" "$n/README.md" \
    $(cd "$W" && ls "$n/facts.json" 2>/dev/null) | split -b 15M -d -a 2 - "$W/pieces/$n/$n.tar."
  echo "pack: $n in $(ls "$W/pieces/$n" | wc -l) pieces, sending $range"
  for f in "$W/pieces/$n"/*; do  # a large target's drafter needs more pieces than one call brings back
    i=$((10#${f##*.}))
    [ "$i" -ge "${range%-*}" ] && [ "$i" -le "${range#*-}" ] && cp "$f" "$OUT/"
  done
  return 0
}

check_out() {  # what comes back: at most 8 files, 16 MiB each, 64 MiB together
  local files bytes
  files=$(find "$OUT" -type f | wc -l); bytes=$(du -cb "$OUT"/* 2>/dev/null | tail -1 | cut -f1)
  echo "OUT: $files files, $bytes bytes"; ls -la "$OUT"
  [ "$files" -le 8 ] && [ "${bytes:-0}" -le $((64 * 1024 * 1024)) ] || echo "OUT OVER THE LIMITS: some files will not come back" >&2
}

case ${1:-status} in
  recv)
    src=$2; mkdir -p "$H/parts"; cp "$src"/* "$H/parts/"
    if python3 "$REPO/scripts/gpu_parts.py" check "$H/parts"; then
      if [ ! -d "$H/bundle" ]; then python3 "$REPO/scripts/gpu_parts.py" join "$H/parts" "$H/bundle" || exit 1; fi
      ln -sfn "$H/bundle/target" "$H/target"
      if [ -z "${SLOT_HOME:-}" ] || command -v nvidia-smi >/dev/null; then
        (cd "$H/bundle/mlx" && HOME=$H bash a/stage.sh && HOME=$H bash b/install.sh) || exit 1
        export PYTHONPATH=$H/mlx-site:$PYTHONPATH
      fi
      rm -rf "$H/parts"
      "$PY" -c "import mlx.core as mx, mlx_lm; print('staged: mlx', mx.__version__, mx.default_device(), 'target', sorted(__import__('os').listdir('$H/target')) if __import__('os').path.isdir('$H/target') else 'none (an MLX-only bundle)')"
      command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    fi
    ;;
  data)
    secs=${2:-240}
    # The generator stops starting prompts at SECONDS; loading, saving and packing take about a minute more.
    timeout -k 20 $((secs + 240)) "$PY" "$REPO/scripts/gpu_distill.py" data --model "$H/target" --work "$W" \
      --gen-seconds "$secs" --follow-seconds $((secs / 5)) --gen-batch 2048 --samples 120000 --self-instruct 12000 \
      --follow-ups 20000 $EXTRA
    distill pack-data --pack-to "$OUT"  # this slot's own data goes back; then earlier slots' joins the training set
    prev=$(ls "$H"/bundle/prev/*.npz 2>/dev/null | paste -sd, -)
    [ -n "$prev" ] && distill merge-data --data-file "$prev"
    # The trainer's float32 against bfloat16 compute on this slot's data (PROFILE= skips it): the train call
    # after it starts on the kernels this compiled (MLX_PTX_CACHE_DIR) rather than paying the JIT itself.
    [ -n "${PROFILE-dspark-l3g}" ] && timeout -k 20 330 "$PY" "$REPO/scripts/gpu_distill.py" profile --model "$H/target" \
      --work "$W" --variants "${PROFILE-dspark-l3g}" --profile-steps 12 $EXTRA
    pack_small; check_out
    ;;
  unpack)
    # An earlier call's data (data.npz, carried back in) as this work's training set: a fresh machine trains
    # on it without generating again.
    distill unpack-data --data-file "$2"; pack_small
    ;;
  profile)
    timeout -k 20 300 "$PY" "$REPO/scripts/gpu_distill.py" profile --model "$H/target" --work "$W" --variants "$2" $EXTRA
    pack_small; check_out
    ;;
  train)
    call=$2; total=$3; variants=$4; shift 4
    deadline=$(( $(date +%s) + call ))
    # Each run stops at the deadline on its own (checkpoint, τ, facts); `timeout` is the backstop: its SIGTERM is
    # passed to every run, which checkpoints as well. Packing follows either way.
    timeout -k 45 $((call + 150)) "$PY" "$REPO/scripts/gpu_distill.py" train --model "$H/target" --work "$W" \
      --variants "$variants" --deadline "$deadline" --train-seconds "$total" "$@" $EXTRA
    echo "train exit $?"
    distill curve --variants "$variants"
    pack_small; for n in ${PACK:-}; do pack_ckpt "$n"; done; check_out
    ;;
  gen-profile)
    # One generation step's parts on the staged target (scripts/gen_profile.py): forward, greedy, sampler with
    # and without the nucleus sort, at each batch; tells the data call its batch and whether to skip the sort.
    shift; timeout -k 20 300 "$PY" "$REPO/scripts/gen_profile.py" --model "$H/target" "$@"
    ;;
  pack)
    shift; for n in "$@"; do pack_ckpt "$n"; done; pack_small; check_out
    ;;
  status)
    ls -la "$H" "$W" 2>/dev/null; [ -f "$W/curve.json" ] && cat "$W/curve.json" | head -50
    ;;
  *) echo "unknown: $1" >&2; exit 2 ;;
esac
