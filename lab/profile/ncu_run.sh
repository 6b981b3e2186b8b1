#!/bin/bash
# One device call: Nsight Compute profiles of the Hopper kernel on the shapes given as BSxKV
# (default 4x1024 32x1024 256x1024), clocks left alone, caches flushed before the
# profiled launch (ncu's default; the runner's flush also leaves dirty lines, ncu's does not).
# Writes to ${OUT:-.}, per shape: the report's details page (text) with lab/profile/ncu_summary.py's
# summary of the stall samples appended, and the per-instruction SASS source page (csv).
HERE=$(cd "$(dirname "$0")" && pwd)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu here"; exit 1; }
DEST=${OUT:-.}
SHAPES=${*:-4x1024 32x1024 256x1024}
for shape in $SHAPES; do
  bs=${shape%x*}; kv=${shape#*x}
  "$NCU" --clock-control none -k regex:hopper --launch-skip 2 --launch-count 1 --set full \
      --import-source yes -f -o "$DEST/ncu_${shape}" python3 "$HERE/ncu_probe.py" "$bs" "$kv" > "$DEST/ncu_${shape}.log" 2>&1
  { cat "$DEST/ncu_${shape}.log"; "$NCU" -i "$DEST/ncu_${shape}.ncu-rep" --page details; } > "$DEST/ncu_${shape}_details.txt" 2>&1
  "$NCU" -i "$DEST/ncu_${shape}.ncu-rep" --page source --csv --print-source sass > "$DEST/ncu_${shape}_sass.csv" 2>&1
  python3 "$HERE/ncu_summary.py" "$DEST/ncu_${shape}_sass.csv" >> "$DEST/ncu_${shape}_details.txt" 2>&1
  rm -f "$DEST/ncu_${shape}.ncu-rep" "$DEST/ncu_${shape}.log"
  echo "$shape: $(grep -m1 -E 'Duration' "$DEST/ncu_${shape}_details.txt")"
done
