"""`python -m adaptive_ds.loss_breakdown` runs `adaptive_ds.tools.loss_breakdown`, the loss broken down by kind of
token. Deprecated in 0.2, removed in 0.3: the commands that committed reports cite use this module path; new commands
use `python -m adaptive_ds.tools.loss_breakdown`."""

import warnings

# Attributed to this module: under `python -m` that is __main__, whose DeprecationWarnings Python shows by default.
warnings.warn("python -m adaptive_ds.loss_breakdown is deprecated and goes in 0.3: "
              "run python -m adaptive_ds.tools.loss_breakdown", DeprecationWarning, stacklevel=1)

if __name__ == "__main__":
    from adaptive_ds.tools.loss_breakdown import main

    main()
