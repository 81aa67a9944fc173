"""`python tests/helpers/sigterm_in_import.py [--in-del] MODULE ARGS...`: the training command (ARGS) receiving SIGTERM
while the run's libraries load: the signal arrives as MODULE's import starts, so the import is cut short and what it
had imported so far stays behind half-initialised, as when a launcher stops every process while one of them is still
starting (a peer failed early).

With --in-del the signal's handler runs inside an object's __del__ instead (as it can whenever one runs), where the
exception it raises is printed ("Exception ignored") and lost, and the import goes on. MODULE `deepspeed.initialize`
(with --in-del) does that as the run builds its engine instead, after the imports, before the loop."""

import importlib.abc
import os
import signal
import sys

from adaptive_ds.training import __main__ as entry


class _SignalledInDel:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # Python runs the handler at one of these instructions: inside this __del__
            pass


class _SigtermOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, in_del: bool):
        self.name, self.in_del = name, in_del

    def find_spec(self, fullname, path, target=None):
        if fullname == self.name:
            sys.meta_path.remove(self)
            if self.in_del:
                _SignalledInDel()  # dropped at once: its __del__ runs here
            else:
                os.kill(os.getpid(), signal.SIGTERM)  # the run's handler raises here, inside the import
        return None


def _signalled_first(initialize):
    def signalled_then_initialize(*args, **kwargs):
        _SignalledInDel()
        return initialize(*args, **kwargs)

    return signalled_then_initialize


if __name__ == "__main__":
    in_del = sys.argv[1] == "--in-del"
    name, *args = sys.argv[2:] if in_del else sys.argv[1:]
    if name == "deepspeed.initialize":
        import deepspeed

        deepspeed.initialize = _signalled_first(deepspeed.initialize)
    else:
        sys.meta_path.insert(0, _SigtermOnImport(name, in_del))
    entry.main(args)
