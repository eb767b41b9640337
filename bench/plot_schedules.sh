#!/usr/bin/env bash
# Per-rank per-step work of the four schedules at P = 8, causal mask: the view
# of Striped Attention (arXiv:2311.09431) Figure 4 and DistFlashAttn (arXiv:2310.03294) Figure 1, drawn from
# the data the planner prints (work = allowed pairs / (N/P)^2, so a full block
# is 1 and a diagonal block ~0.5; white = idle).
#   bench/plot_schedules.sh <path to blockattn_plan> <out.png>
set -euo pipefail
bin=$1
out=$2
data=$(mktemp)
trap 'rm -f "$data"' EXIT
# Work counts do not depend on the hardware figures; --hw only avoids calibrating.
"$bin" --n 8192 --p 8 --heads 1 --dim 128 --mask causal --tile 64x64 --hw a100-nvlink \
  --data "$data" >/dev/null
mapfile -t titles < <(sed -n 's/^# \(.*\) (makespan.*/\1/p' "$data")
mkdir -p "$(dirname "$out")"
gnuplot <<GP
set terminal pngcairo size 1400,420 font "sans,10"
set output "$out"
set multiplot layout 1,4 title "Causal attention, P = 8, N = 8192, tiles 64x64: work per rank and step (1 = a full block of (N/P)^2 pairs)"
set xlabel "step"
set ylabel "rank"
set xrange [-0.5:7.5]
set yrange [-0.5:7.5]
set xtics 1
set ytics 1
set cbrange [0:1]
set palette defined (0 "white", 0.01 "#fde0c5", 0.5 "#f59e4c", 1 "#b3400a")
unset colorbox
$(for i in 0 1 2 3; do
  case "${titles[$i]}" in
    "contiguous + ring") paper="Ring Attention" ;;
    "striped + ring") paper="Striped Attention" ;;
    "zigzag + ring") paper="zigzag / head-tail" ;;
    *) paper="DistFlashAttn, Algorithm 2" ;;
  esac
  [ "$i" = 3 ] && echo "set colorbox"
  echo "set title \"${titles[$i]} ($paper)\" noenhanced"
  echo "plot \"$data\" index $i using 1:2:3 with image notitle, \\"
  echo "     \"$data\" index $i using 1:2:(\$3 > 0 ? sprintf(\"%.2f\", \$3) : \"idle\") with labels font \"sans,7\" notitle"
done)
unset multiplot
GP
echo "wrote $out"
