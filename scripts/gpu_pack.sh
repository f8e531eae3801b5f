#!/usr/bin/env bash
# Copy a GPU slot's results into $OUT (files <= 15 MiB; larger ones split): gpu_pack.sh WORK NAME...
# NAME = a trained variant directory (its published checkpoint, card and facts) or "logs" or "sample".
set -u
W=$1; shift
for n in "$@"; do
  case $n in
    logs) tar -czf $OUT/logs.tgz -C $W log.txt diag.json data.json bench.json $(cd $W && ls *.log 2>/dev/null) 2>/dev/null ;;
    sample) python3 -c "
import numpy as np, sys
sys.path.insert(0, '$HOME/code')
import gpu_distill as g
seqs, tags = g.load_seqs(__import__('pathlib').Path('$W/train.npz'))
rng = np.random.default_rng(0); pick = rng.choice(len(seqs), size=min(6000, len(seqs)), replace=False)
g._save_seqs(__import__('pathlib').Path('$OUT/sample.npz'), [seqs[i] for i in pick], [tags[i] for i in pick])
" ;;
    *) tar -cf $W/$n.tar -C $W $n/config.json $n/model.safetensors $n/README.md $n/facts.json
       split -b 15M -d -a 1 $W/$n.tar $OUT/$n.tar. ;;
  esac
done
ls -la $OUT
