#!/usr/bin/env bash
# Train on your own text: JSON lines (.jsonl, .json, .json.gz) or Parquet files with a "text" field, a file, a folder
# or a glob. The files are tokenized once into a prepared directory (a byte-level BPE trained on them), then the debug
# model trains on it; a run started again with the same command resumes.
#
#   bash examples/own_data.sh 'my_corpus/*.jsonl'
#   bash examples/own_data.sh my_corpus.parquet --max_steps 2000 --save_steps 500
#
# Flags after the data go to the training run. OUT (default runs/own_data) holds prepared/ and run/; TOKENIZER
# (default bpe:8192), TEXT_FIELD (default text) and VALIDATION_SHARE (default 0.01) choose the tokenizer, the field
# that holds each document and the share of documents held out.
set -euo pipefail
DATA=${1:?usage: bash examples/own_data.sh FILES [TRAINING FLAGS...]}
shift
OUT=${OUT:-runs/own_data}
python -m adaptive_ds.data.prepare --data "$DATA" --text_field "${TEXT_FIELD:-text}" \
    --tokenizer "${TOKENIZER:-bpe:8192}" --validation_share "${VALIDATION_SHARE:-0.01}" --seq_len 256 --out "$OUT/prepared"
python launchers/train.py --ds_config ds_configs/debug_cpu.json --data "$OUT/prepared" --output_dir "$OUT/run" "$@"
