#!/bin/bash
# The power pilot of experiments/curves_protocol.yaml (NOT part of the analysis): exact vs the positive control
# (train.control_cosine=0.5) on the DanceGRPO curves recipe, seeds 900-902, two runs at a time, one thread each.
# Needs `make pretrain`. Then: python experiments/curves.py --pilot-report runs/pilot/dancegrpo
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONHASHSEED=0
PY=${PY:-python}
one() {
  arm=$1; seed=$2; extra=""
  [ "$arm" = control_0.5 ] && extra="train.control_cosine=0.5"
  d=runs/pilot/dancegrpo/${arm}_seed${seed}
  [ -f "$d/done" ] && return 0
  start=$(date +%s)
  "$PY" -m jagg.train --config configs/world/curves_flux_dancegrpo.yaml backward.strategy=exact $extra \
    train.seed="$seed" "reward.eval=[pref, clip, attr, attr_geom]" log.run_dir="$d" --overwrite > "$d.log" 2>&1
  echo ok > "$d/done"
  echo "$arm $seed $(( $(date +%s) - start )) s"
}
export -f one; export PY
mkdir -p runs/pilot/dancegrpo
printf "%s\n" "exact 900" "control_0.5 900" "exact 901" "control_0.5 901" "exact 902" "control_0.5 902" \
  | xargs -P 2 -L 1 bash -c 'one $0 $1'
