#!/usr/bin/env bash
# Train on two nodes with torchrun: run this on each node, ADAPTIVE_DS_NODE_RANK=0 on the one whose address is
# ADAPTIVE_DS_MASTER_ADDR and ADAPTIVE_DS_NODE_RANK=1 on the other. Both must see the same --output_dir (shared
# storage), since every rank saves its part of each checkpoint there.
#
#   ADAPTIVE_DS_MASTER_ADDR=node1 ADAPTIVE_DS_NODE_RANK=0 ADAPTIVE_DS_NPROC_PER_NODE=4 \
#       bash examples/torchrun_two_nodes.sh --ds_config ds_configs/b7_8gpu.json
#   ADAPTIVE_DS_MASTER_ADDR=node1 ADAPTIVE_DS_NODE_RANK=1 ADAPTIVE_DS_NPROC_PER_NODE=4 \
#       bash examples/torchrun_two_nodes.sh --ds_config ds_configs/b7_8gpu.json
#
# Flags go to the training run (default: the debug CPU config). ADAPTIVE_DS_NPROC_PER_NODE is the processes per node
# (default 1), ADAPTIVE_DS_MASTER_ADDR the first node's address (default localhost) and ADAPTIVE_DS_MASTER_PORT its
# rendezvous port (default 29731, not torchrun's 29500, which another job on the node may hold). On one machine, two
# "nodes" of one process each:
#   ADAPTIVE_DS_NODE_RANK=0 bash examples/torchrun_two_nodes.sh --output_dir runs/two_nodes &
#   ADAPTIVE_DS_NODE_RANK=1 bash examples/torchrun_two_nodes.sh --output_dir runs/two_nodes
set -euo pipefail
: "${ADAPTIVE_DS_NODE_RANK:?set ADAPTIVE_DS_NODE_RANK: 0 on the first node, 1 on the second}"
exec torchrun --nnodes 2 --node_rank "$ADAPTIVE_DS_NODE_RANK" --nproc_per_node "${ADAPTIVE_DS_NPROC_PER_NODE:-1}" \
    --master_addr "${ADAPTIVE_DS_MASTER_ADDR:-localhost}" --master_port "${ADAPTIVE_DS_MASTER_PORT:-29731}" \
    launchers/train.py --ds_config ds_configs/debug_cpu.json "$@"
