#!/bin/sh
# 1F1B against the same schedule with one action moved (rank 0's third forward before its first backward),
# trained alternately ROUNDS times; one line per run: round, schedule, step ms, bubble measured and simulated,
# activation peak per rank (MiB), last loss. Run from this folder: sh rounds.sh [ROUNDS]
set -e
rounds=${1:-3}
out=$(mktemp -d)
pipeweave simulate -s 1f1b --stages 2 --microbatches 4 --csv "$out/1f1b.csv" > /dev/null
sed '1s/0F0,0F1,0B0,0F2/0F0,0F1,0F2,0B0/' "$out/1f1b.csv" > "$out/moved.csv"
cmp -s "$out/moved.csv" moved.csv || { echo "moved.csv differs from the edit of 1f1b.csv"; exit 1; }
for r in $(seq "$rounds"); do
  for s in 1f1b moved; do
    pipeweave train --schedule-file "$out/$s.csv" --steps 20 --quiet --out "$out/$s-$r"
    python - "$out/$s-$r/train.json" "$r" "$s" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
peaks = [round(b / 2**20, 1) for b in d["peak_activation_bytes"]]
print(sys.argv[2], sys.argv[3], f"{d['step_time_s'] * 1e3:.1f}", f"{d['bubble_ratio']:.3f}",
      f"{d['bubble_ratio_simulated']:.3f}", peaks, f"{d['losses'][-1]:.4f}")
PY
  done
done
uptime
