#!/bin/bash
# The power pilots of experiments/curves_protocol.yaml (NOT part of the analysis): exact vs the positive control
# (train.control_cosine=0.5) on the DanceGRPO curves recipe of protocol version 1 (32 rollouts per iteration,
# 48 iterations, lr 1e-4) plus overrides, seeds 900-902, two runs at a time, one thread each. Needs
# `make pretrain`. Usage:
#   bash experiments/curves_pilot.sh NAME [override ...]      -> runs/pilot/NAME/<arm>_seed<k>/
#   python experiments/curves.py --pilot-report runs/pilot/NAME [--pilot-iteration 24]
# The pilots of protocol version 2 (their numbers are in the protocol file):
#   bash experiments/curves_pilot.sh dancegrpo
#   bash experiments/curves_pilot.sh lr2e-4 optim.lr=2.0e-4
#   bash experiments/curves_pilot.sh lr3e-4 optim.lr=3.0e-4
#   bash experiments/curves_pilot.sh rollouts64 train.prompts_per_iter=8 train.grad_accum=4
# After version 2's analysis (a pilot for a later version; CONTROL sets the control's cosine, default 0.5):
#   CONTROL=0.2 bash experiments/curves_pilot.sh v2_control0.2 train.prompts_per_iter=8 train.grad_accum=4 \
#     train.iterations=24
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONHASHSEED=0
name=${1:?usage: curves_pilot.sh NAME [override ...]}
shift
# protocol version 1's recipe, on top of which every pilot varies one thing
export PY=${PY:-python} NAME=$name OVERRIDES="$*" CONTROL=${CONTROL:-0.5} V1="train.prompts_per_iter=4 train.grad_accum=2 train.iterations=48"
one() {
  arm=$1; seed=$2; extra=""
  [ "$arm" = control ] && arm=control_$CONTROL && extra="train.control_cosine=$CONTROL"
  d=runs/pilot/$NAME/${arm}_seed${seed}
  [ -f "$d/done" ] && return 0
  start=$(date +%s)
  # shellcheck disable=SC2086  # OVERRIDES: one word per override
  "$PY" -m jagg.train --config configs/world/curves_flux_dancegrpo.yaml backward.strategy=exact $extra \
    $V1 $OVERRIDES train.seed="$seed" "reward.eval=[pref, clip, attr, attr_geom]" log.run_dir="$d" --overwrite \
    > "$d.log" 2>&1
  echo ok > "$d/done"
  echo "$NAME $arm $seed $(( $(date +%s) - start )) s"
}
export -f one
mkdir -p "runs/pilot/$name"
printf "%s\n" "exact 900" "control 900" "exact 901" "control 901" "exact 902" "control 902" \
  | xargs -P 2 -L 1 bash -c 'one $0 $1'
