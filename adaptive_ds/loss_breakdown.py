"""`python -m adaptive_ds.loss_breakdown` runs `adaptive_ds.tools.loss_breakdown`, the loss broken down by kind of
token: this module path is kept for the commands written with it."""

if __name__ == "__main__":
    from adaptive_ds.tools.loss_breakdown import main

    main()
