"""`python -m adaptive_ds.data.benchmark` runs `adaptive_ds.tools.data_benchmark`, the data pipeline benchmark: this
module path is kept for the commands written with it."""

if __name__ == "__main__":
    from adaptive_ds.tools.data_benchmark import main

    main()
