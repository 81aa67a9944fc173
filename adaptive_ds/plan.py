"""`python -m adaptive_ds.plan` runs `adaptive_ds.tools.plan`, the memory, throughput and cost planner: this module
path is kept for the commands written with it."""

if __name__ == "__main__":
    from adaptive_ds.tools.plan import main

    main()
