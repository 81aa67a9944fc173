#!/usr/bin/env bash
# Continue pretraining a stock Llama checkpoint, then upcycle the result to MoE (every expert a copy of its MLP).
#
#   bash examples/init_from_llama.sh TinyLlama/TinyLlama_v1.1 'my_corpus/*.jsonl'
#   bash examples/init_from_llama.sh TinyLlama/TinyLlama_v1.1 allenai/c4 --data_config en --max_steps 2000
#
# LLAMA is a local folder or a Hub id of a stock LlamaForCausalLM (safetensors weights and its tokenizer); DATA what
# --data takes (the text is tokenized with the folder's tokenizer). Flags after DATA go to both runs.
# ADAPTIVE_DS_DS_CONFIG (default ds_configs/b1_a100.json: TinyLlama-1.1B has the b1 preset's shape) must name the
# folder's preset or none; ADAPTIVE_DS_OUT (default runs/from_llama) gets dense/, the continued Llama, and moe/, its
# upcycled MoE.
set -euo pipefail
llama=${1:?usage: bash examples/init_from_llama.sh LLAMA DATA [TRAINING FLAGS...]}
data=${2:?usage: bash examples/init_from_llama.sh LLAMA DATA [TRAINING FLAGS...]}
shift 2
ds_config=${ADAPTIVE_DS_DS_CONFIG:-ds_configs/b1_a100.json}
out=${ADAPTIVE_DS_OUT:-runs/from_llama}
# 1. the Llama's weights, trained further as a dense model (a fresh optimizer, schedule and data position)
python launchers/train.py --ds_config "$ds_config" --init_from "$llama" --data "$data" --output_dir "$out/dense" "$@"
# 2. that model upcycled: dropless routing, so that training starts from the dense model's function exactly
python launchers/train.py --ds_config "$ds_config" --init_from "$out/dense/final" --arch moe \
    --model '{"moe_drop_tokens": false}' --data "$data" --output_dir "$out/moe" "$@"
