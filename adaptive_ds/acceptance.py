"""`python -m adaptive_ds.acceptance` runs `adaptive_ds.tools.acceptance`, the GPU acceptance run: this module path
is kept for the commands written with it."""

if __name__ == "__main__":
    from adaptive_ds.tools.acceptance import main

    main()
