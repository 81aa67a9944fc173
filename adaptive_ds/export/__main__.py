"""`python -m adaptive_ds.export SRC DST [--to MODEL_TYPE|auto]`: see `adaptive_ds.export.convert`."""

from .convert import main

if __name__ == "__main__":
    main()
