"""A trained model out of the harness: for users with torch and transformers alone, and for the Hub.

- final: the `save_pretrained` folder with the model's source files and `auto_map` (`final/`, Hub snapshots,
  exports, a fine-tuned model's merged folder; `save_standalone` also writes a stock class's folder);
- convert: a training checkpoint to that folder, or a model to a family's stock class
  (`python -m adaptive_ds.export`);
- hub: the model card and Hub pushes.
"""
