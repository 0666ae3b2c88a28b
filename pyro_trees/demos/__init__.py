"""Small demos: each ``pyro_trees.demos.<family>.run(out_dir, smoke=False)`` fits a model
on its paper's toy problem in well under a minute and returns summary rows."""
