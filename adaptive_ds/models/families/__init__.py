"""Model families: which pretrained folders a run starts from, as which adaptive_ds architecture, and which stock
transformers classes a trained model converts to.

A family is one `Family` record (registry.py), registered under its Hugging Face `model_type`: the stock class and
config class, the architecture it imports as, the config fields it fixes and its routing, the features it has that
adaptive_ds's models lack, how its weight names map to ours, and, where a model can be one of its stock models, the
export (why a model cannot be one, and the conversion). `pretrained.Source` (`--init_from`) and `export.convert`
(`--to`) ask the registry; neither knows a family by name.

Adding a family (a Llama-style model with other names, say) is a module here that builds its `Family` (reusing
llama.py's fields and checks where they apply) and one `register_family` line below; its tests show the import
round trip against the stock class (tests/unit/test_families.py). The rules of starting another architecture from
a dense model live with the upcycling (models/upcycling.py), which every family shares.

The standalone model code that final/ folders carry (export.final.model_source_files: modeling.py and what it
imports) does not import this package.
"""

from .llama import LLAMA
from .mistral import MISTRAL
from .mixtral import MIXTRAL
from .own import ADAPTIVE_DS
from .qwen2 import QWEN2
from .qwen3 import QWEN3
from .qwen3_moe import QWEN3_MOE
from .registry import FAMILIES, Family, auto_export_model_type, exportable, family_of, register_family, supported

for _family in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, ADAPTIVE_DS):
    register_family(_family)

__all__ = ["ADAPTIVE_DS", "FAMILIES", "LLAMA", "MISTRAL", "MIXTRAL", "QWEN2", "QWEN3", "QWEN3_MOE", "Family",
           "auto_export_model_type", "exportable", "family_of", "register_family", "supported"]
