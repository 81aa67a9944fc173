#!/usr/bin/env bash
# Compare the four architectures on the same data and token budget: each variant trained once per seed, then the
# grid's tables (validation loss; train loss at equal FLOPs, tokens and seconds; each against dense, paired by seed,
# with a verdict) and its loss plots, under runs/compare/report.
#
#   bash examples/compare_architectures.sh                       # 1M tokens per run, seeds 1 2 3
#   bash examples/compare_architectures.sh --tokens 4000000 --variants dense mod 'dense+{"tokens": 2250000}'
#
# Any grid flag given here replaces the default below (python -m adaptive_ds.tools.grid --help lists them). The same
# command again keeps the runs that finished and trains only the rest.
set -euo pipefail
python -m adaptive_ds.tools.grid --preset debug --data embedded:hard --tokens 1000000 --seeds 1 2 3 \
    --variants dense moe mod hybrid --runs runs/compare --out runs/compare/report "$@"
