"""`python -m adaptive_ds.benchmark` runs `adaptive_ds.tools.benchmark`, the throughput, memory and generation
benchmark: this module path is kept for the commands written with it."""

if __name__ == "__main__":
    from adaptive_ds.tools.benchmark import main

    main()
