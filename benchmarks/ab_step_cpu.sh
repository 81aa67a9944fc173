#!/usr/bin/env bash
# Training step time of this checkout against an older commit, side by side on one machine: the same command in
# both trees, rounds interleaved with the order alternating,
#   python -m adaptive_ds.training --ds_config ds_configs/debug_cpu.json --max_steps 60 --eval_steps 0 --save_steps 0
# and each run's data wait + training seconds (summary.json `time_breakdown_s`) printed.
#
#   benchmarks/ab_step_cpu.sh [OLD_COMMIT (default ff5bff4)] [ROUNDS (default 7)]
#
# Uses this checkout's .venv (make setup) for both trees; the old tree is a temporary git worktree.
set -euo pipefail
cd "$(dirname "$0")/.."
old_commit=${1:-ff5bff4}
rounds=${2:-7}
new=$PWD
work=$(mktemp -d)
git worktree add --detach "$work/old" "$old_commit" > /dev/null
trap 'git worktree remove --force "$work/old"; rm -rf "$work"' EXIT
export TORCH_EXTENSIONS_DIR=$new/.venv/torch_extensions PATH=$new/.venv/bin:$PATH
echo "round tree data+train_s train_s data_s training_tokens_per_s"
for round in $(seq 1 "$rounds"); do
  order="old new"; [ $((round % 2)) = 0 ] && order="new old"
  for tree in $order; do
    dir=$new; [ "$tree" = old ] && dir=$work/old
    out=$work/$tree-$round
    (cd "$dir" && PYTHONPATH=$dir python -m adaptive_ds.training --ds_config ds_configs/debug_cpu.json \
      --max_steps 60 --eval_steps 0 --save_steps 0 --output_dir "$out" > "$out.log" 2>&1)
    python - "$out/summary.json" "$round" "$tree" <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
b = summary["time_breakdown_s"]
print(sys.argv[2], sys.argv[3], f"{b['data'] + b['train']:.1f}", f"{b['train']:.1f}", f"{b['data']:.2f}",
      round(summary["training_tokens_per_s"]))
EOF
  done
done
