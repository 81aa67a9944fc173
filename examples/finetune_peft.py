"""Fine-tune a trained adaptive_ds model with transformers' Trainer and LoRA adapters (peft).

    python examples/finetune_peft.py runs/my-run/final --data my_texts.jsonl --out runs/my-run-lora

MODEL is a run's final/ folder (or an exported or downloaded one); --data a JSON-lines file with a "text" field.
Only the LoRA adapters on the attention projections train; --out gets the adapters (peft's format) and, in
--out/merged, the model with the adapters merged in, a folder that loads as the original did: an adaptive_ds model
with its source files, so that torch and transformers alone load it (`trust_remote_code=True`), as they load final/.
"""

import argparse
import json
import os

import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainingArguments,
)

import adaptive_ds.models  # noqa: F401  (registers the Auto classes)
from adaptive_ds.export.final import save_standalone


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="LoRA fine-tuning of an adaptive_ds model with transformers' Trainer.")
    p.add_argument("model", help="a save_pretrained folder, e.g. runs/my-run/final")
    p.add_argument("--data", required=True, help="JSON lines with a 'text' field")
    p.add_argument("--out", required=True, help="folder for the adapters and the merged model")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    args = p.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(model, lora)
    model.print_trainable_parameters()

    texts = load_dataset("json", data_files=args.data, split="train")
    data = texts.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=args.seq_len),
                     batched=True, remove_columns=texts.column_names)
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                                 learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=data,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()

    model.save_pretrained(args.out)
    merged = os.path.join(args.out, "merged")
    save_standalone(model.merge_and_unload(), tokenizer, merged)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    report = {"losses": losses, "adapters": args.out, "merged": merged}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
