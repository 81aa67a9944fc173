"""The hard tier's fact table is the same in every process and for every seed."""

import hashlib
import importlib.util
import subprocess
import sys

from adaptive_ds.data.embedded import (
    SYLLABLES,
    block,
    fact_table,
)

# sha256 of the fact table's names and facts: a changed table makes hard-tier results incomparable
TABLE_DIGEST = "656464a9744f02f951810a6fd864eb11"


def _table_digest(table) -> str:
    return hashlib.sha256(repr((table.names, table.facts)).encode()).hexdigest()[:32]


def test_the_fact_table_is_fixed_across_processes_and_seeds():
    assert _table_digest(fact_table()) == TABLE_DIGEST
    # a fresh interpreter with another hash seed builds the same table (embedded.py and its disk cache need
    # only the stdlib, so they load without torch: a package stub holds just adaptive_ds/data)
    spec = importlib.util.find_spec("adaptive_ds.data.embedded")
    code = (f"import importlib.util, os, sys, types; p = types.ModuleType('d'); "
            f"p.__path__ = [os.path.dirname({spec.origin!r})]; sys.modules['d'] = p; "
            f"s = importlib.util.spec_from_file_location('d.embedded', {spec.origin!r}); "
            "m = importlib.util.module_from_spec(s); sys.modules['d.embedded'] = m; s.loader.exec_module(m); "
            "import hashlib; t = m.fact_table(); "
            "print(hashlib.sha256(repr((t.names, t.facts)).encode()).hexdigest()[:32])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == TABLE_DIGEST
    # training blocks of two seeds and a validation block state the same facts
    facts = {}
    for namespace in ("train-1", "train-2", "validation-1"):
        for i in range(40):
            t = block(namespace, i, 256, "hard").tokens
            for j in range(len(t) - 4):
                if t[j] == "[facts]" or (t[j] == ";" and t[j + 1] in SYLLABLES):
                    facts.setdefault((tuple(t[j + 1:j + 4]), t[j + 4]), set()).add(t[j + 5])
    assert len(facts) > 200 and all(len(values) == 1 for values in facts.values())
