#!/usr/bin/env bash
# Train on your own text: JSON lines (.jsonl, .json, .json.gz) or Parquet files with a "text" field, a file, a folder
# or a glob. The files are tokenized once into a prepared directory (a byte-level BPE trained on them), then the debug
# model trains on it; a run started again with the same command resumes.
#
#   bash examples/own_data.sh 'my_corpus/*.jsonl'
#   bash examples/own_data.sh my_corpus.parquet --max_steps 2000 --save_steps 500
#
# Flags after the data go to the training run. ADAPTIVE_DS_OUT (default runs/own_data) holds prepared/ and run/;
# ADAPTIVE_DS_TOKENIZER (default bpe:8192), ADAPTIVE_DS_TEXT_FIELD (default text) and ADAPTIVE_DS_VALIDATION_SHARE
# (default 0.01) choose the tokenizer, the field that holds each document and the share of documents held out.
set -euo pipefail
data=${1:?usage: bash examples/own_data.sh FILES [TRAINING FLAGS...]}
shift
out=${ADAPTIVE_DS_OUT:-runs/own_data}
python -m adaptive_ds.data.prepare --data "$data" --text_field "${ADAPTIVE_DS_TEXT_FIELD:-text}" \
    --tokenizer "${ADAPTIVE_DS_TOKENIZER:-bpe:8192}" --validation_share "${ADAPTIVE_DS_VALIDATION_SHARE:-0.01}" \
    --seq_len 256 --out "$out/prepared"
python launchers/train.py --ds_config ds_configs/debug_cpu.json --data "$out/prepared" --output_dir "$out/run" "$@"
