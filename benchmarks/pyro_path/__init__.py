"""The Pyro user's path, measured: each system's documented plain-SVI snippet, run as
written (model and guide with their defaults, the shortest ``pyro.infer.SVI`` loop) on its
paper's toy problem, its figure printed beside the paper's.

Run all systems: ``python -m benchmarks.pyro_path [--seeds 3] [--only hme,vart]``.
Each system is one module here with a ``run(seed: int)`` returning a record (or a list
of records, one per figure) with at least ``{"system", "figure", "ours", "paper", "steps",
"seconds"}``; ``SYSTEMS`` lists them.
"""

SYSTEMS = ["hme", "bayesian_hme", "vart", "dgp", "heteroscedastic_gp", "treevi"]
