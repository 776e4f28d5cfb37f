#!/bin/bash
# pilot: exact vs positive control (cos 0.5) on the DanceGRPO curves recipe, seeds 900-902
cd /work/wt-quality
export PYTHONPATH=/work/wt-quality/src JAGG_WORLD_CACHE=/work/main/cache/world OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0
PY=/work/main/.venv/bin/python
one() {
  arm=$1; seed=$2; extra=""
  [ "$arm" = control_0.5 ] && extra="train.control_cosine=0.5"
  d=runs/pilot/dancegrpo/${arm}_seed${seed}
  [ -f $d/done ] && return
  start=$(date +%s)
  $PY -m jagg.train --config configs/world/curves_flux_dancegrpo.yaml backward.strategy=exact $extra train.seed=$seed \
     "reward.eval=[pref, clip, attr, attr_geom]" log.run_dir=$d --overwrite > $d.log 2>&1 && echo ok > $d/done
  echo "$arm $seed $(( $(date +%s) - start )) s rc=$?"
}
export -f one; export PY
mkdir -p runs/pilot/dancegrpo
printf "%s\n" "exact 900" "control_0.5 900" "exact 901" "control_0.5 901" "exact 902" "control_0.5 902" | xargs -P 2 -L 1 bash -c 'one $0 $1'
