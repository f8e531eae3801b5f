#!/usr/bin/env bash
# Staging a large target (scripts/slot_prepare.sh with SLIM=1): every device call carries the working tree, 39 of
# whose 42 MB are the shipped drafters, so the parts shrink to ~21 MiB. While staging, this takes the drafters out
# of what travels (out of git's index and ignored; the files stay on disk), so a call carries ~58 MiB of parts.
#
#   bash scripts/slot_slim.sh on      before the first `recv` call (refuses when the index has staged changes)
#   bash scripts/slot_slim.sh off     after the last one, always (restores the index from HEAD)
#   bash scripts/slot_slim.sh status
#
# Never commit while it is on: the index then records the drafters as deleted.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=adapters/hf/drafters_data
EXCLUDE=$(git rev-parse --git-path info/exclude)
LINE="/$DIR/"
case ${1:-status} in
  on)
    git diff --cached --quiet || { echo "slot_slim: the index has staged changes; commit or unstage them first" >&2; exit 1; }
    mkdir -p "$(dirname "$EXCLUDE")"
    grep -qxF "$LINE" "$EXCLUDE" 2>/dev/null || echo "$LINE" >> "$EXCLUDE"
    git rm -r -q --cached "$DIR"
    echo "slot_slim: on ($DIR out of the index, ignored; run 'off' after staging)"
    ;;
  off)
    if [ -f "$EXCLUDE" ]; then grep -vxF "$LINE" "$EXCLUDE" > "$EXCLUDE.tmp" || true; mv "$EXCLUDE.tmp" "$EXCLUDE"; fi
    git reset -q HEAD -- "$DIR"
    git diff --quiet HEAD -- "$DIR" || { echo "slot_slim: $DIR differs from HEAD on disk" >&2; exit 1; }
    echo "slot_slim: off ($DIR tracked again)"
    ;;
  status)
    if git ls-files --error-unmatch "$DIR" >/dev/null 2>&1; then echo "off"; else echo "on"; fi
    ;;
  *) echo "usage: $0 on|off|status" >&2; exit 2 ;;
esac
