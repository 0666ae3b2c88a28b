"""Scikit-learn style estimators on top of the Pyro models and guides."""

__all__: list[str] = []
