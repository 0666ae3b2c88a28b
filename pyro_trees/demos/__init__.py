"""Small end-to-end demos, one per paper, run by ``python -m pyro_trees.demo``.

Each module exposes ``run(out_dir, smoke=False) -> list[dict]``: it fits its model on
the paper's toy problem in well under a minute on 2 CPU cores, saves figures into
``out_dir`` and returns summary rows ``{"model", "task", "metric", "paper", "ours",
"seconds"}``.
"""
