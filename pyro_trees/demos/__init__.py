"""Demos: each module fits one model family on its paper's toy problem in seconds.

Every module exposes ``run(out_dir: pathlib.Path, smoke: bool = False) -> list[dict]``
that saves figures into ``out_dir`` and returns summary rows ``{"model", "task",
"metric", "paper", "ours", "seconds"}``.
"""
