#!/usr/bin/env bash
# Continue pretraining a stock Llama checkpoint, then upcycle the result to MoE (every expert a copy of its MLP).
#
#   bash examples/init_from_llama.sh TinyLlama/TinyLlama_v1.1 'my_corpus/*.jsonl'
#   bash examples/init_from_llama.sh TinyLlama/TinyLlama_v1.1 allenai/c4 --data_config en --max_steps 2000
#
# LLAMA is a local folder or a Hub id of a stock LlamaForCausalLM (safetensors weights and its tokenizer); DATA what
# --data takes (the text is tokenized with the folder's tokenizer). Flags after DATA go to both runs. DS_CONFIG
# (default ds_configs/b1_a100.json: TinyLlama-1.1B has the b1 preset's shape) must name the folder's preset or none;
# OUT (default runs/from_llama) gets dense/, the continued Llama, and moe/, its upcycled MoE.
set -euo pipefail
LLAMA=${1:?usage: bash examples/init_from_llama.sh LLAMA DATA [TRAINING FLAGS...]}
DATA=${2:?usage: bash examples/init_from_llama.sh LLAMA DATA [TRAINING FLAGS...]}
shift 2
DS_CONFIG=${DS_CONFIG:-ds_configs/b1_a100.json}
OUT=${OUT:-runs/from_llama}
# 1. the Llama's weights, trained further as a dense model (a fresh optimizer, schedule and data position)
python launchers/train.py --ds_config "$DS_CONFIG" --init_from "$LLAMA" --data "$DATA" --output_dir "$OUT/dense" "$@"
# 2. that model upcycled: dropless routing, so that training starts from the dense model's function exactly
python launchers/train.py --ds_config "$DS_CONFIG" --init_from "$OUT/dense/final" --arch moe \
    --model '{"moe_drop_tokens": false}' --data "$DATA" --output_dir "$OUT/moe" "$@"
