"""Python code, for `python -I -c`, that runs as on a machine where some packages are not installed.

`without(packages, body)` prefixes `body` with code that wraps every meta-path finder so that the named packages
(and their submodules) are not found: `import deepspeed` raises ModuleNotFoundError and
`importlib.util.find_spec("deepspeed")` is None, as where it was never installed. It runs before anything else
is imported; `-I` keeps the working directory (the repository) and PYTHONPATH off sys.path.
"""

PRELUDE = '''
import sys

HIDDEN = {hidden!r}


class _Hidden:
    """A meta-path finder that finds nothing of the hidden packages and delegates everything else."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):  # importlib.metadata: the hidden packages have none either
        if not hasattr(self.finder, "find_distributions"):
            return iter(())
        found = self.finder.find_distributions(*args, **kwargs)
        return (d for d in found if (d.name or "").replace("-", "_").lower() not in HIDDEN)

    def invalidate_caches(self):
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


sys.meta_path[:] = [_Hidden(finder) for finder in sys.meta_path]
for _name in HIDDEN:
    try:
        __import__(_name)
        sys.exit(f"{{_name}} is importable")
    except ImportError:
        pass


def loaded_hidden():
    """The hidden packages' modules that were imported after all (none, when nothing needed them)."""
    return sorted(name for name in sys.modules if name.partition(".")[0] in HIDDEN)
'''


def without(packages: tuple[str, ...], body: str) -> str:
    """`body` run where `packages` are not installed; `body` may call `loaded_hidden()`."""
    return PRELUDE.format(hidden=set(packages)) + body
