"""Fine-tune final/ folders with transformers' Trainer and its own DeepSpeed integration (ZeRO-2, CPU), as a user
who downloaded them does: loaded with `trust_remote_code=True`, where adaptive_ds is not installed.

    python tests/helpers/hf_trainer_finetune.py OUT_JSON STEPS FOLDER...

Launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) come from the caller. Each folder is
trained STEPS steps on the same 8 sequences of its tokenizer's vocabulary; OUT_JSON gets {folder: `finetune`'s
report}.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

ZERO_2 = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                              "torch_adam": True}},
    "zero_optimization": {"stage": 2}, "steps_per_print": 10**6,
}


class Sequences(torch.utils.data.Dataset):
    def __init__(self, vocab_size: int, count: int = 8, length: int = 32):
        self.ids = torch.randint(3, vocab_size, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def finetune(folder: str, steps: int, output_dir: str) -> dict:
    """{"losses": the loss of each step, "engine": the class that trained, "zero_stage": its ZeRO stage}."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__module__.startswith("transformers_modules."), type(model)  # the folder's own code
    args = TrainingArguments(output_dir=output_dir, deepspeed=ZERO_2, max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=3e-3, warmup_steps=0, lr_scheduler_type="constant", logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(model.config.vocab_size))
    trainer.train()
    engine = trainer.model_wrapped
    return {"losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "engine": type(engine).__name__, "zero_stage": engine.zero_optimization_stage()}


def main() -> None:
    out_json, steps, *folders = sys.argv[1:]
    reports = {folder: finetune(folder, int(steps), f"{folder}-trainer") for folder in folders}
    with open(out_json, "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    main()
