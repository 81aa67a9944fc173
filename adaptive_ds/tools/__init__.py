"""The commands that measure, compare and plan, built on the library beside them (models, data, training, export):

- acceptance: the GPU acceptance run (a dry run of its stages without CUDA);
- benchmark: side-by-side throughput, peak memory against the planner, generation speed;
- grid (+ grid_spec, grid_runs, grid_tables): variants x seeds trained and read, their statistics, tables and plots;
- loss_breakdown: a trained model's loss on the embedded corpus by kind of token;
- plan (+ plan_advice): memory, throughput and cost projections, and what runs where a plan does not;
- report: the JSON reports behind BENCHMARKS.md and their provenance (machine, commit);
- data_benchmark: the data pipeline (preparing, streaming, prepared reading) against the GPUs' needs.

The library never imports them.
"""
