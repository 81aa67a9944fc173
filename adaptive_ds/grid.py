"""`python -m adaptive_ds.grid` runs `adaptive_ds.tools.grid`, the benchmark grid. Deprecated in 0.2, removed in 0.3:
the commands that committed reports cite use this module path; new commands use `python -m adaptive_ds.tools.grid`."""

import warnings

# Attributed to this module: under `python -m` that is __main__, whose DeprecationWarnings Python shows by default.
warnings.warn("python -m adaptive_ds.grid is deprecated and goes in 0.3: "
              "run python -m adaptive_ds.tools.grid", DeprecationWarning, stacklevel=1)

if __name__ == "__main__":
    from adaptive_ds.tools.grid import main

    main()
