#!/usr/bin/env bash
# Train on two nodes with torchrun: run this on each node, NODE_RANK=0 on the one whose address is MASTER_ADDR and
# NODE_RANK=1 on the other. Both must see the same OUTPUT_DIR (shared storage), since every rank saves its part of each
# checkpoint there.
#
#   MASTER_ADDR=node1 NODE_RANK=0 NPROC_PER_NODE=4 bash examples/torchrun_two_nodes.sh --ds_config ds_configs/b7_8gpu.json
#   MASTER_ADDR=node1 NODE_RANK=1 NPROC_PER_NODE=4 bash examples/torchrun_two_nodes.sh --ds_config ds_configs/b7_8gpu.json
#
# Flags go to the training run (default: the debug CPU config). On one machine, two "nodes" of one process each:
#   MASTER_ADDR=localhost NODE_RANK=0 bash examples/torchrun_two_nodes.sh --output_dir runs/two_nodes &
#   MASTER_ADDR=localhost NODE_RANK=1 bash examples/torchrun_two_nodes.sh --output_dir runs/two_nodes
set -euo pipefail
: "${NODE_RANK:?set NODE_RANK: 0 on the first node, 1 on the second}"
exec torchrun --nnodes 2 --node_rank "$NODE_RANK" --nproc_per_node "${NPROC_PER_NODE:-1}" \
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-29500}" \
    launchers/train.py --ds_config ds_configs/debug_cpu.json "$@"
