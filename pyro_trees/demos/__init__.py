"""Small demos, one per model family: ``run(out_dir, smoke=False) -> list[dict]``.

Each fits its family on the paper's toy problem in well under a minute on two CPU cores,
saves a figure or two into ``out_dir`` and returns summary rows ``{"model", "task",
"metric", "paper", "ours", "seconds"}``.
"""
