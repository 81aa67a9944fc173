"""`python -m adaptive_ds.grid` runs `adaptive_ds.tools.grid`, the benchmark grid: this module path is kept for the
commands written with it."""

if __name__ == "__main__":
    from adaptive_ds.tools.grid import main

    main()
