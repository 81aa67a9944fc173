"""`python tests/helpers/sigterm_in_import.py MODULE ARGS...`: the training command (ARGS) receiving SIGTERM while
the run's libraries load: the signal arrives as MODULE's import starts, so the import is cut short and what it had
imported so far stays behind half-initialised, as when a launcher stops every process while one of them is still
starting (a peer failed early)."""

import importlib.abc
import os
import signal
import sys

from adaptive_ds.training import __main__ as entry


class _SigtermOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname == self.name:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler raises here, inside the import
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, _SigtermOnImport(sys.argv[1]))
    entry.main(sys.argv[2:])
